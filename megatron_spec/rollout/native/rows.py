"""Token rows of different lengths as one padded tensor on the engine's device.

Every drafter and the scheduler turn Python lists of token ids (prompts, pending tokens, proposals) into
``[B, width]`` int64 tensors; :func:`pad_rows` builds them on the host and moves them once, so a GPU
engine pays one copy per tensor rather than one per row. It knows nothing about models or drafting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_rows(rows: Sequence[Sequence[int]], width: int, fill: int, device: torch.device | str) -> torch.Tensor:
    """``[len(rows), width]`` int64: row i's ids, then ``fill`` (each row at most ``width`` long)."""
    out = torch.full((len(rows), width), fill, dtype=torch.long, device="cpu")  # filled on the host
    for i, row in enumerate(rows):
        if len(row):
            out[i, :len(row)] = torch.tensor(list(row), dtype=torch.long, device="cpu")
    return out.to(device)
