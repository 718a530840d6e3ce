"""GRPO with vLLM in the loop (``--rollout-backend vllm``, vLLM's CPU build) on the real model, SmolLM2:
EAGLE-3 trained online, greedy, its engine SIGKILLed half a second into the second step's generation.
The run must survive with every rollout (the engine restarted, re-fed, its prompts generated again), every
step's weights acknowledged and verified (the streamer checks version and fingerprint after each sync, or
the run fails), acceptance read from vLLM's own counters, and, greedy from the same weights, the
very rollouts the native engine produces at every step: the same weights in both engines give the same
greedy tokens, step after step, as training changes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.dist, pytest.mark.slow]
STEPS, PROMPTS, GROUP = 3, 3, 2


def grpo(
    model: str,
    draft: str | None,
    run_dir: Path,
    backend: str,
    env: dict | None = None,
    extra: tuple = (),
    steps: int = STEPS,
    ok: bool = True,
):
    """The run's metrics rows (``ok``), else its failed process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "launch" / "pretrain_grpo_spec.py"),
           "--hf-checkpoint", model, "--prompt-data", "synthetic:sum", "--apply-chat-template",
           "--reward", "tests.rl.rewards_for_tests:digit_share", "--make-vocab-size-divisible-by", "8",
           "--prompts-per-step", str(PROMPTS), "--grpo-group-size", str(GROUP), "--micro-batch-size", "6",
           "--rollout-max-new-tokens", "12", "--rollout-max-batch-size", "8", "--rollout-temperature", "0",
           "--rollout-dtype", "float32", "--rollout-weight-dtype", "fp32", "--advantage-baseline", "batch",
           "--lr", "1e-5", "--train-iters", str(steps), "--rollout-backend", backend,
           "--dump-rollouts", "--save", str(run_dir), "--quiet", "--tensorboard-dir", "none", *extra]
    if draft is not None:
        cmd += ["--spec-draft-kind", "eagle3", "--spec-draft-path", draft, "--spec-num-draft-tokens", "3",
                "--spec-online-draft-training"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    if not ok:
        assert proc.returncode != 0, proc.stderr[-3000:]
        return proc
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollouts(run_dir: Path, step: int) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return [(tuple(r["prompt_ids"]), tuple(r["response_ids"])) for r in rows]


def test_grpo_with_vllm_survives_a_kill_falls_back_and_matches_the_native_engine(
    smollm2, smollm2_eagle3, tmp_path
):
    """One vLLM run through two faults. vLLM is killed in step 2's rollouts and restarted (nothing lost). The
    online draft's first update is corrupted (``corrupt_draft=1``): step 2 drafts garbage, the acceptance
    watchdog (window 1) falls back, and since vLLM fixes its speculative method at start-up the fallback
    rebuilds it, which drops its weights: the rollout manager streams the policy again, and step 3 decodes
    without drafts from them. Every step vLLM's greedy tokens equal the native engine's holding the same
    weights (the reference check), and the rollouts equal a native run's token for token."""
    faults = tmp_path / "faults"
    faults.mkdir()
    # generate calls: step 1's reference probe, step 1's rollouts, step 2's probe, step 2's rollouts (killed)
    got = grpo(smollm2, smollm2_eagle3, tmp_path / "vllm", "vllm",
               extra=("--rollout-reference-check", "--spec-watchdog-steps", "1", "--spec-watchdog-fallback"),
               env={"MEGATRON_SPEC_FAULTS": "engine_kill_in_generate=4,corrupt_draft=1",
                    "MEGATRON_SPEC_FAULTS_DIR": str(faults)})
    assert (faults / "fired-engine_kill_in_generate").exists() and (faults / "fired-corrupt_draft").exists()
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert got[-1]["rollout/engine_restarts"] == 1
    # each step from the newest policy
    assert [m["rollout/policy_version"] for m in got] == list(range(STEPS))
    assert "fallback" in [m["spec/watchdog"] for m in got[:2]]
    assert got[-1]["spec/num_draft_tokens"] == 0 and got[-1]["spec/accept_length"] == 1.0, got[-1]
    # in the run: vLLM's greedy tokens equal the native engine's holding the same weights, every step
    assert [m["health/reference_equal"] for m in got] == [1.0] * STEPS
    assert all(m["health/reference_tokens"] > 0 for m in got)
    assert all(m["spec/accept_length"] >= 1.0 for m in got)  # vLLM's counters, every step
    ref = grpo(smollm2, smollm2_eagle3, tmp_path / "native", "native")
    for step in range(1, STEPS + 1):
        mine = rollouts(tmp_path / "vllm", step)
        assert len(mine) == PROMPTS * GROUP  # nothing lost to the kill
        assert mine == rollouts(tmp_path / "native", step), f"step {step}"
    assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in ref]


def test_the_reference_check_stops_a_run_whose_engine_ignores_its_weights(smollm2, tmp_path):
    """vLLM starts from dummy weights and gets ours streamed; with its tied LM head left stale (the defect
    ``vllm_worker.tied_layers`` works around, put back by a test hook) every fingerprint still matches what
    was sent, and only the reference check sees that the engine does not compute with it."""
    proc = grpo(smollm2, None, tmp_path / "stale", "vllm", steps=1, ok=False,
                extra=("--rollout-reference-check", "--rollout-reference-prompts", "2"),
                env={"MEGATRON_SPEC_TEST_HOOKS": "vllm_stale_tied_head"})
    err = proc.stderr
    assert "--rollout-reference-check: 2 of 2 greedy probe prompts differ" in err, err[-3000:]
    assert "position " in err and "the reference wrote" not in err and ", the reference " in err
