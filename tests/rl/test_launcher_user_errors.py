"""The launcher's user errors: one ``error:`` line and exit 2, found before torch.distributed starts.

``rl/preflight.check_inputs`` is tested directly on small checkpoints; the launcher is run as a
user runs it (plain python, ``--nproc-per-node``, and under torchrun) for the four errors a
newcomer met: a missing ``--hf-checkpoint`` directory, a draft for another model,
``--eval-interval`` with a file prompt set and no ``--eval-data``, a missing ``--config`` file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spec.config import ConfigError, RunConfig
from megatron_spec.models.tiny import make_hf_checkpoint
from megatron_spec.rl.preflight import check_inputs, openmp_wait_policy
from tests.dist_utils import free_port
from tests.sync.conftest import random_eagle3

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch" / "pretrain_grpo_spec.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_spec.draft.modelopt_io import save_eagle3
    from megatron_spec.models.hf_config import DecoderConfig

    root = tmp_path_factory.mktemp("launcher_errors")
    small = dict(
        family="qwen3", num_layers=2, intermediate_size=64, num_attention_heads=2, num_kv_heads=1, seed=3
    )
    target = make_hf_checkpoint(root / "target", hidden_size=32, **small)
    other = make_hf_checkpoint(root / "other", hidden_size=48, **small)
    save_eagle3(random_eagle3(DecoderConfig.from_pretrained(other), 5), root / "eagle3_other")
    save_eagle3(random_eagle3(DecoderConfig.from_pretrained(target), 5), root / "eagle3_target")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    return {"target": target, "eagle3_other": str(root / "eagle3_other"),
            "eagle3_target": str(root / "eagle3_target"), "prompts": str(prompts)}


def _cfg(models, **changes) -> RunConfig:
    cfg = RunConfig()
    cfg.model.hf_checkpoint = models["target"]
    cfg.data.prompt_data = "synthetic:sum"
    for key, value in changes.items():
        group, name = key.split("__")
        setattr(getattr(cfg, group), name, value)
    return cfg.validate()


def test_good_inputs_pass(models):
    eagle3 = {"draft__spec_draft_kind": "eagle3", "draft__spec_draft_path": models["eagle3_target"]}
    check_inputs(_cfg(models, **eagle3))


@pytest.mark.parametrize("changes, world, message", [
    ({"model__hf_checkpoint": "/nonexistent"}, 1, "--hf-checkpoint /nonexistent: no such directory"),
    ({"draft__spec_draft_kind": "eagle3", "draft__spec_draft_path": "OTHER"}, 1,
     "draft hidden_size 48 != target hidden_size 32"),
    ({"draft__spec_draft_kind": "eagle3", "draft__spec_draft_path": "/nonexistent"}, 1,
     "--spec-draft-path /nonexistent: no such directory"),
    ({"data__prompt_data": "/nonexistent.jsonl"}, 1, "--prompt-data /nonexistent.jsonl: no such file"),
    ({"data__prompt_data": "synthetic:nope"}, 1, "unknown synthetic task"),
    ({"data__reward": "no_such_module:fn"}, 1, "--reward: reward 'no_such_module:fn' cannot be imported"),
    ({"model__tensor_model_parallel_size": 2}, 3, "does not divide the world size 3"),
    ({"model__tensor_model_parallel_size": 2}, 2, "does not divide num_key_value_heads 1"),
])
def test_bad_inputs_are_named(models, changes, world, message):
    changes = {k: models["eagle3_other"] if v == "OTHER" else v for k, v in changes.items()}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_inputs(_cfg(models, **changes), world)


def test_tv_weight_is_checked_where_the_flags_are(models):
    """--spec-draft-tv-weight: refused negative or NaN, and without the online EAGLE-3 training it weights."""
    online = {"draft__spec_draft_kind": "eagle3", "draft__spec_draft_path": models["eagle3_target"],
              "draft__spec_online_draft_training": True}
    assert _cfg(models, draft__spec_draft_tv_weight=5.0, **online).draft.spec_draft_tv_weight == 5.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--spec-draft-tv-weight .* must be >= 0 and finite"):
            _cfg(models, draft__spec_draft_tv_weight=bad, **online)
    with pytest.raises(ConfigError, match="needs --spec-draft-kind eagle3 and --spec-online-draft-training"):
        _cfg(models, draft__spec_draft_tv_weight=5.0, draft__spec_draft_kind="eagle3",
             draft__spec_draft_path=models["eagle3_target"])


# the four errors a newcomer met: the flags, and the one line each must print
FOUR_ERRORS = {
    "missing checkpoint": (
        ["--hf-checkpoint", "/nonexistent"],
        "error: --hf-checkpoint /nonexistent: no such directory (an HF checkpoint directory)",
    ),
    "draft for another model": (
        ["--spec-draft-kind", "eagle3", "--spec-draft-path", "EAGLE3_OTHER"],
        "error: --spec-draft-path (eagle3): draft hidden_size 48 != target hidden_size 32",
    ),
    "eval without eval data": (
        ["--prompt-data", "PROMPTS", "--eval-interval", "1"],
        "error: --eval-interval with a file prompt set needs --eval-data (held-out prompts)",
    ),
    "missing config": (["--config", "/nonexistent.yaml"], "error: --config /nonexistent.yaml: no such file"),
}


def _launch(models, tmp_path, extra, runner):
    extra = [{"EAGLE3_OTHER": models["eagle3_other"], "PROMPTS": models["prompts"]}.get(a, a) for a in extra]
    args = [str(LAUNCH), "--hf-checkpoint", models["target"], "--prompt-data", "synthetic:sum",
            "--save", str(tmp_path / "run"), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, *runner(args)], capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT)
    )


@pytest.mark.parametrize("name", list(FOUR_ERRORS))
def test_user_error_is_one_line_and_exit_2(models, tmp_path, name):
    extra, line = FOUR_ERRORS[name]
    proc = _launch(models, tmp_path, extra, lambda args: args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"pretrain_grpo_spec.py: {line}")
    assert proc.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.dist
def test_nproc_per_node_checks_once_then_starts_the_workers(models, tmp_path):
    extra, line = FOUR_ERRORS["draft for another model"]
    proc = _launch(models, tmp_path, ["--nproc-per-node", "2", *extra], lambda args: args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"pretrain_grpo_spec.py: {line}")
    # an error only the workers find (a reward module that fails to import there): still one line, 2
    (tmp_path / "worker_only_reward.py").write_text(
        "import os\nif 'LOCAL_RANK' in os.environ:\n    raise ValueError('only in workers')\n"
        "def fn(prompt, response, answer):\n    return 0.0\n")
    env_path = f"{ROOT}{os.pathsep}{tmp_path}"
    cmd = [
        sys.executable,
        str(LAUNCH),
        "--nproc-per-node",
        "2",
        "--hf-checkpoint",
        models["target"],
        "--prompt-data",
        "synthetic:sum",
        "--reward",
        "worker_only_reward:fn",
        "--save",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
        env={
            k: v
            for k, v in dict(os.environ, PYTHONPATH=env_path, OMP_NUM_THREADS="1").items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        },
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["pretrain_grpo_spec.py: error: --reward: only in workers"]


@pytest.mark.dist
def test_under_torchrun_the_error_line_comes_first_and_no_rank_traceback(models, tmp_path):
    extra, line = FOUR_ERRORS["missing checkpoint"]
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}"]
    proc = _launch(models, tmp_path, extra, lambda args: [*torchrun, *args])
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert lines[0] == f"pretrain_grpo_spec.py: {line}" and proc.stderr.count("error: --hf-checkpoint") == 1
    # what remains is torchrun's own report of a worker that exited 2, no worker traceback
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr and "exitcode  : 2" in proc.stderr


@pytest.mark.parametrize("backend", [None, "sglang"])
def test_sglang_missing_on_a_gpu_is_one_line_naming_the_native_backend(models, monkeypatch, backend):
    """Issue 27, defect 7: on a GPU the rollout backend defaults to SGLang; where sglang does not import
    (the lent GPU machines have no sglang), the launcher says so and names --rollout-backend native.
    The GPU is simulated by torch.cuda.is_available; a None entry in sys.modules makes ``import sglang``
    raise ImportError as a missing package does."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ConfigError) as info:
        check_inputs(_cfg(models, rollout__rollout_backend=backend))
    message = str(info.value)
    assert (
        "\n" not in message and "--rollout-backend native" in message and "sglang does not import" in message
    )
    assert ("defaults to sglang on a GPU" in message) == (backend is None)
    check_inputs(_cfg(models, rollout__rollout_backend="native"))  # the way out works


def test_openmp_waits_passively_only_where_generation_overlaps_training():
    """docs/benchmark_log.md, "OpenMP's wait policy": the demo loop ran 6.0-6.5 s a step asynchronous with
    spinning OpenMP threads, 3.3-3.8 s with sleeping ones; synchronous runs keep the default."""
    cfg = RunConfig()
    assert openmp_wait_policy(cfg, {}) is None  # synchronous
    cfg.rollout.async_policy_lag = 1
    assert openmp_wait_policy(cfg, {}) == "PASSIVE"  # the backend's default: native on a CPU
    cfg.rollout.rollout_backend = "native"
    assert openmp_wait_policy(cfg, {}) == "PASSIVE"
    assert openmp_wait_policy(cfg, {"OMP_WAIT_POLICY": "ACTIVE"}) is None  # the user's choice stands
    cfg.rollout.rollout_backend = "sglang"
    assert openmp_wait_policy(cfg, {}) is None


def test_a_folder_a_live_run_holds_is_refused_in_one_line(models, tmp_path):
    """A run whose launcher was killed alone leaves its workers training into --save; a second run started
    there would write into the same checkpoints: refused while the first holds the folder's lock, in one
    line."""
    from megatron_spec.rl.checkpoint import check_run_folder_free, hold_run_folder

    run = tmp_path / "run"
    check_run_folder_free(str(run))  # no folder, no lock file: free
    fd = hold_run_folder(str(run))  # the live run's rank 0
    try:
        with pytest.raises(
            ConfigError, match=rf"--save {run} is in use by a live run \(pid {os.getpid()} on "
        ):
            check_run_folder_free(str(run))
        with pytest.raises(ConfigError, match="in use by a live run"):
            hold_run_folder(str(run), wait_s=0.2)
        proc = _launch(models, tmp_path, [], lambda args: args)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
        assert proc.stderr.startswith(
            f"pretrain_grpo_spec.py: error: --save {run} is in use by a live run (pid "
        )
    finally:
        os.close(fd)
    check_run_folder_free(str(run))  # that run ended: the folder is free again
    os.close(hold_run_folder(str(run), wait_s=0.2))
