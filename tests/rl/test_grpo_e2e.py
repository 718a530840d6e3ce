"""The GRPO launcher end to end (torchrun, gloo): exactness, resumption, faults, bad input.

Each test runs ``launch/pretrain_grpo_spec.py`` on the session's small target with its
ModelOpt-trained EAGLE-3 draft (tests/conftest.py). Rewards come from
tests/rl/rewards_for_tests.py by import path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_spec.rl.checkpoint import checkpoint_tensors
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch" / "pretrain_grpo_spec.py"

pytestmark = pytest.mark.dist


def grpo(setup, run_dir: Path, *extra: str, nproc: int = 1, env: dict | None = None, check: bool = True,
         timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(LAUNCH),
        "--hf-checkpoint",
        setup.target,
        "--prompt-data",
        "synthetic:sum",
        "--reward",
        "tests.rl.rewards_for_tests:digit_share",
        "--make-vocab-size-divisible-by",
        "8",
        "--prompts-per-step",
        "4",
        "--grpo-group-size",
        "2",
        "--micro-batch-size",
        "4",
        "--rollout-max-new-tokens",
        "12",
        "--rollout-max-batch-size",
        "8",
        "--rollout-num-threads",
        "1",
        "--lr",
        "1e-3",
        "--save",
        str(run_dir),
        "--quiet",
        "--tensorboard-dir",
        "none",
        *extra,
    ]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    if check and proc.returncode != 0:
        raise AssertionError(f"GRPO run failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollouts(run_dir: Path, step: int) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return [(r["prompt_ids"], r["response_ids"]) for r in rows]


def model_state(run_dir: Path, step: int) -> dict:
    """The checkpoint's policy and AdamW state, whole (every TP shard's)."""
    return checkpoint_tensors(str(run_dir / f"iter_{step:07d}"))


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_speculation_on_off_identical_rollouts_and_checkpoints(setup, tmp_path, tp):
    common = ["--rollout-temperature", "0", "--rollout-dtype", "float32", "--rollout-weight-dtype", "fp32",
              "--advantage-baseline", "batch", "--train-iters", "5", "--dump-rollouts",
              "--tensor-model-parallel-size", str(tp)]
    spec, ar = tmp_path / "spec", tmp_path / "ar"
    grpo(setup, spec, *common, "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3, nproc=tp)
    grpo(setup, ar, *common, "--spec-draft-kind", "none", nproc=tp)
    for step in range(1, 6):
        assert rollouts(spec, step) == rollouts(ar, step), f"step {step} rollouts differ"
    m = metrics(spec)
    assert all(r["spec/num_draft_tokens"] == 3 for r in m) and any(r["spec/accept_length"] > 1.0 for r in m)
    assert metrics(ar)[0]["spec/accept_length"] == 1.0 and "vllm/spec_acceptance_rate" not in metrics(ar)[0]
    for r in m:  # the NeMo-RL / SkyRL names beside ours: the same counts, positions 1-based
        assert r["vllm/spec_acceptance_length"] == pytest.approx(r["spec/accept_length"])
        assert (
            r["vllm/spec_num_accepted_tokens"]
            <= r["vllm/spec_num_draft_tokens"]
            <= 3 * r["vllm/spec_num_drafts"]
        )
        assert r["vllm/train/draft_acceptance_rate_pos_1"] == r["spec/accept_rate_pos0"]
    a, b = model_state(spec, 5), model_state(ar, 5)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "the checkpoints differ"
    assert any(r["train/grad_norm"] > 0 for r in m), "the policy must actually change in this test"


def test_kill_during_checkpoint_write_then_resume_exactly(setup, tmp_path):
    base = ["--rollout-temperature", "1.0", "--rollout-dtype", "float32", "--save-interval", "1",
            "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3]
    straight = tmp_path / "straight"
    grpo(setup, straight, *base, "--train-iters", "4")
    crashed = tmp_path / "crashed"
    proc = grpo(setup, crashed, *base, "--train-iters", "4", check=False,
                env={"MEGATRON_SPEC_FAULTS": "kill_in_save=3", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert (crashed / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (crashed / "iter_0000003" / "COMPLETE").exists()
    # the same command again: it resumes from the latest complete checkpoint of its --save (step 2)
    proc = grpo(setup, crashed, *base, "--train-iters", "4")
    assert f"resuming from {crashed / 'iter_0000002'}" in proc.stderr
    a, b = model_state(straight, 4), model_state(crashed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run diverged from the uninterrupted one"
    # step 3's row, written before the kill, is written once again, not twice
    assert [r["step"] for r in metrics(crashed)] == [1, 2, 3, 4]


def test_resume_resharded_from_tp2_to_tp1_dp2(setup, tmp_path):
    """megatron-core dist_checkpointing: saved at TP=2 x DP=1 after step 2, resumed at TP=1 x DP=2; step 3
    (greedy rollouts, the same prompts) trains from the same weights and AdamW moments as the run that kept
    its layout: the same rollouts, loss and gradient norm within 1e-5 relative, and the weights after it."""
    base = ["--rollout-temperature", "0", "--rollout-dtype", "float32", "--rollout-weight-dtype", "fp32",
            "--advantage-baseline", "batch", "--save-interval", "2", "--train-iters", "3", "--dump-rollouts"]
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    grpo(setup, straight, *base, "--tensor-model-parallel-size", "2", nproc=2)
    proc = grpo(setup, moved, *base, "--tensor-model-parallel-size", "2", nproc=2, check=False,
                env={"MEGATRON_SPEC_FAULTS": "kill_in_save=3", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    assert proc.returncode != 0 and (moved / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    proc = grpo(setup, moved, *base, "--tensor-model-parallel-size", "1", nproc=2)
    assert "saved at TP 2 x DP 1, resharded to TP 1 x DP 2" in proc.stderr
    assert sorted(rollouts(moved, 3)) == sorted(rollouts(straight, 3))
    a, b = metrics(straight)[2], metrics(moved)[2]
    for key in ("loss/pg", "train/grad_norm", "train/entropy"):
        assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
    assert a["train/grad_norm"] > 0
    wa, wb = model_state(straight, 3), model_state(moved, 3)
    assert wa.keys() == wb.keys()
    for k in wa:
        # the vocabulary's padding differs by TP (and its AdamW state)
        if "word_embeddings" in k or "output_layer" in k:
            n = min(wa[k].shape[0], wb[k].shape[0])
            wa[k], wb[k] = wa[k][:n], wb[k][:n]
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k


def test_dead_engine_is_restarted_and_the_step_retried(setup, tmp_path):
    run = tmp_path / "run"
    proc = grpo(
        setup,
        run,
        "--train-iters",
        "3",
        "--spec-draft-kind",
        "eagle3",
        "--spec-draft-path",
        setup.eagle3,
        env={"MEGATRON_SPEC_FAULTS": "engine_exit_at_generate=2", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)},
    )
    assert "restarting it" in proc.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_nan_loss_stops_before_a_checkpoint(setup, tmp_path):
    run = tmp_path / "run"
    proc = grpo(setup, run, "--train-iters", "4", "--save-interval", "1", check=False,
                env={"MEGATRON_SPEC_FAULTS": "nan_loss=2", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert "non-finite GRPO loss" in proc.stderr and "stopping before the optimizer step" in proc.stderr
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (run / "iter_0000002").exists()
    assert [r["step"] for r in metrics(run)] == [1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-prompt-length", "3"], "every prompt is longer than --max-prompt-length 3"),
        (
            ["--reward", "tests.rl.rewards_for_tests:raises"],
            "reward function 'tests.rl.rewards_for_tests:raises' raised",
        ),
        (
            ["--tensor-model-parallel-size", "2"],
            "does not divide num_attention_heads|does not divide num_key_value_heads",
        ),
    ],
)
def test_bad_input_is_named(setup, tmp_path, extra, message):
    nproc = 2 if "--tensor-model-parallel-size" in extra else 1
    if nproc == 2:
        from megatron_spec.models.tiny import make_hf_checkpoint

        odd = make_hf_checkpoint(tmp_path / "odd", family="qwen3", num_attention_heads=3, num_kv_heads=1,
                                 hidden_size=48, head_dim=16)
        setup = type(setup)(odd, setup.cfg, setup.eagle3, setup.draft_model, setup.other_target)
    proc = grpo(setup, tmp_path / "run", "--train-iters", "1", *extra, nproc=nproc, check=False)
    assert proc.returncode != 0
    import re

    assert re.search(message, proc.stderr), proc.stderr[-3000:]


def test_empty_dataset_and_foreign_draft_are_named(setup, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = grpo(setup, tmp_path / "a", "--train-iters", "1", "--prompt-data", str(empty), check=False)
    assert proc.returncode != 0 and "is empty" in proc.stderr
    from megatron_spec.models.tiny import make_hf_checkpoint

    other = make_hf_checkpoint(tmp_path / "wide", family="qwen3", hidden_size=96, num_layers=4,
                               num_attention_heads=4, num_kv_heads=2)
    setup2 = type(setup)(other, setup.cfg, setup.eagle3, setup.draft_model, setup.other_target)
    proc = grpo(setup2, tmp_path / "b", "--train-iters", "1", "--spec-draft-kind", "eagle3",
                "--spec-draft-path", setup.eagle3, check=False)
    assert proc.returncode != 0 and "hidden_size" in proc.stderr


def test_async_policy_lag(setup, tmp_path, lag=1):
    """One rank, one engine; lag 2 and two engines: tests/rl/test_grpo_engines.py (the async resume test)."""
    run = tmp_path / "run"
    grpo(setup, run, "--train-iters", "4", "--async-policy-lag", str(lag), "--spec-draft-kind", "eagle3",
         "--spec-draft-path", setup.eagle3, "--dump-rollouts")
    m = metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    # batch t (0-based) was generated by version max(0, t - lag), every rollout says so
    assert [r["rollout/policy_version"] for r in m] == [max(0, t - lag) for t in range(4)]
    for t in range(4):
        rows = [
            json.loads(x) for x in (run / "rollouts" / f"step_{t + 1:06d}.jsonl").read_text().splitlines()
        ]
        assert {r["policy_version"] for r in rows} == {max(0, t - lag)}
    assert all(r["gen/exposed_s"] <= r["gen/seconds"] + 1e-6 for r in m)


@pytest.mark.parametrize("kind, nproc", [("eagle3", 1), ("mtp", 1), ("mtp", 2)])
def test_online_draft_training_in_the_loop(setup, tmp_path, kind, nproc):
    """Two ranks: the checkpoint's draft export is collective (it once ran on rank 0 alone and
    its barrier met the other rank's checkpoint barrier: the run died in the save)."""
    run = tmp_path / "run"
    extra = ["--spec-draft-path", setup.eagle3] if kind == "eagle3" else []
    grpo(setup, run, "--train-iters", "3", "--spec-draft-kind", kind, "--spec-online-draft-training",
         "--save-interval", "3", *extra, nproc=nproc)
    m = metrics(run)
    assert all(r["draft/loss"] is not None and r["draft/loss"] > 0 for r in m)
    assert all(r["capture/rows"] > 0 and r["sync/bytes"] > 0 for r in m)
    assert [r["draft/step"] for r in m] == [1.0, 2.0, 3.0]
    meta = json.loads((run / "iter_0000003" / "trainer_state.json").read_text())
    # the draft trainer resumes
    assert meta["draft_state"] and (run / "iter_0000003" / "metadata.json").exists()
    # with the policy: its state is a per-rank object of the checkpoint
    assert any((run / "iter_0000003" / "draft").iterdir())  # and its export, in the serving layout
    if kind == "eagle3":
        assert (run / "iter_0000003" / "draft" / "model.safetensors").exists()
    held = "draft/heldout_tau" if kind == "eagle3" else "draft/heldout_ce0"  # the draft before it trains
    assert all(r[held] > 0 for r in m)


def test_held_out_evaluation_first_every_n_and_final(setup, tmp_path):
    """--eval-interval 2 over 3 steps: eval/reward on the rows of steps 1 and 3 (the policies
    that generate them, versions 0 and 2), eval_final/* on the last row (version 3), all on the
    same held-out prompts; the evaluation is not counted in time/step; an async run refuses it."""
    run = tmp_path / "run"
    grpo(setup, run, "--train-iters", "3", "--eval-interval", "2", "--eval-prompts", "6")
    m = metrics(run)
    assert [r["step"] for r in m if r.get("eval/reward") is not None] == [1, 3]
    assert [r["eval/policy_version"] for r in m if r.get("eval/reward") is not None] == [0, 2]
    assert m[-1]["eval_final/policy_version"] == 3 and m[-1]["eval_final/prompts"] == 6
    for r in m:
        for key in ("eval/reward", "eval_final/reward"):
            if r.get(key) is not None:
                assert 0.0 <= r[key] <= 1.0
        assert r["time/step"] > 0 and r.get("time/eval", 0.0) >= 0.0
    proc = grpo(
        setup,
        tmp_path / "bad",
        "--train-iters",
        "1",
        "--eval-interval",
        "1",
        "--async-policy-lag",
        "1",
        check=False,
    )
    assert proc.returncode != 0 and "--eval-interval needs a synchronous run" in proc.stderr
