"""Held-out public measurements (megatron_spec/sim/validate.py): nothing here is fitted."""

from __future__ import annotations

import pytest

from megatron_spec.sim.validate import evaluate, main, points


@pytest.fixture(scope="module")
def rows():
    return {r["name"]: r for r in (evaluate(p) for p in points())}


def test_points_with_known_inputs_are_within_20_percent(rows):
    known = [r for r in rows.values() if r["known_inputs"]]
    assert len(known) >= 3
    for r in known:
        assert abs(r["rel_error"]) <= 0.20, r


def test_skyrl_rollout_and_step_predictions(rows):
    r = rows["SkyRL Qwen3.5-9B 8xH100 MTP k=3: rollout"]
    assert r["measured"] == pytest.approx(310.1 / 152.4)
    assert 1.5 < r["predicted"] < r["measured"]  # speculation pays; the simulator is the conservative side


def test_verl_h20_is_predicted_as_a_loss_for_every_reachable_acceptance(rows):
    r = rows["verl MiMo-7B H20 SGLang MTP (loss case)"]
    assert r["predicted"] < 1.0
    # two draft steps cap the accept length at 3: a loss however well the draft matches
    assert all(v < 1.0 for v in r["predicted_by_tau"].values())
    assert max(r["predicted_by_tau"]) == 3.0
    # the reported ~0.5x lies inside the swept range (tau 1.5 .. 2.0)
    assert r["predicted_by_tau"][1.5] < 0.5 < r["predicted_by_tau"][2.0]


def test_cli_prints_the_table(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:1] == ["point"] and "verl MiMo-7B H20" in out
