"""FP8 E4M3 block quantisation: compiled == reference == SGLang's convention, bit for bit."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import pathlib

import pytest
import torch

from megatron_spec import ops
from megatron_spec.ops import fp8_block_dequantize_reference, fp8_block_quantize_reference

requires_cpu_kernel = pytest.mark.skipif(
    not ops.compiled_kernel_for("fp8_block_quantize", torch.device("cpu")),
    reason="compiled ops unavailable: megatron_spec._C not built (pip install --no-build-isolation -e .) or "
           "MEGATRON_SPEC_FORCE_REFERENCE=1",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 0), (0, 5), (5, 0), (1, 1), (127, 129), (128, 128), (129, 257), (300, 1000), (1000, 130),
          (256, 4096), (17, 2049)]


def kernel_quantize(w, bn=128, bk=128):
    """The compiled op returns e4m3 bytes; view them as float8_e4m3fn like the public API does."""
    q, s = torch.ops.megatron_spec.fp8_block_quantize(w, bn, bk)
    assert q.dtype == torch.uint8
    return q.view(torch.float8_e4m3fn), s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b)), f"{(bits(a) != bits(b)).sum().item()} of {a.numel()} differ"


def weights(shape, dtype, g, kind="randn"):
    n, k = shape
    if kind == "randn":
        w = torch.randn(n, k, generator=g)
    elif kind == "wide":  # magnitudes from 1e-30 to 1e30 across rows, fp8 subnormals inside blocks
        w = torch.randn(n, k, generator=g) * torch.logspace(-30, 30, max(n, 1))[:n, None]
    elif kind == "heavy":  # one outlier per block pushes most values into the fp8 subnormal range
        w = torch.randn(n, k, generator=g) * 1e-3
        w[::128, ::128] = 50.0
    elif kind == "zeros":
        w = torch.zeros(n, k)
        w[n // 2 :, k // 2 :] = torch.randn(n - n // 2, k - k // 2, generator=g)
        w[: n // 4] = -0.0
    else:
        raise AssertionError(kind)
    if dtype == torch.float16:
        w = w.clamp(-60000, 60000)
    return w.to(dtype)


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["randn", "wide", "heavy", "zeros"])
def test_kernel_matches_reference(dtype, kind, kernel_variant):
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    for shape in SHAPES:
        w = weights(shape, dtype, g, kind)
        q_k, s_k = kernel_quantize(w)
        q_r, s_r = fp8_block_quantize_reference(w, 128, 128)
        assert_bits_equal(q_k, q_r)
        assert_bits_equal(s_k, s_r)
        assert s_k.shape == (-(-shape[0] // 128), -(-shape[1] // 128))


@requires_cpu_kernel
@pytest.mark.parametrize("block", [(1, 1), (3, 5), (64, 32), (128, 64), (256, 128)])
def test_other_block_sizes(block, kernel_variant):
    g = torch.Generator().manual_seed(1)
    for shape, dtype in itertools.product([(1, 7), (100, 100), (513, 77)], DTYPES):
        w = weights(shape, dtype, g, "wide")
        q_k, s_k = kernel_quantize(w, *block)
        q_r, s_r = fp8_block_quantize_reference(w, *block)
        assert_bits_equal(q_k, q_r)
        assert_bits_equal(s_k, s_r)


def fp8_grid() -> torch.Tensor:
    """All finite non-negative e4m3 values, ascending (0 ... 448)."""
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v


def edge_values() -> torch.Tensor:
    """Every fp8 value, every midpoint between neighbours, one float32 ulp either side, both signs."""
    grid = fp8_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32
    pts = torch.cat([grid, mids])
    up = torch.nextafter(pts, torch.full_like(pts, 1e9))
    down = torch.nextafter(pts, torch.zeros_like(pts))
    tiny = torch.tensor([1e-40, 1e-45, 1.1754944e-38, 2.0**-10, 2.0**-9 * 0.5])
    v = torch.cat([pts, up, down, tiny])
    return torch.cat([v, -v])


@requires_cpu_kernel
def test_rounding_edges_match_torch_conversion(kernel_variant):
    # A block whose amax is 448 quantises with multiplier (1/448)*448 == 1.0 exactly, so the bytes
    # must equal torch's own round-to-nearest-even float -> float8_e4m3fn conversion.
    assert (torch.tensor([448.0]).reciprocal() * 448.0).item() == 1.0
    v = edge_values()
    v = v[v.abs() <= 448]
    n = v.numel()
    w = torch.cat([v, torch.full((128 * 128 - n % (128 * 128),), 448.0)]).view(-1, 128)  # blocks of amax 448
    q_k, s_k = kernel_quantize(w)
    q_r, _ = fp8_block_quantize_reference(w, 128, 128)
    assert (s_k == 1.0).all()  # every block has amax 448
    expect = w.to(torch.float8_e4m3fn)
    assert_bits_equal(q_k, expect)
    assert_bits_equal(q_r, expect)


@requires_cpu_kernel
def test_saturation_and_scale_of_empty_blocks(kernel_variant):
    w = torch.zeros(130, 130)
    w[:128, :128] = -0.0
    w[128:, 128:] = 3.0
    q, s = kernel_quantize(w)
    # all-zero block: amax clamped at 1e-4 (SGLang's clamp), scale 1e-4/448 in float32
    expect_zero_scale = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(448.0)
    assert s[0, 0].item() == expect_zero_scale.item() and s[0, 1].item() == expect_zero_scale.item()
    assert (q[:128, :128].view(torch.uint8) == 0x80).all()  # -0.0 keeps its sign
    assert s[1, 1].item() == pytest.approx(3.0 / 448.0)
    assert (q[128:, 128:].float() == 448.0).all()


@pytest.mark.parametrize("use_kernel", [True, False])
def test_non_finite_weights_are_refused(use_kernel, monkeypatch):
    if use_kernel and not ops.compiled_kernel_for("fp8_block_quantize", torch.device("cpu")):
        pytest.skip("compiled ops unavailable: _C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")
    if not use_kernel:
        monkeypatch.setattr(ops, "compiled_kernel_for", lambda name, device: False)
    w = torch.randn(300, 300)
    w[200, 150] = float("nan")
    with pytest.raises(ValueError, match=r"block \(1, 1\).*NaN or inf"):
        ops.fp8_block_quantize(w)
    w[200, 150] = float("inf")
    with pytest.raises(ValueError, match=r"block \(1, 1\)"):
        ops.fp8_block_quantize(w.bfloat16())
    q, s = ops.fp8_block_quantize(w, check_finite=False)
    assert not torch.isfinite(s[1, 1]) and torch.isfinite(s[0, 0])


@pytest.mark.parametrize("use_kernel", [True, False])
def test_out_variant(use_kernel, monkeypatch):
    if use_kernel and not ops.compiled_kernel_for("fp8_block_quantize_out", torch.device("cpu")):
        pytest.skip("compiled ops unavailable: _C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")
    if not use_kernel:
        monkeypatch.setattr(ops, "compiled_kernel_for", lambda name, device: False)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 300, generator=g).bfloat16()
    bucket = torch.zeros(200 * 300 + 4 * 2 * 3, dtype=torch.uint8)  # bytes of a flattened bucket
    out = bucket[: 200 * 300].view(torch.float8_e4m3fn).view(200, 300)
    scale = bucket[200 * 300 :].view(torch.float32).view(2, 3)
    q, s = ops.fp8_block_quantize(w, out=(out, scale))
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == scale.data_ptr()
    q_r, s_r = fp8_block_quantize_reference(w)
    assert_bits_equal(out, q_r)
    assert_bits_equal(scale, s_r)
    with pytest.raises(ValueError, match="out|scale_inv"):
        ops.fp8_block_quantize(w, out=(out[:10], scale))
    with pytest.raises(ValueError, match="scale_inv"):
        ops.fp8_block_quantize(w, out=(out, torch.empty(3, 3)))


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_all_codes(dtype, kernel_variant):
    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(torch.float8_e4m3fn)  # [3, 256]
    codes = codes.repeat(50, 1)  # [150, 256]: two block rows, two block columns
    scale = torch.tensor([[1.0, 2.0**-20], [3.7e-3, 5.5e4]])
    a = torch.ops.megatron_spec.fp8_block_dequantize(codes.view(torch.uint8), scale, 128, 128, dtype)
    b = fp8_block_dequantize_reference(codes, scale, 128, 128, dtype)
    nan = codes.float().isnan()
    assert a[nan].isnan().all() and b[nan].isnan().all()
    a_, b_ = a.float(), b.float()
    assert torch.equal(a_[~nan], b_[~nan])
    assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32)[~nan],
                       b.view(torch.int16 if dtype != torch.float32 else torch.int32)[~nan])


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_bound(dtype, kernel_variant):
    g = torch.Generator().manual_seed(3)
    for shape in [(129, 257), (512, 384)]:
        w = weights(shape, dtype, g, "wide")
        q, s = ops.fp8_block_quantize(w)
        back = ops.fp8_block_dequantize(q, s, torch.float32)
        full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale
        # below 2^-6 * scale (subnormals); the multiplier's own rounding adds a few float32 ulps
        err = (back - w.float()).abs()
        allowed = torch.maximum(w.float().abs() * 2.0**-4, full * 448 * 2.0**-10) * (1 + 1e-5)
        assert (err <= allowed).all()


def _block_loop_oracle(w: torch.Tensor, bn: int = 128, bk: int = 128):
    """Straight per-block loop (independent of the reference's padding and broadcasting)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            amax = blk.abs().max().clamp(min=1e-4)
            s[i, j] = amax / torch.tensor(448.0)
            mult = amax.reciprocal() * 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (
                (blk * mult).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return q, s


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_block_loop_oracle(dtype):
    g = torch.Generator().manual_seed(4)
    for shape in [(1, 1), (127, 300), (260, 129)]:
        w = weights(shape, dtype, g, "wide")
        q_r, s_r = fp8_block_quantize_reference(w)
        q_o, s_o = _block_loop_oracle(w)
        assert_bits_equal(q_r, q_o)
        assert_bits_equal(s_r, s_o)


def _sglang_per_block_cast_to_fp8():
    """SGLang's (DeepSeek-V3 / DeepGEMM) per_block_cast_to_fp8, read from the installed source.

    Importing the module needs triton (not installed on CPU), so the function is taken out with
    ``ast`` and run with the one helper it uses (``cdiv``).
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed")
    path = pathlib.Path(spec.origin).parent / "benchmark" / "deepseek_utils.py"
    if not path.exists():
        pytest.skip(f"{path} not found in this sglang version")
    tree = ast.parse(path.read_text())
    fn = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "per_block_cast_to_fp8"), None
    )
    if fn is None:
        pytest.skip("per_block_cast_to_fp8 not found in sglang/benchmark/deepseek_utils.py")
    namespace = {"torch": torch, "Tuple": tuple, "cdiv": lambda a, b: -(-a // b)}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["per_block_cast_to_fp8"]


@pytest.mark.sglang
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_to_sglang_per_block_cast(dtype):
    sglang_cast = _sglang_per_block_cast_to_fp8()
    g = torch.Generator().manual_seed(5)
    for shape in [(128, 128), (256, 384), (130, 200), (1, 129)]:
        for kind in ["randn", "heavy", "zeros"]:
            w = weights(shape, dtype, g, kind)
            q_s, s_s = sglang_cast(w)
            q, s = ops.fp8_block_quantize(w)
            assert_bits_equal(q, q_s)
            assert_bits_equal(s, s_s.float())


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    given = None

if given is not None:

    @requires_cpu_kernel
    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(n=st.integers(0, 400), k=st.integers(0, 400), dtype=st.sampled_from(DTYPES),
           kind=st.sampled_from(["randn", "wide", "heavy", "zeros"]), bn=st.sampled_from([1, 7, 128]),
           bk=st.sampled_from([1, 16, 128]), seed=st.integers(0, 2**31 - 1))
    def test_property_kernel_equals_reference(n, k, dtype, kind, bn, bk, seed):
        w = weights((n, k), dtype, torch.Generator().manual_seed(seed), kind)
        q_k, s_k = kernel_quantize(w, bn, bk)
        q_r, s_r = fp8_block_quantize_reference(w, bn, bk)
        assert_bits_equal(q_k, q_r)
        assert_bits_equal(s_k, s_r)
        d_k = torch.ops.megatron_spec.fp8_block_dequantize(q_k.view(torch.uint8), s_k, bn, bk, dtype)
        d_r = ops.fp8_block_dequantize_reference(q_r, s_r, bn, bk, dtype)
        assert torch.equal(d_k, d_r)
