"""Continuous-batching schedule and the integral of step costs over the long tail."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_spec.sim.rollout import schedule, simulate_engine, simulate_streaming


def const(c):
    def fn(b, ctx):
        t = np.full_like(b, c, dtype=float)
        z = np.zeros_like(t)
        return {"total": t, "verify": t, "draft": z, "host": z, "eager": np.zeros_like(t, dtype=bool)}
    return fn


def echo(key):
    """A step cost equal to the batch size or the cached context, to integrate them."""
    def fn(b, ctx):
        t = np.asarray(b if key == "b" else ctx, dtype=float)
        z = np.zeros_like(t)
        return {"total": t, "verify": t, "draft": z, "host": z, "eager": np.zeros_like(t, dtype=bool)}
    return fn


def test_schedule_all_at_once_and_sequential():
    lengths = np.array([30.0, 10.0, 20.0])
    start, finish = schedule(lengths, 2.0, concurrency=8)
    assert start.tolist() == [0, 0, 0] and finish.tolist() == [15, 5, 10]
    start, finish = schedule(lengths, 1.0, concurrency=1)
    assert start.tolist() == [0, 30, 40] and finish.tolist() == [30, 40, 60]


def test_makespan_is_the_slowest_sequence():
    lengths = np.array([100.0, 400.0, 50.0])
    res = simulate_engine(lengths, prompt_len=10, concurrency=8, tau=2.0, step_fn=const(0.01))
    assert res.decode_s == pytest.approx(0.01 * 400 / 2.0)
    assert res.steps == pytest.approx(200.0)


def test_batch_integral_counts_every_sequence_step():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 3000, 50).astype(float)
    for conc in (50, 7):
        res = simulate_engine(lengths, prompt_len=0, concurrency=conc, tau=1.5, step_fn=echo("b"))
        assert res.decode_s == pytest.approx(lengths.sum() / 1.5)


def test_context_integral_is_exact_for_linear_growth():
    # sum_i integral_0^{n_i} (P + tau s) ds = sum_i (P n_i + tau n_i^2 / 2), n_i = l_i / tau
    lengths = np.array([1000.0, 2500.0, 40.0, 7000.0])
    P, tau = 128, 2.5
    n = lengths / tau
    res = simulate_engine(lengths, prompt_len=P, concurrency=2, tau=tau, step_fn=echo("ctx"))
    assert res.decode_s == pytest.approx(float(np.sum(P * n + tau * n * n / 2)))


def test_streaming_has_no_tail():
    res = simulate_streaming(total_tokens=1e6, mean_len=1000, mean_sq_len=2e6, prompt_len=100,
                             concurrency=100, tau=2.0, step_fn=const(0.01))
    assert res.steps == pytest.approx(1e6 / (2.0 * 100))
    assert res.decode_s == pytest.approx(0.01 * 5000)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="tau=0.5"):
        simulate_engine(np.array([10.0]), 0, 1, 0.5, const(1))
    with pytest.raises(ValueError, match="concurrency=0"):
        simulate_engine(np.array([10.0]), 0, 0, 1.0, const(1))
