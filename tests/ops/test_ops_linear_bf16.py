"""The bf16 decode/verify linear kernel (csrc/linear_bf16_cpu.cpp) and its use by the engine's Linear layer.

The kernel runs AVX512-BF16 dot products where the CPU has them and the AVX-512 variant is active, scalar
loops that do the same operations elsewhere (the default and AVX2 variants): both are compared with a float64
matmul of the bf16 values (fp32 accumulation, one bf16 rounding an output), with each other bit for bit,
and each row's result with the same row computed alone (a row does not depend on the batch it is in). On a CPU
with AMX the op runs on AMX tiles instead (csrc/linear_amx_cpu.cpp): the ``amx`` variant, held to the same
bound
and the same batch invariance (not to the dot products' bits).
"""

from __future__ import annotations

import pytest
import torch

import megatron_spec.ops  # noqa: F401  (the fake kernels)
from megatron_spec import _ext
from tests.ops.conftest import amx_default

pytestmark = pytest.mark.skipif(not _ext.compiled_ops_available(),
                                reason="megatron_spec._C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")
ops = torch.ops.megatron_spec if _ext.compiled_ops_available() else None
EPS32 = torch.finfo(torch.float32).eps


def inputs(n, k, m, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    return w, x, torch.randn(n, generator=g).bfloat16()


@pytest.mark.parametrize("n,k", [(50, 37), (16, 1), (576, 576), (3, 64), (96, 17), (33, 2)])
def test_matches_float64_matmul(bf16_linear_variant, n, k):
    w, _, b = inputs(n, k, 1, n * 1000 + k)
    packed = ops.linear_pack_bf16(w)
    assert packed.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2) and packed.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 7, 8, 9, 16, 23, 64, 129):
        x = torch.randn(m, k, generator=g).bfloat16()
        for bias in (None, b, b.float()):
            y = ops.linear_small_bf16(x, packed, bias, n)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            # fp32 sums of exact products (k roundings), then one bf16 rounding (2^-9 relative)
            terms = x.abs().double() @ w.abs().double().t() + (0 if bias is None else bias.abs().double())
            bound = 2 ** -8 * ref.abs() + 4 * (k + 2) * EPS32 * terms + 1e-30
            assert ((y.double() - ref).abs() <= bound).all(), (m, n, k, bias is None)


@pytest.mark.parametrize("n,k", [(50, 37), (16, 1), (33, 64), (20, 576), (0, 8)])
def test_panel_layout(n, k):
    """packed[p, c, j, e] = w[16 p + j, 2 c + e], zero past n and k (the one-pass copy of csrc/cpu/panels.h
    where k is even, the padded copy where it is odd), from contiguous and strided weights."""
    w = torch.randn(k, n).bfloat16().t()
    ref = torch.zeros((n + 15) // 16 * 16, (k + 1) // 2 * 2, dtype=torch.bfloat16)
    ref[:n, :k] = w
    ref = ref.view(-1, 16, (k + 1) // 2, 2).transpose(1, 2)
    assert torch.equal(ops.linear_pack_bf16(w), ref)
    assert torch.equal(ops.linear_pack_bf16(w.contiguous()), ref)


def test_rows_do_not_depend_on_the_batch(bf16_linear_variant):
    w, x, b = inputs(70, 96, 40, 5)
    packed = ops.linear_pack_bf16(w)
    full = ops.linear_small_bf16(x, packed, b, 70)
    for i in range(40):
        assert torch.equal(ops.linear_small_bf16(x[i:i + 1], packed, b, 70)[0], full[i])
    for m in (3, 8, 13, 17):  # other tile splits
        assert torch.equal(ops.linear_small_bf16(x[:m], packed, b, 70), full[:m])


def test_native_dot_products_are_the_scalar_loops_bit_for_bit():
    if "avx512" not in _ext.supported_kernel_isas():
        pytest.skip("no AVX-512 variant on this CPU")
    before = _ext.kernel_isa()
    try:
        _ext.set_kernel_isa("avx512")
        if _ext.amx_supported():
            _ext.set_amx(False)  # the dot products, not the tiles (those: the bf16_linear_variant tests)
        if not _ext.bf16_dot_available():
            pytest.skip("this CPU has no AVX512-BF16 dot products")
        w, x, b = inputs(100, 577, 20, 9)
        packed = ops.linear_pack_bf16(w)
        native = ops.linear_small_bf16(x, packed, b, 100)
        _ext.set_kernel_isa("avx2")
        assert not _ext.bf16_dot_available()
        assert torch.equal(ops.linear_small_bf16(x, packed, b, 100), native)
    finally:
        _ext.set_kernel_isa(before)
        if _ext.amx_supported():
            _ext.set_amx(amx_default())


def test_edges_and_refusals():
    w, x, b = inputs(20, 8, 3, 1)
    packed = ops.linear_pack_bf16(w)
    assert ops.linear_small_bf16(x[:0], packed, None, 20).shape == (0, 20)
    empty = ops.linear_pack_bf16(torch.zeros(20, 0, dtype=torch.bfloat16))
    assert torch.equal(ops.linear_small_bf16(torch.zeros(2, 0, dtype=torch.bfloat16), empty, b, 20),
                       b.expand(2, 20))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_small_bf16(x.float(), packed, None, 20)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_small_bf16(torch.zeros(3, 10, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="panels"):
        ops.linear_small_bf16(x, packed, None, 40)
    with pytest.raises(RuntimeError, match="linear_pack_bf16"):
        ops.linear_small_bf16(x, ops.linear_pack_f32(w.float()), None, 20)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_small_bf16(x, packed, torch.zeros(19), 20)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_pack_bf16(w.float())


def test_opcheck():
    w, x, b = inputs(20, 8, 3, 2)
    torch.library.opcheck(ops.linear_pack_bf16, (w,))
    torch.library.opcheck(ops.linear_small_bf16, (x, ops.linear_pack_bf16(w), b, 20))


def test_layer_uses_it_for_bf16_up_to_the_row_limit(monkeypatch):
    from megatron_spec.isa import probe
    from megatron_spec.layers import linear

    if not probe().native_bf16:  # oneDNN refuses to pack bf16 there, and no engine runs in bf16
        pytest.skip("no native bf16 on this CPU (or MEGATRON_SPEC_NO_NATIVE_BF16=1)")
    lin = linear.Linear(64, 48, bias=True).to(torch.bfloat16)
    assert lin.pack()
    if not linear.bf16_small_linear_available():
        assert lin._small is None  # no bf16 dot products here: oneDNN for every row count
        return
    assert lin._small is not None and lin._small.dim() == 4
    g = torch.Generator().manual_seed(4)
    x = torch.randn(linear.SMALL_MAX_ROWS_BF16 + 3, 64, generator=g).bfloat16()
    with torch.inference_mode():
        small = lin(x[:5])
        assert torch.equal(small, ops.linear_small_bf16(x[:5], lin._small, lin.bias, 48))
        big = lin(x)  # over the limit: oneDNN, the same values within bf16 rounding
    torch.testing.assert_close(big[:5].float(), small.float(), rtol=2 ** -7, atol=1e-2)
    monkeypatch.setattr(_ext, "bf16_dot_available", lambda: False)
    assert lin.pack() and lin._small is None


def test_compiling_is_skipped_where_the_cpp_layers_run(monkeypatch):
    """``--rollout-compile`` compiles the layer only where the extension's C++ decoder layers do not run for
    the
    dtype (they were faster than the compiled layer in fp32 and bf16: layers.compiled.compiling_pays)."""
    from megatron_spec.layers import decoder, fused_layers
    from megatron_spec.layers.compiled import compiling_pays

    assert compiling_pays(torch.float32) != fused_layers.fused_layers_available(torch.float32)
    if _ext.bf16_dot_available() and fused_layers.fused_layers_available(torch.bfloat16):
        assert not compiling_pays(torch.bfloat16)
    monkeypatch.setattr(_ext, "bf16_dot_available", lambda: False)
    assert compiling_pays(torch.bfloat16)
    monkeypatch.setitem(decoder._KERNELS, "decoder_layers", False)
    assert compiling_pays(torch.float32)
