"""The ``cpu`` profile (measured by benchmarks/measure_cpu_profile.py), the engine-benchmark
plumbing, and the simulator's prediction of our own engine's measured speedups (the committed
record of benchmarks/bench_rollout.py --steady-only, never fitted to)."""

from __future__ import annotations

import json

import pytest

from megatron_spec.sim.engine_bench import validate_engine_benchmark
from megatron_spec.sim.hardware import CPU_PROFILE_PATH, get_hardware
from megatron_spec.sim.params import efficiency_for
from megatron_spec.sim.roofline import _curve

ENGINE_RECORD = CPU_PROFILE_PATH.parent / "cpu_engine_bench.json"


@pytest.fixture(scope="module")
def cpu():
    return get_hardware("cpu")


def test_profile_holds_measured_figures(cpu):
    raw = json.loads(CPU_PROFILE_PATH.read_text())
    assert cpu.kind == "cpu" and cpu.mem_bw == raw["mem_bw"] > 1e9
    assert cpu.flops["bf16"] > 1e10 and cpu.weight_bw["bf16"] > 1e9
    assert 0 <= cpu.extra["gemm_call_s"]["bf16"] < 1e-3 and cpu.layer_overhead_s > 0
    assert set(cpu.attn_bw["bf16"]) == {1, 2, 4, 8}
    eff = efficiency_for(cpu)  # measured figures are achieved ones: nothing fitted
    assert eff.mem_eff == eff.flop_eff == 1.0 and eff.eager_layer_overhead_s == cpu.layer_overhead_s


def test_gemm_call_model_matches_the_measured_calls(cpu):
    """t = gemm_call_s + weight bytes / weight_bw, fitted to the one-token calls at four weight
    shapes: every measured call (bf16 and fp32) within 20% of the fit."""
    for dtype, short in (("bfloat16", "bf16"), ("float32", "fp32")):
        t0, bw = cpu.extra["gemm_call_s"][short], cpu.weight_bw[short]
        points = cpu.extra["gemm_calls"][dtype]
        assert len(points) >= 3 and t0 >= 0
        for pt in points:
            assert t0 + pt["bytes"] / bw == pytest.approx(pt["s_per_call"], rel=0.20), (dtype, pt["shape"])


def test_gemm_curve_is_the_measured_table_and_linear_beyond(cpu):
    """The CPU GEMM curve returns the stack's measured t(n)/t(1) at its points, interpolates
    between them and grows linearly in n past the last one (compute-bound)."""
    stack = cpu.extra["linear_stack"]["bfloat16"]["forward_s"]
    curve = cpu.extra["gemm_curve"]["bf16"]
    for n, t in stack.items():
        assert float(_curve(int(n), curve)) == pytest.approx(t / stack["1"], rel=1e-9)
    last = max(curve)
    assert float(_curve(4 * last, curve)) == pytest.approx(4 * curve[last])
    lo, hi = sorted((curve[16], curve[32]))
    assert lo <= float(_curve(24, curve)) <= hi


def _bench(**over):
    bench = {"hardware": "cpu", "model": "qwen3-0.6b", "dtype": "bfloat16", "draft_kind": "eagle3",
             "prompt_len": 32, "max_new_tokens": 64,
             "results": [{"batch_size": 1, "ar_tokens_per_s": 20.0,
                          "spec": [{"k": k, "accept_length": 1 + 0.7 * k ** 0.5, "tokens_per_s": 30.0,
                                    "v": 1.1, "c": 0.1} for k in (1, 2, 3)]}]}
    bench.update(over)
    return bench


def test_engine_benchmark_rows_and_fields():
    out = validate_engine_benchmark(_bench())
    assert [r["k"] for r in out["rows"]] == [1, 2, 3]
    for r in out["rows"]:
        assert r["measured_speedup"] == pytest.approx(1.5)
        assert r["rel_error"] == pytest.approx(r["predicted_speedup"] / 1.5 - 1)
        assert r["v_predicted"] > 0 and r["c_predicted"] > 0
        # the host cost is what the AR measurement leaves after the modelled forward
        assert r["host_s_per_forward_from_ar"] == pytest.approx(
            max(0.0, 1 / 20.0 - 1 / r["ar_tokens_per_s_profile_only"]))


def test_host_cost_from_ar_makes_a_slow_engine_host_bound():
    """A host cost per sampling call, read off the AR rate, is added to the AR step, the verify
    step and each of the k draft passes: tau (t_ar + h) / (t_spec + (1 + k) h) -> tau / (1 + k)
    when h dominates (one token per second here)."""
    slow = _bench()
    slow["results"][0]["ar_tokens_per_s"] = 1.0
    for r in validate_engine_benchmark(slow)["rows"]:
        assert r["host_s_per_forward_from_ar"] > 0.5
        assert r["predicted_speedup"] == pytest.approx(r["accept_length"] / (1 + r["k"]), rel=0.1)


def test_predicts_our_engine_within_20_percent_on_three_k():
    """Issue 8: the simulator (CPU profile + the host cost read off the AR rate) predicts the
    engine's measured speculative speedup within 20% on at least three k values of one batch
    size. The record (bf16, 109M target, ModelOpt EAGLE-3 head, k = 1..5, B = 1, 4, 16) was
    measured by benchmarks/bench_rollout.py --steady-only; nothing was fitted to it."""
    out = validate_engine_benchmark(ENGINE_RECORD, tolerance=0.2)
    assert out["model"].endswith("cpu_engine_bench_target_config.json")
    by_batch = {}
    for r in out["rows"]:
        assert r["predicted_speedup"] > 0 and r["measured_speedup"] > 0
        if abs(r["rel_error"]) <= 0.2:
            by_batch.setdefault(r["batch_size"], set()).add(r["k"])
    assert max(map(len, by_batch.values()), default=0) >= 3, by_batch


def test_engine_benchmark_errors(tmp_path):
    bad = _bench()
    del bad["results"]
    with pytest.raises(ValueError, match="lacks"):
        validate_engine_benchmark(bad)
    bad = _bench()
    bad["results"][0]["spec"][0]["accept_length"] = 3.5
    with pytest.raises(ValueError, match="impossible for k=1"):
        validate_engine_benchmark(bad)
    with pytest.raises(ValueError, match="does not exist"):
        validate_engine_benchmark(tmp_path / "nope.json")
    path = tmp_path / "bench.log"
    path.write_text("some log line\n" + json.dumps(_bench()) + "\n")  # the benchmark's last line
    assert len(validate_engine_benchmark(path)["rows"]) == 3
