"""Fake (meta) kernels of the compiled ops: output shapes and dtypes only, no data.

Imported by ``megatron_spec.ops`` once ``megatron_spec._C`` has registered the op schemas. Value
checks that need data (token ranges, uniforms in [0, 1), d2t being injective) stay in the real
kernels; shape and dtype checks are repeated here so tracing fails as early as eager does.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("megatron_spec::fp8_block_quantize")
def _fp8_block_quantize_fake(w: torch.Tensor, block_n: int, block_k: int):
    torch._check(
        block_n > 0 and block_k > 0, lambda: f"fp8 block size must be positive, got [{block_n}, {block_k}]"
    )
    torch._check(w.dim() == 2, lambda: f"fp8_block_quantize expects a 2-D weight, got {w.dim()}-D")
    n, k = w.shape
    w_fp8 = w.new_empty((n, k), dtype=torch.uint8)  # e4m3 bytes (see csrc/ops.cpp)
    scale_inv = w.new_empty(((n + block_n - 1) // block_n, (k + block_k - 1) // block_k), dtype=torch.float32)
    return w_fp8, scale_inv


@torch.library.register_fake("megatron_spec::fp8_block_quantize_out")
def _fp8_block_quantize_out_fake(w: torch.Tensor, block_n: int, block_k: int, *, out, scale_inv) -> None:
    torch._check(w.dim() == 2, lambda: f"fp8_block_quantize expects a 2-D weight, got {w.dim()}-D")
    return None


@torch.library.register_fake("megatron_spec::fp8_block_dequantize")
def _fp8_block_dequantize_fake(w_fp8, scale_inv, block_n: int, block_k: int, dtype: torch.dtype):
    torch._check(w_fp8.dim() == 2, lambda: "fp8_block_dequantize expects a 2-D weight")
    torch._check(scale_inv.dim() == 2, lambda: "fp8_block_dequantize expects a 2-D weight_scale_inv")
    return w_fp8.new_empty(w_fp8.shape, dtype=dtype)


@torch.library.register_fake("megatron_spec::verify_chain")
def _verify_chain_fake(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample):
    torch._check(target_logprobs.dim() == 3, lambda: "verify_chain: target_logprobs must be [B, k+1, V]")
    b, k1, _ = target_logprobs.shape
    torch._check(draft_tokens.dim() == 2, lambda: "verify_chain: draft_tokens must be [B, k]")
    tokens = draft_tokens.new_empty((b, k1), dtype=torch.int64)
    num_accepted = draft_tokens.new_empty((b,), dtype=torch.int64)
    return tokens, num_accepted


@torch.library.register_fake("megatron_spec::bits_sums")
def _bits_sums_fake(bits):
    return bits.new_empty(2, dtype=torch.int64)


@torch.library.register_fake("megatron_spec::bits_sums_copy")
def _bits_sums_copy_fake(bits, dst):
    return bits.new_empty(2, dtype=torch.int64)


@torch.library.register_fake("megatron_spec::spec_exp")
def _spec_exp_fake(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_spec::linear_pack_f32")
def _linear_pack_f32_fake(w):
    torch._check(w.dim() == 2, lambda: f"linear_pack_f32 expects a 2-D weight, got {w.dim()}-D")
    n, k = w.shape
    return w.new_empty(((n + 15) // 16, k, 16))


@torch.library.register_fake("megatron_spec::linear_small_f32")
def _linear_small_f32_fake(x, packed, bias, out_features: int):
    torch._check(x.dim() == 2, lambda: f"linear_small_f32 expects a 2-D input, got {x.dim()}-D")
    torch._check(
        packed.dim() == 3 and packed.shape[2] == 16,
        lambda: "linear_small_f32: weight not from linear_pack_f32",
    )
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("megatron_spec::attention_f32")
def _attention_f32_fake(q, k, v, mask, scale: float):
    torch._check(
        q.dim() == 4 and k.dim() == 4, lambda: "attention_f32 expects q [b, nq, t, d] and k [b, nkv, L, d]"
    )
    return q.new_empty(q.shape)


@torch.library.register_fake("megatron_spec::attention_bf16")
def _attention_bf16_fake(q, k, v, mask, scale: float):
    torch._check(
        q.dim() == 4 and k.dim() == 4, lambda: "attention_bf16 expects q [b, nq, t, d] and k [b, nkv, L, d]"
    )
    return q.new_empty(q.shape)


def _rms_norm_fake(x, w, eps: float):
    torch._check(
        x.dim() >= 1 and w.dim() == 1 and w.shape[0] == x.shape[-1],
        lambda: f"rms_norm: input [..., {x.shape[-1] if x.dim() else '?'}] and weight {tuple(w.shape)}",
    )
    return x.new_empty(x.shape)


def _rope_fake(x, cos, sin):
    torch._check(
        x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4,
        lambda: "rope expects x [B, n, T, d] and tables [B, 1, T, d]",
    )
    return x.new_empty(x.shape)


for _dt in ("f32", "bf16"):
    torch.library.register_fake(f"megatron_spec::rms_norm_{_dt}", _rms_norm_fake)
    torch.library.register_fake(f"megatron_spec::rope_{_dt}", _rope_fake)


@torch.library.register_fake("megatron_spec::linear_pack_bf16w")
def _linear_pack_bf16w_fake(w):
    torch._check(w.dim() == 2, lambda: f"linear_pack_bf16w expects a 2-D weight, got {w.dim()}-D")
    n, k = w.shape
    return w.new_empty(((n + 15) // 16, k, 16), dtype=torch.bfloat16)


@torch.library.register_fake("megatron_spec::linear_pack_into")
def _linear_pack_into_fake(w, packed):
    torch._check(w.dim() == 2, lambda: f"linear_pack_into expects a 2-D weight, got {w.dim()}-D")


@torch.library.register_fake("megatron_spec::linear_pack_into_sums")
def _linear_pack_into_sums_fake(w, packed):
    torch._check(w.dim() == 2, lambda: f"linear_pack_into_sums expects a 2-D weight, got {w.dim()}-D")
    return w.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("megatron_spec::linear_pack_bf16")
def _linear_pack_bf16_fake(w):
    torch._check(w.dim() == 2, lambda: f"linear_pack_bf16 expects a 2-D weight, got {w.dim()}-D")
    n, k = w.shape
    return w.new_empty(((n + 15) // 16, (k + 1) // 2, 16, 2))


@torch.library.register_fake("megatron_spec::linear_small_bf16")
def _linear_small_bf16_fake(x, packed, bias, out_features: int):
    torch._check(x.dim() == 2, lambda: f"linear_small_bf16 expects a 2-D input, got {x.dim()}-D")
    torch._check(packed.dim() == 4 and packed.shape[2] == 16 and packed.shape[3] == 2,
                 lambda: "linear_small_bf16: weight not from linear_pack_bf16")
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("megatron_spec::decoder_layers")
def _decoder_layers_fake(x, weights, qkv_bias, cache_k, cache_v, write_index, cos, sin, mask, b: int, t: int,
                         read_len: int, slot_offset: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         intermediate: int, eps: float, scale: float, aux_layers: list[int]):
    torch._check(x.dim() == 2 and x.shape[0] == b * t, lambda: "decoder_layers expects x [b * t, H]")
    torch._check(len(weights) == 6 * len(cache_k), lambda: "decoder_layers: 6 weights a layer")
    return x.new_empty(x.shape), [x.new_empty(x.shape) for _ in aux_layers]
