"""torch.ops wrappers for the compiled kernels in ``csrc/`` and their pure-PyTorch references.

Each public function runs ``torch.ops.megatron_spec.<op>`` when ``megatron_spec._C`` is built and
has a kernel for the tensors' device, and otherwise the reference in this package, which computes
the same bits (``fp8_reference``, ``verify_reference`` over ``ms_math_reference``).
``MEGATRON_SPEC_FORCE_REFERENCE=1`` forces the references. Fake (meta) kernels for the compiled ops are
registered in ``_fake`` so the ops trace under ``torch.compile`` and pass ``torch.library.opcheck``. At the
op level FP8 data is raw e4m3 bytes (uint8); the functions here take and return ``float8_e4m3fn`` views of
them.

This package holds kernels and their references only; the sampling API the engine and the GRPO side
call is ``megatron_spec.speculative``.
"""

from __future__ import annotations

import functools

import torch

from megatron_spec._ext import compiled_ops_available
from megatron_spec.ops.fp8_reference import (
    fp8_block_dequantize_reference,
    fp8_block_quantize_reference,
)
from megatron_spec.ops.ms_math_reference import SAMPLE_CHUNK, inverse_cdf_chunked, spec_exp_reference
from megatron_spec.ops.verify_reference import verify_chain_reference

if compiled_ops_available():
    from megatron_spec.ops import _fake  # noqa: F401  (registers fake kernels)

__all__ = [
    "SAMPLE_CHUNK",
    "check_devices",
    "compiled_kernel_for",
    "fp8_block_dequantize",
    "fp8_block_dequantize_reference",
    "fp8_block_quantize",
    "fp8_block_quantize_reference",
    "inverse_cdf_chunked",
    "spec_exp",
    "spec_exp_reference",
    "verify_chain_op",
    "verify_chain_reference",
]

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def compiled_kernel_for(op_name: str, device: torch.device) -> bool:
    """True when ``torch.ops.megatron_spec.<op_name>`` is built and has a kernel for ``device``."""
    if not compiled_ops_available():
        return False
    key = _DISPATCH_KEYS.get(device.type if isinstance(device, torch.device) else torch.device(device).type)
    return key is not None and _has_kernel(op_name, key)


@functools.cache
def _has_kernel(op_name: str, dispatch_key: str) -> bool:
    # The dispatcher lookup costs tens of microseconds and is asked on every sampling call of the
    # engine (several per verify step); the registrations of _C do not change once it is loaded.
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_spec::{op_name}", dispatch_key)


def check_devices(op: str, first: str, tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """The device of ``tensors[first]``; ValueError naming the argument when another tensor is elsewhere.

    The dispatcher picks the CUDA kernel when any argument is on a GPU; a host tensor beside it would
    reach the kernel as a host pointer and kill the process with an illegal-address error instead of
    raising (the CUDA binding checks again, for callers of ``torch.ops`` directly).
    """
    device = tensors[first].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{op}: {name} is on {t.device}, {first} on {device}; every tensor argument must be "
                f"on one device"
            )
    return device


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> uint8 view (the compiled ops take FP8 as raw bytes, see csrc/ops.cpp)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _block(block_size: tuple[int, int]) -> tuple[int, int]:
    if len(block_size) != 2:
        raise ValueError(f"block_size must be (block_n, block_k), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def fp8_block_quantize(
    w: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a linear weight to FP8 E4M3 with one float32 scale per block.

    Args:
        w: ``[N, K]`` float32 / bfloat16 / float16 weight.
        block_size: ``(block_n, block_k)``; SGLang's ``weight_block_size`` is ``[128, 128]``.
        out: optional preallocated contiguous ``(w_fp8 [N, K] float8_e4m3fn, scale_inv float32
            [ceil(N/bn), ceil(K/bk)])`` to write into (e.g. views into a flattened weight bucket).
        check_finite: refuse weights with NaN or inf (one host sync on the small scale tensor).

    Returns:
        ``(w_fp8 [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32)`` with
        ``w ~= w_fp8 * weight_scale_inv`` (see ``fp8_reference`` for the exact bits).
    """
    bn, bk = _block(block_size)
    if out is not None:
        w_fp8, scale_inv = out
        check_devices("fp8_block_quantize", "w", {"w": w, "out[0]": w_fp8, "out[1]": scale_inv})
        if w_fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_block_quantize: out must be float8_e4m3fn, got {w_fp8.dtype}")
        if compiled_kernel_for("fp8_block_quantize_out", w.device):
            torch.ops.megatron_spec.fp8_block_quantize_out(
                w, bn, bk, out=_as_bytes(w_fp8), scale_inv=scale_inv
            )
        else:
            ref_q, ref_s = fp8_block_quantize_reference(w, bn, bk)
            if ref_q.shape != w_fp8.shape:
                raise ValueError(f"fp8_block_quantize: out must be float8_e4m3fn {list(ref_q.shape)}, got "
                                 f"{w_fp8.dtype} of shape {tuple(w_fp8.shape)}")
            if ref_s.shape != scale_inv.shape or scale_inv.dtype != torch.float32:
                raise ValueError(f"fp8_block_quantize: scale_inv must be float32 {list(ref_s.shape)}, got "
                                 f"{scale_inv.dtype} of shape {tuple(scale_inv.shape)}")
            w_fp8.copy_(ref_q)
            scale_inv.copy_(ref_s)
    elif compiled_kernel_for("fp8_block_quantize", w.device):
        w_bytes, scale_inv = torch.ops.megatron_spec.fp8_block_quantize(w, bn, bk)
        w_fp8 = w_bytes.view(torch.float8_e4m3fn)
    else:
        w_fp8, scale_inv = fp8_block_quantize_reference(w, bn, bk)
    # Host sync: a non-finite weight must stop the weight push here, not corrupt the engine.
    if check_finite and scale_inv.numel() and not bool(torch.isfinite(scale_inv).all()):
        i, j = (~torch.isfinite(scale_inv)).nonzero()[0].tolist()
        raise ValueError(
            f"fp8_block_quantize: weight block ({i}, {j}) (rows {i * bn}..{(i + 1) * bn - 1}, columns "
            f"{j * bk}..{(j + 1) * bk - 1}) contains NaN or inf"
        )
    return w_fp8, scale_inv


def fp8_block_dequantize(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """Inverse of :func:`fp8_block_quantize`: ``w_fp8 [N, K] * weight_scale_inv`` in float32, cast to
    ``dtype``."""
    bn, bk = _block(block_size)
    check_devices("fp8_block_dequantize", "w_fp8", {"w_fp8": w_fp8, "scale_inv": scale_inv})
    if compiled_kernel_for("fp8_block_dequantize", w_fp8.device):
        if w_fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_block_dequantize expects a float8_e4m3fn weight, got {w_fp8.dtype}")
        return torch.ops.megatron_spec.fp8_block_dequantize(_as_bytes(w_fp8), scale_inv, bn, bk, dtype)
    return fp8_block_dequantize_reference(w_fp8, scale_inv, bn, bk, dtype)


def spec_exp(x: torch.Tensor) -> torch.Tensor:
    """The verifier's deterministic float32 exp (``csrc/ms_math.h`` ``spec_expf``)."""
    if compiled_kernel_for("spec_exp", x.device):
        return torch.ops.megatron_spec.spec_exp(x)
    return spec_exp_reference(x)


def verify_chain_op(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    d2t: torch.Tensor | None,
    greedy: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification with explicit uniforms: ``(tokens [B, k+1], num_accepted [B])``.

    Low-level op with the exact argument types of the kernel (see ``verify_reference``); the API
    the engine calls is ``megatron_spec.speculative.verify_chain``.
    """
    device = check_devices(
        "verify_chain",
        "target_logprobs",
        {
            "target_logprobs": target_logprobs,
            "draft_tokens": draft_tokens,
            "draft_probs": draft_probs,
            "d2t": d2t,
            "greedy": greedy,
            "u_accept": u_accept,
            "u_sample": u_sample,
        },
    )
    if compiled_kernel_for("verify_chain", device):
        return torch.ops.megatron_spec.verify_chain(
            target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample
        )
    return verify_chain_reference(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample)
