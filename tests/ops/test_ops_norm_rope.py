"""The fp32 RMSNorm and rotate-half RoPE kernels (csrc/norm_rope_cpu.cpp) and their use by the layers.

Each kernel variant (the scalar loops of the default variant, the AVX2 + FMA path above it) is compared
with float64 references on the engine's shapes (decode rows, verify rows, a prefill, Qwen3's per-head
norms read in place from a split of the qkv projection, the transposed query/key view the engine rotates),
and with torch's own fp32 arithmetic: the norm within fp32 rounding, the rotation bit for bit. The bf16
kernels are compared with torch's bf16 eager arithmetic (the formulas of ``layers.decoder``): the rotation
bit for bit, the norm within one bf16 rounding (its inverse norm may differ from torch's in the last fp32
bit, which can move a value across a bf16 rounding boundary)."""

from __future__ import annotations

import copy

import pytest
import torch

import megatron_spec.ops  # noqa: F401  (the fake kernels)
from megatron_spec import _ext
from megatron_spec.layers import decoder

pytestmark = pytest.mark.skipif(not _ext.compiled_ops_available(),
                                reason="megatron_spec._C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")
EPS32 = torch.finfo(torch.float32).eps


def rms_reference(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rope_reference(x, cos, sin):
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * cos.double() + torch.cat([-x2, x1], dim=-1) * sin.double()


@pytest.mark.parametrize(
    "shape", [(1, 576), (16, 576), (64, 576), (1024, 576), (3, 7), (2, 5, 33), (4, 1), (1, 40)]
)
def test_rms_norm_matches_float64(kernel_variant, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    y = torch.ops.megatron_spec.rms_norm_f32(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
    # one inverse norm (a sum of H squares, a sqrt, a division) and two products a value
    torch.testing.assert_close(y.double(), rms_reference(x, w, 1e-5), rtol=8 * EPS32 * (1 + shape[-1] ** 0.5),
                               atol=1e-6)
    torch.testing.assert_close(y, torch.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_views_in_place(kernel_variant):
    """Qwen3's q/k norms: ``qkv.view(b, t, -1, d).split([nq, nkv], dim=2)``, rows of d with gaps between."""
    g = torch.Generator().manual_seed(3)
    b, t, nq, nkv, d = 3, 4, 8, 2, 32
    qkv = torch.randn(b, t, (nq + 2 * nkv) * d, generator=g)
    q, k = qkv[..., : (nq + nkv) * d].view(b, t, -1, d).split([nq, nkv], dim=2)
    w = torch.randn(d, generator=g)
    for part in (q, k, q.transpose(1, 2)):
        assert not part.is_contiguous()
        y = torch.ops.megatron_spec.rms_norm_f32(part, w, 1e-6)
        assert y.shape == part.shape and y.is_contiguous()
        torch.testing.assert_close(y.double(), rms_reference(part, w, 1e-6), rtol=1e-6, atol=1e-6)
    x = torch.randn(6, 10, generator=g).t()  # a last dimension that is not contiguous: copied first
    torch.testing.assert_close(torch.ops.megatron_spec.rms_norm_f32(x, torch.ones(6), 1e-6).double(),
                               rms_reference(x, torch.ones(6), 1e-6), rtol=1e-6, atol=1e-6)


def test_rms_norm_zero_rows_and_empty():
    w = torch.randn(8)
    assert torch.equal(torch.ops.megatron_spec.rms_norm_f32(torch.zeros(2, 8), w, 1e-6), torch.zeros(2, 8))
    assert torch.ops.megatron_spec.rms_norm_f32(torch.zeros(0, 8), w, 1e-6).shape == (0, 8)


@pytest.mark.parametrize(
    "b,n,t,d",
    [
        (1, 12, 1, 64),
        (16, 12, 1, 64),
        (4, 12, 4, 64),
        (2, 10, 3, 32),
        (1, 3, 5, 8),
        (2, 2, 2, 6),
        (1, 1, 1, 2),
    ],
)
def test_rope_is_torchs_arithmetic_bit_for_bit(kernel_variant, b, n, t, d):
    g = torch.Generator().manual_seed(b * 100 + t * 10 + d)
    x = torch.randn(b, t, n, d, generator=g).transpose(1, 2)  # [b, n, t, d] as the layers make it
    table = torch.randn(50, d, generator=g)
    pos = torch.randint(0, 50, (b, t), generator=g)
    cos, sin = table[pos].unsqueeze(1), table.flip(0)[pos].unsqueeze(1)
    out = torch.ops.megatron_spec.rope_f32(x, cos, sin)
    assert out.shape == (b, n, t, d) and out.is_contiguous()
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(out, x * cos + torch.cat([-x2, x1], dim=-1) * sin)
    torch.testing.assert_close(out.double(), rope_reference(x, cos, sin), rtol=4 * EPS32, atol=1e-6)


def torch_rms_bf16(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (1024, 576), (3, 7), (2, 5, 33), (4, 1), (1, 40)])
def test_rms_norm_bf16_is_torchs_bf16_formula(kernel_variant, shape):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    y = torch.ops.megatron_spec.rms_norm_bf16(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = torch_rms_bf16(x, w, 1e-5)
    # two bf16 roundings a value (2^-9 relative each); the same bits wherever the inverse norms agree
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=0)
    assert (y != ref).float().mean().item() <= 0.02
    flat = x.reshape(-1, shape[-1])
    strided = torch.cat([flat, flat[:, :3]], -1)[:, : shape[-1]]  # rows with gaps between them, read in place
    torch.testing.assert_close(torch.ops.megatron_spec.rms_norm_bf16(strided, w, 1e-5).float(),
                               torch_rms_bf16(strided, w, 1e-5).float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize(
    "b,n,t,d", [(1, 12, 1, 64), (16, 12, 1, 64), (4, 12, 4, 64), (1, 3, 5, 8), (2, 2, 2, 6)]
)
def test_rope_bf16_is_torchs_bf16_arithmetic_bit_for_bit(kernel_variant, b, n, t, d):
    g = torch.Generator().manual_seed(b * 100 + t * 10 + d + 1)
    x = torch.randn(b, t, n, d, generator=g).bfloat16().transpose(1, 2)
    table = torch.randn(50, d, generator=g).bfloat16()
    pos = torch.randint(0, 50, (b, t), generator=g)
    cos, sin = table[pos].unsqueeze(1), table.flip(0)[pos].unsqueeze(1)
    out = torch.ops.megatron_spec.rope_bf16(x, cos, sin)
    assert out.shape == (b, n, t, d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(out, x * cos + torch.cat([-x2, x1], dim=-1) * sin)


def test_bf16_kernels_round_nan_and_inf_as_torch():
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0] * 4]).bfloat16()
    w = torch.ones(16).bfloat16()
    assert torch.isnan(torch.ops.megatron_spec.rms_norm_bf16(x, w, 1e-6)).all()
    big = torch.full((1, 1, 1, 16), 3e38).bfloat16()
    tab = torch.full((1, 1, 1, 16), 2.0).bfloat16()
    out = torch.ops.megatron_spec.rope_bf16(big, tab, tab)
    x1, x2 = big.chunk(2, dim=-1)
    # inf - inf: nan in the first half, inf in the second
    ref = big * tab + torch.cat([-x2, x1], dim=-1) * tab
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
    assert torch.equal(out[~out.isnan()], ref[~ref.isnan()])


def test_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.megatron_spec.rms_norm_f32(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.megatron_spec.rms_norm_f32(torch.randn(2, 8).double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="eps"):
        torch.ops.megatron_spec.rms_norm_f32(torch.randn(2, 8), torch.ones(8), -1.0)
    x, tab = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.megatron_spec.rope_f32(torch.randn(1, 2, 3, 7), tab[..., :7], tab[..., :7])
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.megatron_spec.rope_f32(x, tab[:, :, :2], tab)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.megatron_spec.rope_f32(x.double(), tab, tab)
    with pytest.raises(RuntimeError, match="bfloat16"):
        # fp32 weight
        torch.ops.megatron_spec.rms_norm_bf16(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.megatron_spec.rope_bf16(x.bfloat16(), tab, tab.bfloat16())


def test_opcheck():
    torch.library.opcheck(torch.ops.megatron_spec.rms_norm_f32, (torch.randn(3, 2, 8), torch.randn(8), 1e-6))
    torch.library.opcheck(torch.ops.megatron_spec.rope_f32,
                          (torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)))
    torch.library.opcheck(torch.ops.megatron_spec.rms_norm_bf16,
                          (torch.randn(3, 2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-6))
    torch.library.opcheck(
        torch.ops.megatron_spec.rope_bf16,
        tuple(torch.randn(*s).bfloat16() for s in ((2, 3, 4, 8), (2, 1, 4, 8), (2, 1, 4, 8))),
    )


def test_layers_use_them_only_where_they_may(monkeypatch):
    """The layers call the kernels for fp32 and bf16 CPU inference and torch otherwise: under autograd (the
    draft head trains through the same RMSNorm), mixed dtypes, and without the extension; the results
    agree."""
    g = torch.Generator().manual_seed(0)
    norm = decoder.RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(4, 16, generator=g)
    calls = []
    real = torch.ops.megatron_spec.rms_norm_f32

    class Spy:
        def __call__(self, *a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(torch.ops.megatron_spec, "rms_norm_f32", Spy(), raising=False)
    with torch.no_grad():
        y_kernel = norm(x)
    assert len(calls) == 1
    y_grad = norm(x.requires_grad_())  # the parameter asks for a gradient: torch's op, with a graph
    assert len(calls) == 1 and y_grad.requires_grad
    torch.testing.assert_close(y_kernel, y_grad.detach(), rtol=1e-6, atol=1e-6)
    bf_calls = []
    real_bf = torch.ops.megatron_spec.rms_norm_bf16
    monkeypatch.setattr(
        torch.ops.megatron_spec, "rms_norm_bf16", lambda *a: bf_calls.append(a) or real_bf(*a), raising=False
    )
    with torch.no_grad():
        y_bf = copy.deepcopy(norm).to(torch.bfloat16)(x.detach().bfloat16())
        norm(x.detach().bfloat16())  # bf16 input, fp32 weight: torch's arithmetic
    assert len(calls) == 1 and len(bf_calls) == 1
    torch.testing.assert_close(y_bf.float(), y_kernel, rtol=2 ** -6, atol=1e-2)
    monkeypatch.setitem(decoder._KERNELS, "rope_f32", False)
    with torch.no_grad():
        torch.testing.assert_close(norm(x.detach()), y_kernel, rtol=1e-6, atol=1e-6)
    assert len(calls) == 1
