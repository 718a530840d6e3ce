"""Pure-PyTorch FP8 E4M3 block quantisation: the fallback and the test oracle of the C++/CUDA ops.

Format (what SGLang loads for ``quant_method: fp8`` with ``weight_block_size [128, 128]``):
``w_fp8`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``,
the dequantisation multiplier ``amax / 448`` of each block, so ``w ~= w_fp8 * weight_scale_inv``.

Bit-level convention (that of ``per_block_cast_to_fp8`` in SGLang / DeepGEMM, which is what
produces the DeepSeek-style checkpoints SGLang reads):

* ``amax`` = max |w| over the block in float32, clamped below at 1e-4 (an all-zero block gets
  ``weight_scale_inv = 1e-4 / 448``);
* ``weight_scale_inv = amax / 448`` (IEEE division);
* ``w_fp8 = fp8_rne(w * ((1 / amax) * 448))``: SGLang writes ``448.0 / x_amax``, which torch
  evaluates as ``x_amax.reciprocal() * 448.0`` (``Tensor.__rtruediv__``), two roundings; we do
  the same so the bytes match;
* values are rounded to nearest even and saturated at +-448 (non-finite input is the caller's
  problem: ``megatron_spec.ops.fp8_block_quantize`` refuses it).

Divisions are written tensor / tensor so CUDA does not turn them into reciprocal multiplies.
This module knows nothing of models, names or which tensors should be quantised.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check_blocks(block_n: int, block_k: int) -> None:
    if block_n <= 0 or block_k <= 0:
        raise ValueError(f"fp8 block size must be positive, got [{block_n}, {block_k}]")


def fp8_block_quantize_reference(
    w: torch.Tensor, block_n: int = 128, block_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [N, K]`` to (float8_e4m3fn ``[N, K]``, float32 scale_inv ``[ceil(N/bn), ceil(K/bk)]``)."""
    _check_blocks(block_n, block_k)
    if w.dim() != 2:
        raise ValueError(f"fp8_block_quantize expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_block_quantize expects float32, bfloat16 or float16 weights, got {w.dtype}")
    n, k = w.shape
    nbn, nbk = -(-n // block_n), -(-k // block_k)
    if n == 0 or k == 0:
        return (
            torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device),
            torch.zeros(nbn, nbk, dtype=torch.float32, device=w.device),
        )
    padded = torch.zeros(nbn * block_n, nbk * block_k, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()  # exact for every input dtype
    blocks = padded.view(nbn, block_n, nbk, block_k)  # [nbn, bn, nbk, bk]
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)  # [nbn, 1, nbk, 1]
    scale_inv = amax / torch.full_like(amax, FP8_E4M3_MAX)
    mult = amax.reciprocal() * FP8_E4M3_MAX
    q = (blocks * mult).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    w_fp8 = q.view(nbn * block_n, nbk * block_k)[:n, :k].contiguous()  # [N, K]
    return w_fp8, scale_inv.view(nbn, nbk).contiguous()


def fp8_block_dequantize_reference(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block_n: int = 128,
    block_k: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``w_fp8 [N, K] * scale_inv`` broadcast over 128x128 blocks, in float32, cast to ``dtype``."""
    _check_blocks(block_n, block_k)
    if w_fp8.dim() != 2 or w_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_block_dequantize expects a 2-D float8_e4m3fn weight, got {w_fp8.dtype} "
            f"of shape {tuple(w_fp8.shape)}"
        )
    n, k = w_fp8.shape
    nbn, nbk = -(-n // block_n), -(-k // block_k)
    if tuple(scale_inv.shape) != (nbn, nbk) or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"fp8_block_dequantize expects float32 weight_scale_inv of shape [{nbn}, {nbk}] for weight "
            f"[{n}, {k}] and blocks [{block_n}, {block_k}], got {scale_inv.dtype} of shape "
            f"{tuple(scale_inv.shape)}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"fp8_block_dequantize output dtype must be float32, bfloat16 or float16, got {dtype}"
        )
    full = scale_inv.repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]  # [N, K]
    return (w_fp8.float() * full).to(dtype)
