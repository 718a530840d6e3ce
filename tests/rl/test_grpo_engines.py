"""Several rollout engines in one GRPO job (torchrun, gloo, native engines on CPU).

Two ranks with ``--rollout-num-engines 2``: both engines generate a share of every step, greedy
rollouts and checkpoints equal the one-engine run's token for token, a kill of one engine in the
middle of a step is survived (it is restarted and re-fed, only its prompts are generated again,
and the run is still token-identical), and a run killed while checkpointing resumes exactly.
Four ranks at TP=2 x 2 engines: each engine is fed by its own TP group.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.rl.test_grpo_e2e import grpo, metrics, model_state, rollouts

pytestmark = pytest.mark.dist

GREEDY = ["--rollout-temperature", "0", "--rollout-dtype", "float32", "--advantage-baseline", "batch",
          "--dump-rollouts", "--spec-draft-kind", "eagle3"]


def _same_run(a, b, steps: int) -> None:
    for step in range(1, steps + 1):
        assert rollouts(a, step) == rollouts(b, step), f"step {step} rollouts differ"
    x, y = model_state(a, steps), model_state(b, steps)  # every rank's shards, whole
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), "the checkpoints differ"


def test_two_engines_share_the_work_and_match_one_engine_then_survive_a_kill(setup, tmp_path):
    common = [*GREEDY, "--spec-draft-path", setup.eagle3, "--train-iters", "3"]
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    grpo(setup, one, *common, "--rollout-num-engines", "1", nproc=2)
    proc = grpo(setup, two, *common, "--rollout-num-engines", "2", nproc=2)
    assert "2 rollout engine(s)" in proc.stderr
    m = metrics(two)
    for r in m:
        assert r["rollout/num_engines"] == 2
        assert r["rollout/engine0/samples"] > 0 and r["rollout/engine1/samples"] > 0
        assert r["rollout/engine0/samples"] + r["rollout/engine1/samples"] == 8  # 4 prompts x 2 samples
        assert r["rollout/imbalance"] >= 1.0 and r["rollout/engine1/gen_s"] > 0
        assert r["rollout/engine1/accept_length"] >= 1.0
    assert metrics(one)[0]["rollout/num_engines"] == 1
    _same_run(one, two, 3)

    # engine 1 dies at its 2nd generate (step 2): restarted, re-fed, its prompts generated again
    proc = grpo(
        setup,
        killed,
        *common,
        "--rollout-num-engines",
        "2",
        nproc=2,
        env={"MEGATRON_SPEC_FAULTS": "engine1_exit_at_generate=2", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)},
    )
    assert "failed" in proc.stderr and "restarting them" in proc.stderr
    mk = metrics(killed)
    assert [r["step"] for r in mk] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in mk] == [0, 1, 1]
    _same_run(two, killed, 3)


def test_two_engines_resume_exactly_after_a_kill(setup, tmp_path):
    base = ["--rollout-temperature", "1.0", "--rollout-dtype", "float32", "--save-interval", "1",
            "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3, "--rollout-num-engines", "2",
            "--train-iters", "3"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    grpo(setup, straight, *base, nproc=2)
    proc = grpo(setup, crashed, *base, nproc=2, check=False,
                env={"MEGATRON_SPEC_FAULTS": "kill_in_save=2", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert (crashed / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    grpo(setup, crashed, *base, "--load", str(crashed), nproc=2)
    a, b = model_state(straight, 3), model_state(crashed, 3)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run diverged"
    assert [r["step"] for r in metrics(crashed)][-2:] == [2, 3]


def test_tp2_times_two_engines_on_four_ranks(setup, tmp_path):
    """Each engine gets its weights from its own TP group (ranks 0-1 feed engine 0, 2-3 engine 1)."""
    common = [
        *GREEDY,
        "--spec-draft-path",
        setup.eagle3,
        "--train-iters",
        "2",
        "--tensor-model-parallel-size",
        "2",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    grpo(setup, one, *common, "--rollout-num-engines", "1", nproc=4)
    grpo(setup, two, *common, "--rollout-num-engines", "2", nproc=4)
    m = metrics(two)
    assert all(r["rollout/engine0/samples"] > 0 and r["rollout/engine1/samples"] > 0 for r in m)
    assert all(r["sync/bytes"] > 0 for r in m)
    _same_run(one, two, 2)


def test_a_rollout_wait_past_its_timeout_is_named(setup, tmp_path):
    proc = grpo(
        setup,
        tmp_path / "run",
        "--rollout-num-engines",
        "2",
        "--train-iters",
        "2",
        "--rollout-wait-timeout-s",
        "3",
        nproc=2,
        check=False,
        env={
            "MEGATRON_SPEC_FAULTS": "engine1_stall_at_generate=1",
            "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path),
        },
    )
    assert proc.returncode != 0
    assert "--rollout-wait-timeout-s 3 for the rollouts of engine 1 (rank 1)" in proc.stderr


def _prompts(run, step: int) -> list:
    return sorted(p for p, _ in rollouts(run, step))


def test_async_resume_trains_the_in_flight_prompts(setup, tmp_path, lag=2):
    """A checkpoint taken while batches are in flight resumes before those batches' prompts: the
    resumed run trains on exactly the prompts the uninterrupted one did (issue 17, item 3). Lag 2, two
    batches in flight, the harder case of the same resume code; lag 1's versions: test_async_policy_lag
    (each lag was ~150 s of the suite)."""
    base = ["--async-policy-lag", str(lag), "--save-interval", "1", "--dump-rollouts", "--train-iters", "4",
            "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3, "--rollout-num-engines", "2"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    grpo(setup, straight, *base, nproc=2)
    m = metrics(straight)
    assert [r["rollout/policy_version"] for r in m] == [max(0, t - lag) for t in range(4)]
    for t in range(4):  # batch t (0-based) was generated by version max(0, t - lag), every rollout says so
        rows = [
            json.loads(x)
            for x in (straight / "rollouts" / f"step_{t + 1:06d}.jsonl").read_text().splitlines()
        ]
        assert {r["policy_version"] for r in rows} == {max(0, t - lag)}
    proc = grpo(setup, crashed, *base, nproc=2, check=False,
                env={"MEGATRON_SPEC_FAULTS": "kill_in_save=3", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert (crashed / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    grpo(setup, crashed, *base, "--load", str(crashed), nproc=2)
    for step in (3, 4):
        assert _prompts(crashed, step) == _prompts(straight, step), f"step {step} trained other prompts"
