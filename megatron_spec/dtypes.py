"""The dtype names settings use, and the torch dtypes they stand for (one table for the package)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def torch_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """``name`` (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``) as a torch dtype;
    a torch dtype passes through. ``what`` names the setting in the error."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"{what} must be one of {sorted(TORCH_DTYPES)}, got {name!r}") from None
