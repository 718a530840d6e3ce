"""Block-FP8 weights on the wire: which tensors, the names SGLang reads, quantise / dequantise.

An FP8 rollout (``--rollout-weight-dtype fp8``) ships each *linear* weight of the target as
``name`` = float8_e4m3fn ``[N, K]`` plus ``name_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``
(``*.weight`` -> ``*.weight_scale_inv``), the DeepSeek-V3 / Qwen3-FP8 checkpoint layout that
SGLang loads under ``quantization_config`` = :func:`quantization_config` (docs/design.md, "SGLang").
Embeddings, ``lm_head``, norms and biases stay in the streaming dtype: quantising them costs
accuracy and SGLang keeps them unquantised. The EAGLE-3 draft is never quantised.

The numbers themselves come from ``megatron_spec.ops`` (compiled kernel or its reference).
This module only decides names and pairs them up; it does not know about buckets or engines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from megatron_spec.ops import fp8_block_dequantize, fp8_block_quantize

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"

# Linear weights of Llama / Qwen2 / Qwen3 decoder layers, by HF name.
_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The HF ``quantization_config`` SGLang reads for block-FP8 weights (docs/design.md, "SGLang")."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])]}


def is_fp8_weight(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """True for linear weights that travel as block FP8 (2-D decoder-layer projections)."""
    return len(shape) == 2 and _LINEAR.search(name) is not None


def scale_name(name: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale_inv``."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name} is not a weight name (expected '*.weight')")
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, int] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """``[ceil(N/bn), ceil(K/bk)]`` for a ``[N, K]`` weight."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Replace each linear weight by ``(name, w_fp8)`` and ``(name_scale_inv, scale_inv)``;
    other tensors pass through unchanged."""
    for name, t in named:
        if is_fp8_weight(name, tuple(t.shape)):
            w, s = fp8_block_quantize(t.contiguous(), block)
            yield name, w
            yield scale_name(name), s
        else:
            yield name, t


def dequantize_named(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     block: tuple[int, int] = BLOCK) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`quantize_named` on the receiving side: FP8 weights come back as
    ``w_fp8 * weight_scale_inv`` in ``dtype``; every other tensor passes through.

    A weight and its scale must travel in the same bucket (the streamer guarantees it).

    Raises:
        ValueError: an FP8 weight without its scale, a scale without its weight, or an FP8
            tensor that is not a linear weight.
    """
    items = list(named)
    scales = {n: t for n, t in items if n.endswith(SCALE_SUFFIX)}
    out, used = [], set()
    for name, t in items:
        if name in scales:
            continue
        if t.dtype == torch.float8_e4m3fn:
            if not is_fp8_weight(name, tuple(t.shape)):
                raise ValueError(f"{name} arrived as float8_e4m3fn but is not a linear weight")
            sname = scale_name(name)
            if sname not in scales:
                raise ValueError(f"FP8 weight {name} arrived without {sname} in the same bucket")
            out.append((name, fp8_block_dequantize(t, scales[sname], dtype, block)))
            used.add(sname)
        else:
            out.append((name, t))
    orphans = sorted(set(scales) - used)
    if orphans:
        raise ValueError(f"weight_scale_inv without its FP8 weight: {orphans[:3]}")
    return out
