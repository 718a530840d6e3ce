"""The fp32 decode/verify linear kernel (csrc/linear_cpu.cpp) and its use by the engine's Linear layer.

Each kernel variant (the scalar loop of the default variant, the AVX2 + FMA tile above it, the AVX-512
tile above that) is compared with a float64 matmul on shapes that leave partial 16-output panels and every
tile split (1-6 rows a tile, balanced: 8 rows as 4 + 4, 16 as 6 + 5 + 5; AVX-512 1-12 over two panels,
1-16 over one); the layer sends at most SMALL_MAX_ROWS rows to it and the rest to oneDNN, with the same
results within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

import megatron_spec.ops  # noqa: F401  (the fake kernels)
from megatron_spec import _ext

pytestmark = pytest.mark.skipif(not _ext.compiled_ops_available(),
                                reason="megatron_spec._C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")


def reference(x, w, bias):
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("n,k", [(50, 37), (16, 1), (576, 576), (3, 64), (96, 17)])
def test_matches_float64_matmul(kernel_variant, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    packed = torch.ops.megatron_spec.linear_pack_f32(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 5, 6, 7, 8, 12, 16, 23, 64, 129):
        x = torch.randn(m, k, generator=g)
        for bias in (None, torch.randn(n, generator=g)):
            y = torch.ops.megatron_spec.linear_small_f32(x, packed, bias, n)
            ref = reference(x, w, bias)
            # k fp32 products summed in order: error within k * eps of the sum of |terms|
            bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t() + 1)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert ((y.double() - ref).abs() <= bound).all(), (m, n, k, bias is not None)


@pytest.mark.parametrize("n,k", [(50, 37), (16, 1), (33, 64), (0, 8)])
def test_panel_layout(n, k):
    """packed[p, k, j] = w[16 p + j, k], zero past n (csrc/cpu/panels.h), from contiguous and strided weights,
    fp32 and the bf16 copy of linear_pack_bf16w."""
    def panels(w):
        padded = torch.zeros((n + 15) // 16 * 16, k, dtype=w.dtype)
        padded[:n] = w
        return padded.view(-1, 16, k).transpose(1, 2)

    w = torch.randn(k, n).t()  # a strided view
    assert torch.equal(torch.ops.megatron_spec.linear_pack_f32(w), panels(w))
    wb = w.bfloat16().float()  # every value a bf16 number
    assert torch.equal(torch.ops.megatron_spec.linear_pack_bf16w(wb), panels(wb).bfloat16())


def test_refuses_what_it_cannot_run():
    w = torch.randn(20, 8)
    packed = torch.ops.megatron_spec.linear_pack_f32(w)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.megatron_spec.linear_small_f32(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.megatron_spec.linear_small_f32(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="linear_pack_f32"):
        torch.ops.megatron_spec.linear_small_f32(torch.randn(2, 8), w, None, 20)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.megatron_spec.linear_pack_f32(w.bfloat16())


def test_opcheck():
    w, x = torch.randn(20, 8), torch.randn(3, 8)
    torch.library.opcheck(torch.ops.megatron_spec.linear_pack_f32, (w,))
    torch.library.opcheck(torch.ops.megatron_spec.linear_small_f32,
                          (x, torch.ops.megatron_spec.linear_pack_f32(w), torch.randn(20), 20))


@pytest.mark.parametrize("onednn_copy", [False, True])
def test_linear_layer_uses_it_up_to_the_cut_and_the_plain_weight_or_onednn_above(monkeypatch, onednn_copy):
    """fp32 with panels: more rows than the cut run ``F.linear`` on the weight itself (no oneDNN copy is made,
    so a weight sync re-packs the panels only), or oneDNN's blocked copy where ``ONEDNN_COPY_F32`` asks."""
    from megatron_spec.layers import linear

    monkeypatch.setattr(linear, "ONEDNN_COPY_F32", onednn_copy)
    torch.manual_seed(0)
    lin = linear.Linear(40, 70).eval()
    with torch.no_grad():
        lin.bias.normal_()
    assert lin.pack() and lin._small is not None
    assert lin._packed.is_mkldnn == onednn_copy
    if not onednn_copy:
        assert lin._packed.data_ptr() == lin.weight.data_ptr()  # the weight itself, not a copy
    for m in (1, 16, linear.SMALL_MAX_ROWS, linear.SMALL_MAX_ROWS + 1, 300):
        x = torch.randn(m, 40)
        with torch.inference_mode():
            y = lin(x)
            few = torch.ops.megatron_spec.linear_small_f32(x, lin._small, lin.bias, 70)
            if onednn_copy:
                many = torch.ops.mkldnn._linear_pointwise(x, lin._packed, lin.bias, "none", [], "")
            else:
                many = torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert torch.equal(y, few if m <= linear.SMALL_MAX_ROWS else many)
        assert torch.allclose(y, (x @ lin.weight.t() + lin.bias).detach(), rtol=1e-5, atol=1e-5)
    lin.unpack()
    assert lin._packed is None and lin._small is None


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU")
def test_a_bf16_weight_keeps_onednn_copy():
    from megatron_spec.layers.linear import Linear

    lin = Linear(40, 70).to(torch.bfloat16).eval()
    assert lin.pack() and lin._packed.is_mkldnn


@pytest.mark.parametrize("n,k", [(50, 37), (576, 576), (3, 64), (96, 17)])
def test_bf16_panels_give_the_bits_of_fp32_panels(kernel_variant, n, k):
    """Weights that are all bf16 numbers (a bf16 checkpoint loaded in fp32): their bf16 panels widen
    exactly, so every row count gives the same bits as the fp32 panels, reading half the bytes."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    p32, p16 = torch.ops.megatron_spec.linear_pack_f32(w), torch.ops.megatron_spec.linear_pack_bf16w(w)
    assert p16.dtype == torch.bfloat16 and p16.shape == p32.shape and torch.equal(p16.float(), p32)
    for m in (1, 4, 6, 7, 16, 33, 128):
        x = torch.randn(m, k, generator=g)
        for bias in (None, torch.randn(n, generator=g)):
            assert torch.equal(
                torch.ops.megatron_spec.linear_small_f32(x, p16, bias, n),
                torch.ops.megatron_spec.linear_small_f32(x, p32, bias, n),
            ), (m, bias is not None)


@pytest.mark.skipif("avx512" not in _ext.supported_kernel_isas(), reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("n,k", [(50, 37), (576, 576), (3, 64), (1536, 20), (80, 33), (112, 24)])
def test_avx512_tile_gives_the_bits_of_the_avx2_tile(n, k):
    """One zmm accumulator a row and panel (two panels at a time, tiles of up to 12 rows; a thread's last odd
    panel alone, up to 16 rows: 5 and 7 panels here) against two ymm (up to 6 rows): each output is the same
    fused multiply-add chain over k in order, so every row count and every tile split gives the same bits,
    from fp32 and bf16 panels; and a row's outputs do not depend on how many rows came with it."""
    g = torch.Generator().manual_seed(7 * n + k)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    before = _ext.kernel_isa()
    _ext.set_kernel_isa("avx512")
    tiles = _ext.fp32_linear_tiles() == "avx512"  # the switch as it was
    _ext.set_fp32_avx512_tiles(True)  # (where the CPU would run the AVX2 tiles under the AVX-512 variant)
    try:
        ops = torch.ops.megatron_spec
        for packed in (ops.linear_pack_f32(w), ops.linear_pack_bf16w(w)):
            x = torch.randn(130, k, generator=g)
            for m in list(range(1, 26)) + [31, 32, 33, 48, 64, 96, 128, 130]:
                bias = torch.randn(n, generator=g) if m % 2 else None
                out = {}
                for isa in ("avx2", "avx512"):
                    _ext.set_kernel_isa(isa)
                    out[isa] = ops.linear_small_f32(x[:m], packed, bias, n)
                assert torch.equal(out["avx512"], out["avx2"]), (m, packed.dtype)
                one = ops.linear_small_f32(x[m - 1:m], packed, bias, n)
                assert torch.equal(out["avx512"][m - 1:], one), (m, packed.dtype)
    finally:
        _ext.set_kernel_isa("avx512")
        _ext.set_fp32_avx512_tiles(tiles)
        _ext.set_kernel_isa(before)


def test_bf16_panels_refuse_weights_they_would_round():
    w = torch.randn(20, 8).bfloat16().float()
    w[3, 5] += 1e-3  # no longer a bf16 number
    with pytest.raises(RuntimeError, match="not bfloat16 numbers"):
        torch.ops.megatron_spec.linear_pack_bf16w(w)
    torch.library.opcheck(torch.ops.megatron_spec.linear_pack_bf16w, (torch.randn(20, 8).bfloat16().float(),))


def test_linear_layer_keeps_bf16_panels_only_for_bf16_weights(monkeypatch):
    from megatron_spec.layers import linear

    torch.manual_seed(1)
    lin = linear.Linear(40, 70).eval()
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    x = torch.randn(5, 40)
    assert lin.pack() and lin._small.dtype == torch.bfloat16
    with torch.inference_mode():
        y16 = lin(x)
    monkeypatch.setattr(linear, "BF16_WEIGHT_PANELS", False)
    assert lin.pack() and lin._small.dtype == torch.float32
    with torch.inference_mode():
        assert torch.equal(lin(x), y16)
    monkeypatch.undo()
    with torch.no_grad():
        lin.weight[0, 0] += 1e-4  # an fp32 weight (a trainer's update): fp32 panels
    assert lin.pack() and lin._small.dtype == torch.float32


@pytest.mark.parametrize("n,k", [(50, 37), (33, 64), (20, 576)])
def test_pack_into_writes_what_a_fresh_pack_makes(n, k):
    """linear_pack_into rewrites panels in place (a weight sync's re-pack) with the bits of each fresh
    pack."""
    ops = torch.ops.megatron_spec
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    cases = [(ops.linear_pack_f32, w), (ops.linear_pack_bf16w, w.bfloat16().float()),
             (ops.linear_pack_bf16, w.bfloat16())]
    for pack, src in cases:
        # panels of earlier weights
        packed = pack(torch.randn(src.shape, generator=g).bfloat16().to(src.dtype))
        ptr = packed.data_ptr()
        ops.linear_pack_into(src.t().contiguous().t(), packed)  # from a strided view too
        assert packed.data_ptr() == ptr and torch.equal(packed, pack(src)), pack


@pytest.mark.parametrize("n,k", [(50, 37), (33, 64), (20, 576), (16, 3), (1, 1), (4096, 8)])
def test_pack_into_with_sums_writes_the_panels_and_sums_the_weight(kernel_variant, n, k):
    """linear_pack_into_sums (the engine's re-pack of lent weights and their checksum, one pass): the bits of
    linear_pack_into, and the fingerprint's sums of the weight's bits (NaN, infinities and -0 among them),
    in every layout and kernel variant: fp32 panels packed and summed from the same registers (AVX2), or
    packed then summed from cache."""
    from megatron_spec.sync.fingerprint import Fingerprint

    ops = torch.ops.megatron_spec
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    edges = torch.tensor([float("nan"), -0.0, float("-inf"), float("inf")])
    w.view(-1)[: min(4, w.numel())] = edges[: w.numel()]
    cases = [(ops.linear_pack_f32, w), (ops.linear_pack_bf16w, w.bfloat16().float()),
             (ops.linear_pack_bf16, w.bfloat16())]
    for pack, src in cases:
        packed = pack(torch.randn(src.shape, generator=g).bfloat16().to(src.dtype))
        ptr = packed.data_ptr()
        sums = ops.linear_pack_into_sums(src, packed)
        assert packed.data_ptr() == ptr, pack
        assert torch.equal(packed.view(torch.int16), pack(src).view(torch.int16)), pack
        assert Fingerprint().add_sums(src.dtype, src.numel(), sums) == Fingerprint().add(src), pack
    strided = torch.randn(8, 20, generator=g).t()
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        ops.linear_pack_into_sums(strided, ops.linear_pack_f32(strided))
    torch.library.opcheck(ops.linear_pack_into_sums, (w, ops.linear_pack_f32(w)))


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4, 8])
def test_pack_into_panels_at_any_alignment(kernel_variant, offset):
    """Panels 16-byte aligned (every tensor torch allocates) are written by streaming stores, others by plain
    ones, and with the sums on AVX-512 panels on a 64-byte boundary 16 columns at a time (offset 0; 4 and 8
    words are 16- but not 64-byte aligned): the same bits either way, with and without the sums."""
    from megatron_spec.sync.fingerprint import Fingerprint

    ops = torch.ops.megatron_spec
    g = torch.Generator().manual_seed(offset)
    w = torch.randn(40, 24, generator=g)
    want = ops.linear_pack_f32(w)
    for with_sums in (False, True):
        packed = torch.zeros(want.numel() + 8)[offset:offset + want.numel()].view(want.shape)
        if with_sums:
            sums = ops.linear_pack_into_sums(w, packed)
            assert Fingerprint().add_sums(w.dtype, w.numel(), sums) == Fingerprint().add(w)
        else:
            ops.linear_pack_into(w, packed)
        assert torch.equal(packed, want)


def test_pack_into_refuses_other_layouts():
    ops = torch.ops.megatron_spec
    w = torch.randn(20, 8)
    with pytest.raises(RuntimeError, match="packs into"):
        ops.linear_pack_into(w, ops.linear_pack_f32(torch.randn(40, 8)))
    with pytest.raises(RuntimeError, match="packs into"):
        ops.linear_pack_into(w, ops.linear_pack_bf16(w.bfloat16()))
    with pytest.raises(RuntimeError, match="not bfloat16 numbers"):
        ops.linear_pack_into(w, ops.linear_pack_bf16w(w.bfloat16().float()))
    torch.library.opcheck(ops.linear_pack_into, (w, ops.linear_pack_f32(w)))


def test_layer_repacks_into_the_panels_it_kept():
    """An update's unpack(keep=True) then pack() writes the new weights into the same panels: the layer's
    output
    is that of a freshly packed layer; unpack() without keep frees them."""
    from megatron_spec.layers.linear import Linear

    torch.manual_seed(0)
    lin = Linear(576, 100).eval()
    lin.pack()
    ptr = lin._small.data_ptr()
    lin.unpack(keep=True)
    with torch.no_grad():
        lin.weight.add_(torch.randn_like(lin.weight))
    lin.pack()
    assert lin._small.data_ptr() == ptr
    fresh = Linear(576, 100).eval()
    fresh.load_state_dict(lin.state_dict())
    fresh.pack()
    x = torch.randn(5, 576)
    with torch.no_grad():
        assert torch.equal(lin(x), fresh(x))
    lin.unpack()
    assert lin._small is None and lin._spare is None


def test_layer_keeps_bf16_panels_only_where_every_weight_is_a_bf16_number():
    """The layer takes bf16 panels when its weight's first values are bf16 numbers and lets the pack check the
    rest in its own pass: one value below bf16's precision deep in the matrix, and the panels are fp32 (fresh,
    and in a re-pack into bf16 panels kept from before), with the sums of what is held either way."""
    from megatron_spec.layers.linear import Linear
    from megatron_spec.sync.fingerprint import Fingerprint

    torch.manual_seed(1)
    lin = Linear(64, 40).eval()
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    lin.pack()
    assert lin._small.dtype == torch.bfloat16
    lin.unpack(keep=True)
    with torch.no_grad():
        lin.weight[37, 5] += 1e-6  # no longer a bf16 number; the first values still are
    sums = Fingerprint()
    lin.pack(sums=sums)
    assert lin._small.dtype == torch.float32
    assert torch.equal(lin._small, torch.ops.megatron_spec.linear_pack_f32(lin.weight.detach()))
    assert sums == Fingerprint().add(lin.weight.detach())
    lin.unpack(keep=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    sums = Fingerprint()
    lin.pack(sums=sums)  # bf16 panels again, fresh: the fp32 ones have another layout
    assert lin._small.dtype == torch.bfloat16 and sums == Fingerprint().add(lin.weight.detach())


def test_a_layer_rounding_to_bf16_computes_with_the_rounded_weight_and_keeps_the_loaded_one():
    """``round_bf16`` (an engine's draft): at every row count, panels (through a re-pack into the panels it
    kept too) and above the kernel's cut, the layer gives the bits of a layer loaded with the rounded weight;
    its weight and the sums of a weight sync stay those of the weight as loaded."""
    from megatron_spec.layers.linear import SMALL_MAX_ROWS, Linear
    from megatron_spec.sync.fingerprint import Fingerprint

    torch.manual_seed(2)
    lin = Linear(96, 40).eval()
    lin.round_bf16 = True
    exact = lin.weight.detach().clone()
    rounded = Linear(96, 40).eval()
    with torch.no_grad():
        rounded.weight.copy_(exact.bfloat16().float())
    assert not torch.equal(rounded.weight, exact)
    rounded.pack()
    for repack in (False, True):
        if repack:
            lin.unpack(keep=True)
        sums = Fingerprint()
        assert lin.pack(sums=sums) and lin._small.dtype == torch.bfloat16
        assert sums == Fingerprint().add(exact) and torch.equal(lin.weight, exact)
        with torch.inference_mode():
            for rows in (1, 5, SMALL_MAX_ROWS + 3):
                x = torch.randn(rows, 96)
                assert torch.equal(lin(x), rounded(x)), rows
    lin.round_bf16 = False
    lin.pack()
    assert lin._small.dtype == torch.float32  # as loaded again
