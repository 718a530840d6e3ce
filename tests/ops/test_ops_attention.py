"""The grouped-query attention kernels (csrc/attention_cpu.cpp, fp32 and bf16) and their use by the layers.

Each kernel variant (the scalar loops of the default variant, the AVX2 + FMA path above it) is compared
with a float64 softmax attention on GQA shapes, decode (one query a row) and verify (several), over strided
views of a slot cache like the engine's, with masks that hide cache positions; a query that may attend to
nothing gets zeros. The bf16 kernel widens its inputs exactly and computes in fp32 as the fp32 kernel does,
so its output is the fp32 kernel's output on the widened inputs, rounded once to bf16: bit for bit."""

from __future__ import annotations

import pytest
import torch

import megatron_spec.ops  # noqa: F401  (the fake kernels)
from megatron_spec import _ext

pytestmark = pytest.mark.skipif(not _ext.compiled_ops_available(),
                                reason="megatron_spec._C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")


def reference(q, k, v, mask, scale):
    nq = q.shape[1]
    g = nq // k.shape[1]
    k64, v64 = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)  # a query with nothing to attend: zeros
    return p @ v64


def cache_views(gen, b, nkv, length, d, slots=None, max_len=None):
    """k, v as the engine passes them: ``cache[:b, :, :length]`` of ``[slots, nkv, max_len, d]``."""
    slots, max_len = slots or b + 2, max_len or length + 5
    kc, vc = (torch.randn(slots, nkv, max_len, d, generator=gen) for _ in range(2))
    return kc[:b, :, :length], vc[:b, :, :length]


SHAPES = [(1, 9, 3, 1, 37, 64), (16, 9, 3, 1, 128, 64), (4, 9, 3, 4, 70, 64), (2, 4, 4, 3, 9, 16),
          (3, 8, 2, 2, 20, 12), (1, 2, 1, 5, 6, 8), (1, 2, 1, 1, 1, 8)]


@pytest.mark.parametrize("b,nq,nkv,t,length,d", SHAPES)
def test_matches_float64_attention(kernel_variant, b, nq, nkv, t, length, d):
    gen = torch.Generator().manual_seed(b * 1000 + t * 100 + length)
    # [b, nq, t, d], strided as the layers make it
    q = torch.randn(b, t, nq, d, generator=gen).transpose(1, 2)
    k, v = cache_views(gen, b, nkv, length, d)
    # each row sees its first kv_len positions, causally over its t queries at the end (a verify)
    kv_len = torch.randint(max(1, t), length + 1, (b,), generator=gen)
    pos = kv_len.view(b, 1) - t + torch.arange(t).view(1, t)
    mask = (torch.arange(length).view(1, 1, length) <= pos.view(b, t, 1)).view(b, 1, t, length)
    scale = d ** -0.5
    out = torch.ops.megatron_spec.attention_f32(q, k, v, mask, scale)
    ref = reference(q, k, v, mask, scale)
    assert out.shape == (b, nq, t, d) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("b,nq,nkv,t,length,d", SHAPES)
def test_bf16_is_the_fp32_kernel_rounded_once(kernel_variant, b, nq, nkv, t, length, d):
    gen = torch.Generator().manual_seed(b * 1000 + t * 100 + length + 1)
    q = torch.randn(b, t, nq, d, generator=gen).bfloat16().transpose(1, 2)
    kc, vc = (torch.randn(b + 1, nkv, length + 3, d, generator=gen).bfloat16() for _ in range(2))
    k, v = kc[:b, :, :length], vc[:b, :, :length]  # strided cache views, as the engine passes them
    kv_len = torch.randint(max(1, t), length + 1, (b,), generator=gen)
    pos = kv_len.view(b, 1) - t + torch.arange(t).view(1, t)
    mask = (torch.arange(length).view(1, 1, length) <= pos.view(b, t, 1)).view(b, 1, t, length)
    scale = d ** -0.5
    out = torch.ops.megatron_spec.attention_bf16(q, k, v, mask, scale)
    assert out.shape == (b, nq, t, d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    f32 = torch.ops.megatron_spec.attention_f32(q.float(), k.float(), v.float(), mask, scale)
    assert torch.equal(out, f32.bfloat16())  # widening is exact, the arithmetic the same, one rounding
    # and so within one bf16 rounding (2^-9 relative) of the exact attention of the bf16 inputs
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, scale), rtol=2 ** -8, atol=2e-5)


def test_fully_masked_query_gets_zeros_and_holes_are_skipped(kernel_variant):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 2, 8, generator=gen)
    k, v = cache_views(gen, 2, 2, 10, 8)
    mask = torch.rand(2, 1, 2, 10, generator=gen) > 0.5
    mask[1, 0, 1] = False
    out = torch.ops.megatron_spec.attention_f32(q, k, v, mask, 0.3)
    assert torch.equal(out[1, :, 1], torch.zeros(4, 8))
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, 0.3), rtol=2e-5, atol=2e-5)


def test_refuses_what_it_cannot_run():
    q, k, mask = torch.randn(1, 3, 1, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.megatron_spec.attention_f32(q, k, k, mask, 1.0)
    with pytest.raises(RuntimeError, match="bool"):
        torch.ops.megatron_spec.attention_f32(q[:, :2], k, k, mask.float(), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.megatron_spec.attention_f32(q[:, :2].double(), k, k, mask, 1.0)
    with pytest.raises(RuntimeError, match="mask"):
        torch.ops.megatron_spec.attention_f32(q[:, :2], k, k, mask[..., :3], 1.0)
    with pytest.raises(RuntimeError, match="bfloat16"):  # mixed dtypes
        torch.ops.megatron_spec.attention_bf16(q[:, :2].bfloat16(), k, k.bfloat16(), mask, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.megatron_spec.attention_bf16(q.bfloat16(), k.bfloat16(), k.bfloat16(), mask, 1.0)


def test_opcheck():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    torch.library.opcheck(torch.ops.megatron_spec.attention_f32, (q, k, v, mask, 0.35))
    torch.library.opcheck(
        torch.ops.megatron_spec.attention_bf16, (q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.35)
    )


def test_layers_use_it_in_fp32_and_bf16_and_torch_elsewhere(monkeypatch):
    from megatron_spec.layers import decoder

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 3, 16, generator=gen)
    k, v = cache_views(gen, 2, 3, 12, 16)
    mask = torch.ones(2, 1, 3, 12, dtype=torch.bool).tril(9)
    kernel = torch.ops.megatron_spec.attention_f32(q, k, v, mask, 0.25)
    assert torch.equal(decoder.attend(q, k, v, mask, 0.25), kernel)
    monkeypatch.setitem(decoder._KERNELS, "attention_f32", False)  # as without the extension
    torch.testing.assert_close(decoder.attend(q, k, v, mask, 0.25), kernel, rtol=1e-5, atol=1e-5)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bf = decoder.attend(qb, kb, vb, mask, 0.25)
    assert torch.equal(bf, torch.ops.megatron_spec.attention_bf16(qb, kb, vb, mask, 0.25))
    monkeypatch.setitem(decoder._KERNELS, "attention_bf16", False)  # torch's kernels
    torch.testing.assert_close(
        decoder.attend(qb, kb, vb, mask, 0.25).float(), bf.float(), rtol=2e-2, atol=2e-2
    )
    half = decoder.attend(q.half(), k.half(), v.half(), mask, 0.25)  # no kernel for fp16: torch's
    assert half.dtype == torch.float16
