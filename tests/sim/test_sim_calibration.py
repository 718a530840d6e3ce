"""The committed calibration reproduces the paper's 8B measurements (docs/design.md, "Reference
measurements").

Every prediction here is recomputed by the simulator from the committed fitted parameters;
nothing is read back from the stored predictions except to check they are reproducible.
"""

from __future__ import annotations

import json

import pytest

from megatron_spec.sim import calibrate
from megatron_spec.sim.params import CALIBRATION_PATH, load_calibration


@pytest.fixture(scope="module")
def values():
    return calibrate.calibrated_values()


@pytest.fixture(scope="module")
def results(values):
    return calibrate.run_scenarios(values)


@pytest.fixture(scope="module")
def evaluation(values):
    return {r["name"]: r for r in calibrate.evaluate(values)}


def test_every_paper_target_within_10_percent(evaluation):
    assert len(evaluation) == len(calibrate.TARGETS) == 13
    bad = {n: round(r["rel_error"], 3) for n, r in evaluation.items() if abs(r["rel_error"]) > 0.10}
    assert not bad, f"targets off by more than 10%: {bad}"


def test_stored_fit_is_reproducible(evaluation):
    stored = {r["name"]: r for r in load_calibration()["fit"]["targets"]}
    assert stored.keys() == evaluation.keys()
    for name, row in evaluation.items():
        assert row["predicted"] == pytest.approx(stored[name]["predicted"], rel=1e-9), name


def test_generation_and_step_speedups_at_k3(results):
    zero, think = results["rl-zero/eagle3/k3"], results["rl-think/eagle3/k3"]
    assert zero.rollout_speedup == pytest.approx(100.0 / 56.6, rel=0.10)  # 1.77x
    assert think.rollout_speedup == pytest.approx(133.6 / 87.0, rel=0.10)  # 1.54x
    assert zero.e2e_speedup == pytest.approx(1.41, rel=0.10)
    assert think.e2e_speedup == pytest.approx(1.35, rel=0.10)
    assert zero.rollout_speedup > think.rollout_speedup


def test_longer_drafts_are_slower(results):
    for wl in ("rl-zero", "rl-think"):
        s = [results[f"{wl}/eagle3/k{k}"].rollout_speedup for k in (3, 5, 7)]
        assert s[0] > s[1] > s[2], (wl, s)
    # RL-Think (long contexts) falls below autoregressive at k >= 5, RL-Zero does not
    assert results["rl-think/eagle3/k5"].rollout_speedup < 1.0 < results["rl-zero/eagle3/k5"].rollout_speedup
    assert results["rl-think/eagle3/k7"].rollout_speedup == pytest.approx(0.71, rel=0.10)


def test_ngram_slower_than_ar_despite_acceptance_above_two(results):
    for wl, tau, measured in (("rl-zero", 2.47, 0.7), ("rl-think", 2.05, 0.5)):
        r = results[f"{wl}/ngram"]
        assert r.detail["accept_length"] == pytest.approx(tau)
        assert r.rollout_speedup < 1.0
        assert r.rollout_speedup == pytest.approx(measured, rel=0.10)


def test_async_step_speedup(results):
    assert calibrate._async_step_speedup(results["rl-zero/async/k3"]) == pytest.approx(1.24, rel=0.10)


def test_fitted_parameters_inside_their_bounds(values):
    for name, (lo, hi) in calibrate.BOUNDS.items():
        assert lo <= values[name] <= hi, name


def test_report_prints_the_fitted_parameters():
    doc = json.loads(CALIBRATION_PATH.read_text())
    text = calibrate.format_report(doc)
    for name in doc["gpu"]:
        assert name in text
    assert "max |error|" in text and "rl-think gen speedup k=5" in text


def test_calibration_script_writes_a_file(tmp_path):
    out = tmp_path / "cal.json"
    assert calibrate.main(["--starts", "1", "--max-nfev", "1", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["gpu"]) == set(load_calibration()["gpu"])
    assert len(doc["fit"]["targets"]) == len(calibrate.TARGETS)
