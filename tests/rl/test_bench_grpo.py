"""benchmarks/bench_grpo.py's keys from its runs' metrics rows, one round and several (``--rounds``)."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load_benchmark


def _rows(gen_s: list[float], step_s: float, tokens: int = 100, accept: float = 1.0) -> list[dict]:
    return [{"time/gen": g, "time/step": step_s + g, "gen/tokens_per_s": tokens / g,
             "spec/accept_length": accept, "spec/k_mean": 0.5, "reward/mean": 0.1 * i}
            for i, g in enumerate(gen_s)]


def _round(ar: float, spec: float, adaptive: float) -> dict[str, list[dict]]:
    """Three runs of 3 steps; the first step of each (not counted) far slower."""
    return {"spec": _rows([99.0, spec, spec], 5.0, accept=2.0), "ar": _rows([99.0, ar, ar], 5.0),
            "spec_adaptive_history": _rows([99.0, adaptive, 2 * adaptive], 5.0)}


def test_a_round_s_speedups_come_from_its_runs_after_their_first_step():
    bench = load_benchmark("bench_grpo")
    s = bench.round_summary(_round(ar=4.0, spec=8.0, adaptive=2.0), {"v_k3": 1.5, "c": 0.1}, None, 1)
    assert s["gen_speedup"] == 0.5
    assert s["gen_speedup_adaptive_history"] == pytest.approx(4.0 / 3.0, abs=1e-3)  # 4 / mean(2, 4)
    assert s["gen_step_ratios_adaptive_history"] == [2.0, 1.0]
    assert s["gen_speedup_adaptive_history_median"] == 1.5
    assert s["step_speedup"] == pytest.approx(9.0 / 13.0, abs=1e-3)
    assert s["ceiling_k3"] == pytest.approx(2.0 / 1.8, abs=1e-3)


def test_over_rounds_takes_each_number_s_median_and_lists_the_speedups_per_round():
    bench = load_benchmark("bench_grpo")
    regime = {"v_k3": 1.5, "c": 0.1}
    summaries = [bench.round_summary(_round(4.0, spec, adaptive), regime, None, 1)
                 for spec, adaptive in ((8.0, 4.0), (4.0, 2.0), (2.0, 8.0))]
    out = bench.over_rounds(summaries)
    assert out["rounds"] == 3
    assert out["gen_speedup_rounds"] == [0.5, 1.0, 2.0]
    assert out["gen_speedup"] == 1.0
    assert out["gen_speedup_adaptive_history_rounds"] == [round(4 / 6, 3), round(4 / 3, 3), round(4 / 12, 3)]
    assert out["gen_speedup_adaptive_history"] == round(4 / 6, 3)
    assert out["gen_step_ratios"] == [[0.5, 0.5], [1.0, 1.0], [2.0, 2.0]]  # lists: one per round
    assert "accept_length_rounds" not in out and out["accept_length"] == 2.0
    assert bench.over_rounds(summaries[:1]) == summaries[0]  # one round: its keys as they are
