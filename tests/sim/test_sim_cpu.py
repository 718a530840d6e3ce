"""The ``cpu`` profile (measured by benchmarks/measure_cpu_profile.py) and the engine-benchmark
input the CPU validation will use. The validation itself needs the rollout engine's benchmark
(benchmarks/bench_rollout.py), which does not exist yet; these tests check the profile and the
plumbing only."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_spec.sim.engine_bench import validate_engine_benchmark
from megatron_spec.sim.hardware import CPU_PROFILE_PATH, get_hardware
from megatron_spec.sim.params import efficiency_for


@pytest.fixture(scope="module")
def cpu():
    return get_hardware("cpu")


def test_profile_holds_measured_figures(cpu):
    raw = json.loads(CPU_PROFILE_PATH.read_text())
    assert cpu.kind == "cpu" and cpu.mem_bw == raw["mem_bw"] > 1e9
    assert cpu.flops["bf16"] > 1e10 and cpu.weight_bw["bf16"] > 1e9
    assert set(cpu.attn_bw["bf16"]) == {1, 2, 4, 8}
    eff = efficiency_for(cpu)  # measured figures are achieved ones: nothing fitted
    assert eff.mem_eff == eff.flop_eff == 1.0 and eff.eager_layer_overhead_s == cpu.layer_overhead_s


def test_roofline_form_matches_the_measured_table(cpu):
    """t(n) = (t_mem^p + t_comp^p)^(1/p) with t_mem from the 1-token time, t_comp from the
    256-token rate and p fitted to the table: every point of the bf16 table within 30%."""
    stack = cpu.extra["linear_stack"]["bfloat16"]
    p = cpu.extra["roofline_p"]["bf16"]
    t_mem = stack["params"] * stack["bytes_per_param"] / cpu.weight_bw["bf16"]
    for n, measured in stack["forward_s"].items():
        t_comp = 2 * stack["params"] * int(n) / cpu.flops["bf16"]
        predicted = (t_mem ** p + t_comp ** p) ** (1 / p)
        assert predicted == pytest.approx(measured, rel=0.30), n


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
    """A host cost per forward, read off the AR rate, is added to the AR and the verify step:
    tau (t_ar + h) / (t_spec + h) -> tau when h dominates (one token per second here)."""
    slow = _bench()
    slow["results"][0]["ar_tokens_per_s"] = 1.0
    for r in validate_engine_benchmark(slow)["rows"]:
        assert r["host_s_per_forward_from_ar"] > 0.5
        assert r["predicted_speedup"] == pytest.approx(r["accept_length"], rel=0.1)


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
