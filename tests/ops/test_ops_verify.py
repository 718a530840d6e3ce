"""Compiled chain verification == pure-PyTorch reference, bit for bit, for identical uniforms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_spec import ops
from megatron_spec.ops import SAMPLE_CHUNK, spec_exp_reference, verify_chain_reference

requires_cpu_kernel = pytest.mark.skipif(
    not ops.compiled_kernel_for("verify_chain", torch.device("cpu")),
    reason="compiled ops unavailable: megatron_spec._C not built (pip install --no-build-isolation -e .) or "
           "MEGATRON_SPEC_FORCE_REFERENCE=1",
)


def compiled(*args):
    return torch.ops.megatron_spec.verify_chain(*args)


def make_inputs(B, k, V, mode, g, greedy_frac=0.3, neg_frac=0.05, hole_frac=0.2, Vd=None):
    holes = torch.rand(B, k + 1, V, generator=g) < hole_frac
    holes[..., 0] = False  # every position keeps some mass
    logits = (torch.randn(B, k + 1, V, generator=g) * 3).masked_fill(holes, float("-inf"))
    lp = torch.log_softmax(logits, -1)  # normalised: the verifier refuses anything else
    q = d2t = None
    if mode == "dense":
        q = torch.softmax(torch.randn(B, k, V, generator=g) * 3, -1)
        q = q.masked_fill(torch.rand(B, k, V, generator=g) < 0.3, 0.0)
    elif mode == "mapped":
        Vd = Vd or max(1, V // 2)
        ids = torch.randperm(V, generator=g)[:Vd].sort().values
        d2t = ids - torch.arange(Vd)
        q = torch.softmax(torch.randn(B, k, Vd, generator=g) * 3, -1)
    x = torch.randint(0, V, (B, k), generator=g)
    x = x.masked_fill(torch.rand(B, k, generator=g) < neg_frac, -1)
    greedy = torch.rand(B, generator=g) < greedy_frac
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    return lp, x, q, d2t, greedy, ua, us


def assert_same(args):
    t_k, n_k = compiled(*args)
    t_r, n_r = verify_chain_reference(*args)
    assert torch.equal(t_k, t_r), (t_k != t_r).any(1).nonzero()[:5].tolist()
    assert torch.equal(n_k, n_r)
    return t_k, n_k


SHAPES = list(itertools.product([1, 5, 33], [0, 1, 3, 5], [1, 2, 7, 255, 256, 257, 1000, 2047, 2049, 4097]))


@requires_cpu_kernel
@pytest.mark.parametrize("mode", ["point", "dense", "mapped"])
def test_random_shapes_identical(mode, kernel_variant):
    g = torch.Generator().manual_seed(["point", "dense", "mapped"].index(mode))
    for B, k, V in SHAPES:
        assert_same(make_inputs(B, k, V, mode, g))


@requires_cpu_kernel
def test_empty_batch_and_k_zero(kernel_variant):
    for mode in ["point", "dense", "mapped"]:
        args = make_inputs(0, 3, 10, mode, torch.Generator().manual_seed(0))
        t, n = assert_same(args)
        assert t.shape == (0, 4) and n.shape == (0,)
    assert_same(make_inputs(9, 0, 300, "point", torch.Generator().manual_seed(1)))


@requires_cpu_kernel
def test_bucket_boundaries_and_extreme_uniforms(kernel_variant):
    """Uniform p makes every chunk boundary a potential tie; u at 0 and just below 1."""
    g = torch.Generator().manual_seed(3)
    for V in [SAMPLE_CHUNK - 1, SAMPLE_CHUNK, 3 * SAMPLE_CHUNK, 8 * SAMPLE_CHUNK, 8 * SAMPLE_CHUNK + 7, 5000]:
        B, k = 64, 2
        lp = torch.full((B, k + 1, V), -math.log(V))
        x = torch.full((B, k), -1, dtype=torch.int64)  # no drafts: straight inverse-CDF draws
        greedy = torch.zeros(B, dtype=torch.bool)
        j = torch.arange(B, dtype=torch.float64)
        # u exactly at multiples of 1/B (bucket edges of the uniform distribution), 0, 1 - 2^-53
        us = torch.cat([j[:-2] / (B - 2), torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)])
        ua = torch.rand(B, k, dtype=torch.float64, generator=g)
        t, _ = assert_same((lp, x, None, None, greedy, ua, us))
        assert t[-2, 0] == 0 and t[-1, 0] == V - 1


@requires_cpu_kernel
def test_degenerate_residuals(kernel_variant):
    g = torch.Generator().manual_seed(4)
    B, k, V = 40, 3, 600
    lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1)
    # q == p exactly: the residual is empty (rejections only through rounding) -> falls back to p
    q = lp[:, :k].exp()
    x = torch.randint(0, V, (B, k), generator=g)
    greedy = torch.zeros(B, dtype=torch.bool)
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    assert_same((lp, x, q, None, greedy, ua, us))
    # q larger than p everywhere except one token; one-hot (point-mass) targets
    q2 = torch.full((B, k, V), 1.0 / V)
    lp2 = lp.clone()
    lp2[::3] = torch.where(torch.arange(V) == 11, 0.0, float("-inf"))
    assert_same((lp2, x, q2, None, greedy, ua, us))
    # tiny and subnormal draft probabilities count as 0 in both implementations
    q3 = q2.clone()
    q3[:, :, :50] = 1e-40
    assert_same((lp, x, q3, None, greedy, ua, us))


@requires_cpu_kernel
def test_same_errors_as_reference():
    g = torch.Generator().manual_seed(5)
    lp, x, q, d2t, greedy, ua, us = make_inputs(4, 2, 20, "mapped", g, neg_frac=0.0)
    bad_token = x.clone()
    bad_token[1, 1] = 99
    collide = d2t.clone()
    collide[1] = collide[0] - 1  # draft ids 0 and 1 -> the same target id
    cases = [
        ((lp, bad_token, q, d2t, greedy, ua, us), IndexError, r"draft_tokens\[1, 1\] = 99"),
        ((lp, x, q, d2t, greedy, torch.ones_like(ua), us), ValueError, "u_accept"),
        ((lp, x, q, d2t, greedy, ua, us + 1.0), ValueError, "u_sample"),
        ((lp, x, q, collide, greedy, ua, us), ValueError, "same target id"),
        ((lp, x, q, d2t + 100, greedy, ua, us), ValueError, "outside the target vocabulary"),
        ((lp.double(), x, q, d2t, greedy, ua, us), ValueError, "float32"),
        ((lp, x, None, d2t, greedy, ua, us), ValueError, "without draft_probs"),
    ]
    for args, exc, match in cases:
        for fn in (compiled, verify_chain_reference):
            with pytest.raises(exc, match=match):
                fn(*args)


def test_reference_cumsum_is_sequential_float64():
    """The reference's sampling order relies on torch.cumsum summing left to right on CPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 40000, dtype=torch.float64, generator=g) ** 8
    c = torch.cumsum(x, -1)
    for r in range(3):
        acc = 0.0
        seq = []
        for v in x[r].tolist():
            acc += v
            seq.append(acc)
        assert torch.equal(c[r], torch.tensor(seq, dtype=torch.float64))


@requires_cpu_kernel
def test_spec_exp_bit_identical_and_accurate(kernel_variant):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.randn(200000, generator=g) * 30 - 20,
        torch.linspace(-87, 1, 200001),
        torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, -86.0, -86.00001, -85.99999,
                      88.0, 88.5, 100.0, 1e-40, -1e-40, -1e-8]),
    ])
    a = torch.ops.megatron_spec.spec_exp(x)
    b = spec_exp_reference(x)
    assert torch.equal(a.view(torch.int32)[~x.isnan()], b.view(torch.int32)[~x.isnan()])
    assert a[x.isnan()].isnan().all() and b[x.isnan()].isnan().all()
    ok = (x > -86) & (x <= 88)
    exact = x[ok].double().exp()
    rel = ((a[ok].double() - exact).abs() / exact).max().item()
    assert rel < 2.5 * 2.0**-24  # within ~2 ulp of float32
    assert (a[x < -86] == 0).all()


def test_spec_exp_reference_matches_torch_exp_closely():
    x = torch.linspace(-86, 0, 100001)
    assert torch.allclose(spec_exp_reference(x), x.exp(), rtol=3e-7, atol=0)


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    given = None

if given is not None:

    @requires_cpu_kernel
    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(B=st.integers(0, 9), k=st.integers(0, 6), V=st.integers(1, 3000),
           mode=st.sampled_from(["point", "dense", "mapped"]), seed=st.integers(0, 2**31 - 1),
           greedy_frac=st.sampled_from([0.0, 0.5, 1.0]), hole_frac=st.sampled_from([0.0, 0.5, 0.95]))
    def test_property_kernel_equals_reference(B, k, V, mode, seed, greedy_frac, hole_frac):
        g = torch.Generator().manual_seed(seed)
        assert_same(make_inputs(B, k, V, mode, g, greedy_frac=greedy_frac, hole_frac=hole_frac))


# ---- input checks (issue 18, item 4): both implementations refuse the same inputs --------------------

BOTH = [("compiled", compiled), ("reference", verify_chain_reference)]


def _no_drafts(lp, greedy=False):
    B, K1, _ = lp.shape
    return (lp, torch.full((B, K1 - 1), -1, dtype=torch.int64), None, None, torch.full((B,), greedy),
            torch.full((B, K1 - 1), 0.5, dtype=torch.float64), torch.full((B,), 0.5, dtype=torch.float64))


def _raises_in_both(args, match):
    for _, fn in BOTH:
        with pytest.raises(ValueError, match=match):
            fn(*args)


@requires_cpu_kernel
def test_refuses_raw_logits(kernel_variant):
    """Raw logits as log-probs: before the check every draft with logit > 0 was accepted."""
    g = torch.Generator().manual_seed(11)
    B, k, V = 6, 3, 500
    logits = torch.randn(B, k + 1, V, generator=g) * 3
    x = torch.randint(0, V, (B, k), generator=g)
    args = (
        logits,
        x,
        None,
        None,
        torch.zeros(B, dtype=torch.bool),
        torch.rand(B, k, dtype=torch.float64, generator=g),
        torch.rand(B, dtype=torch.float64, generator=g),
    )
    _raises_in_both(args, r"not a log-probability|not normalised")
    # greedy rows refuse them too (largest probability above 1): the argmax is right, the row no distribution
    _raises_in_both(args[:4] + (torch.ones(B, dtype=torch.bool),) + args[5:],
                    r"target_logprobs\[0, \d\] is not normalised: its largest probability")


@requires_cpu_kernel
def test_mass_tolerance_boundary_and_first_bad_row(kernel_variant):
    """Sampled rows: the mass of the emission position within 1e-3 of 1; the first bad row is named."""
    g = torch.Generator().manual_seed(12)
    lp = torch.log_softmax(torch.randn(5, 1, 3000, generator=g), -1)
    ok = lp.clone()
    ok[1] += math.log1p(0.9e-3)
    ok[3] += math.log1p(-0.9e-3)
    assert_same(_no_drafts(ok))
    bad = ok.clone()
    bad[2] += math.log1p(-1.1e-3)
    bad[4] += math.log1p(1.1e-3)
    _raises_in_both(_no_drafts(bad), r"target_logprobs\[2, 0\] is not normalised: its probabilities sum "
                                     r"to 0\.998\d*, not 1 \(tolerance 0\.001\)")


@requires_cpu_kernel
def test_greedy_rows_bound_their_largest_probability(kernel_variant):
    """Greedy rows: the largest probability at the emission position in [(1 - 1e-3) / V, 1 + 1e-3]."""
    V = 1000
    point = torch.full((4, 1, V), float("-inf"))
    point[:, 0, 7] = 0.0
    uniform = torch.full((4, 1, V), -math.log(V))
    for base, scale_ok, scale_bad in [(point, 1 + 0.9e-3, 1 + 1.1e-3), (uniform, 1 - 0.9e-3, 1 - 1.1e-3)]:
        ok = base + math.log(scale_ok)
        t, _ = assert_same(_no_drafts(ok, greedy=True))
        assert (t[:, 0] == (7 if base is point else 0)).all()
        bad = ok.clone()
        bad[3] = base[3] + math.log(scale_bad)
        _raises_in_both(
            _no_drafts(bad, greedy=True),
            r"target_logprobs\[3, 0\] is not normalised: its largest probability is .*outside \[1/V, 1\]",
        )


@requires_cpu_kernel
@pytest.mark.parametrize("V", [5, 37, 300])
def test_greedy_nan_refused_where_the_chain_reads(kernel_variant, V):
    """torch.argmax picks a NaN, an ordered max skips it: both now refuse the row instead."""
    g = torch.Generator().manual_seed(13)
    B, k = 3, 3
    lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1)
    x = lp[:, :k].argmax(-1)  # every draft is the argmax: the chain reaches position k
    greedy = torch.ones(B, dtype=torch.bool)
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    for pos, tok in [(1, V - 2), (0, 3 % V), (k, V - 1)]:  # vector body and scalar tail of the argmax
        bad = lp.clone()
        bad[1, pos, tok] = float("nan")
        _raises_in_both(
            (bad, x, None, None, greedy, ua, us), rf"target_logprobs\[1, {pos}\] contains NaN \(greedy row\)"
        )
    # a NaN where the chain never reads (after a rejection at position 0) is not looked at, by either
    x2 = x.clone()
    x2[:, 0] = (x[:, 0] + 1) % V
    bad = lp.clone()
    bad[:, 2, 0] = float("nan")
    assert_same((bad, x2, None, None, greedy, ua, us))


@requires_cpu_kernel
@pytest.mark.parametrize("mode", ["point", "dense", "mapped"])
def test_sampled_row_nan_and_positive_logprob_refused(kernel_variant, mode):
    g = torch.Generator().manual_seed(14)
    lp, x, q, d2t, greedy, ua, us = make_inputs(
        4, 2, 700, mode, g, greedy_frac=0.0, neg_frac=0.0, hole_frac=0.0
    )
    # NaN in the emission row (never sampled before; now the row's mass is NaN)
    no_draft = x.clone().fill_(-1)
    bad = lp.clone()
    bad[2, 0, 600] = float("nan")
    _raises_in_both((bad, no_draft, q, d2t, greedy, ua, us), r"target_logprobs\[2, 0\] contains NaN")
    # a tested draft with log-prob above 0 (accepted whatever u is: raw logits)
    bad = lp.clone()
    bad[1, 0, x[1, 0]] = 0.5
    _raises_in_both(
        (bad, x, q, d2t, greedy, ua, us), rf"target_logprobs\[1, 0, {int(x[1, 0])}\] = 0\.5 is not a log-prob"
    )
    # a row without mass keeps its message
    bad = lp.clone()
    bad[3, 0] = float("-inf")
    _raises_in_both(
        (bad, no_draft, q, d2t, greedy, ua, us), r"target_logprobs\[3, 0\] has no probability mass"
    )


@requires_cpu_kernel
def test_point_masses_and_neg_inf_stay_legal(kernel_variant):
    """log p = 0 at one id and -inf elsewhere (greedy / top-k 1 rows), point-mass and one-hot draft
    distributions, rows that are almost all -inf: accepted by both, identically."""
    g = torch.Generator().manual_seed(15)
    B, k, V = 8, 3, 1000
    at = torch.randint(0, V, (B, k + 1), generator=g)
    lp = torch.full((B, k + 1, V), float("-inf")).scatter_(2, at[..., None], 0.0)  # [B, k+1, V] point masses
    x = torch.where(torch.rand(B, k, generator=g) < 0.5, at[:, :k], torch.randint(0, V, (B, k), generator=g))
    q1 = torch.zeros(B, k, V).scatter_(2, x[..., None], 1.0)  # one-hot draft distributions
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    for greedy in (torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)):
        for q in (None, q1):
            t, n = assert_same((lp, x, q, None, greedy, ua, us))
            # the target is deterministic: every emitted token is its point
            for b in range(B):
                assert t[b, : int(n[b]) + 1].tolist() == at[b, : int(n[b]) + 1].tolist()
    sparse = make_inputs(8, 3, 4097, "dense", g, hole_frac=0.999)
    assert_same(sparse)


def test_process_logits_output_is_well_inside_the_tolerance():
    """The tolerance's margin: process_logits' float32 output at V = 152k, low and high temperature."""
    from megatron_spec.ops.ms_math_reference import MASS_TOL, logprob_mass
    from megatron_spec.speculative.logits import SamplingTensors, process_logits

    g = torch.Generator().manual_seed(16)
    logits = torch.randn(4, 152064, generator=g) * 4
    worst = 0.0
    for temp, top_p, top_k in [(0.01, 1.0, 0), (0.1, 0.9, 0), (1.0, 1.0, 0), (10.0, 0.95, 50), (1.0, 1.0, 1)]:
        s = SamplingTensors.from_values(temperature=temp, top_p=top_p, top_k=top_k, batch_size=4)
        m = logprob_mass(process_logits(logits, s))
        worst = max(worst, float((m - 1).abs().max()))
    assert worst < MASS_TOL / 20, worst  # measured 1.5e-5 (temperature 1, full vocabulary): 66x inside


def test_logprob_mass_order_is_the_kernels_lane_order():
    """The mass the kernels sum (csrc/cpu/kernels_impl.h chunk_mass), written out in plain Python."""
    from megatron_spec.ops.ms_math_reference import logprob_mass

    g = torch.Generator().manual_seed(17)
    for V in [1, 7, 8, 255, 256, 257, 1000]:
        lp = torch.log_softmax(torch.randn(3, V, generator=g) * 4, -1)
        p = spec_exp_reference(lp).double().tolist()
        for r in range(3):
            m = 0.0
            for a in range(0, V, SAMPLE_CHUNK):
                lanes = [0.0] * 8
                for i, v in enumerate(p[r][a: a + SAMPLE_CHUNK]):
                    lanes[i % 8] += v
                m += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
                    (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
                )
            assert logprob_mass(lp[r: r + 1]).item() == m
