"""Where a run goes and what it does with a used folder (``rl/checkpoint.py``): a folder with a complete
checkpoint resumes, one holding a run without one is refused in one line unless ``--no-resume`` starts over,
``--save-keep N`` keeps the newest N, and a resumed run's metrics drop the rows it will write again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spec.config import ConfigError
from megatron_spec.rl.checkpoint import LATEST, clear_run, plan_resume, prune
from megatron_spec.telemetry import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> None:
    it = root / f"iter_{step:07d}"
    it.mkdir(parents=True)
    (it / "rank_00000.pt").write_bytes(b"x")
    if complete:
        (it / "COMPLETE").write_text("ok\n")
        (root / LATEST).write_text(f"{step}\n")


def test_plan_resume(tmp_path):
    run = tmp_path / "run"
    assert plan_resume(str(run), None, True) == (None, False)  # a new folder
    assert plan_resume(str(run), "elsewhere", True) == ("elsewhere", False)  # --load as given
    run.mkdir()
    assert plan_resume(str(run), None, True) == (None, False)  # an empty folder
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(
        ConfigError,
        match=r"holds a run with no complete checkpoint to resume \(metrics.jsonl\); "
        r"--no-resume starts over",
    ):
        plan_resume(str(run), None, True)
    fake_checkpoint(run, 3, complete=False)  # a save that was killed
    with pytest.raises(ConfigError, match=r"metrics.jsonl, iter_0000003"):
        plan_resume(str(run), None, True)
    fake_checkpoint(run, 2)
    assert plan_resume(str(run), None, True) == (str(run), False)
    assert plan_resume(str(run), None, False) == (None, True)


def test_no_resume_clears_only_the_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    fake_checkpoint(run, 2)
    for name in ("metrics.jsonl", "config.yaml"):
        (run / name).write_text("x")
    for name in ("tensorboard", "hf", "draft_export"):
        (run / name).mkdir()
    (run / "notes.txt").write_text("mine")
    clear_run(str(run))
    assert sorted(os.listdir(run)) == ["notes.txt"]


def test_save_keep(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 5, complete=False)
    assert prune(str(tmp_path), 0) == []
    assert prune(str(tmp_path), 2) == ["iter_0000001", "iter_0000002"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000004",
        "iter_0000005",
    ]


def test_a_resumed_run_drops_the_rows_it_writes_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    w = MetricsWriter(str(path), resume_step=2)
    w.write({"step": 3, "x": 30})
    w.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "x": 1},
        {"step": 2, "x": 2},
        {"step": 3, "x": 30},
    ]


def test_the_launcher_refuses_a_used_folder_in_one_line(tmp_path):
    from megatron_spec.models.tiny import make_hf_checkpoint

    model = make_hf_checkpoint(tmp_path / "model", family="qwen3")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain_grpo_spec.py"), "--hf-checkpoint",
                           str(model), "--prompt-data", "synthetic:sum", "--save", str(run)],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"error: --save {run} holds a run with no complete checkpoint" in proc.stderr


def test_step_line_eta_and_logging(capsys):
    """The step line ends with the remaining steps' time at the run's pace, until the last step; the package's
    log lines reach stderr with the product's prefix (the launcher configures them)."""
    import logging

    from megatron_spec.telemetry import configure_logging, format_duration, progress_line

    m = {"step": 3, "reward/mean": 0.5, "spec/accept_length": 2.0, "time/step": 1.0}
    assert progress_line(m, 10, 7 * 65.0).endswith("| eta 7m35s")
    assert "eta" not in progress_line(dict(m, step=10), 10, 0.0) and "eta" not in progress_line(m, 10)
    assert [format_duration(x) for x in (4.4, 61, 7322)] == ["4s", "1m01s", "2h02m"]
    log = logging.getLogger("megatron_spec")
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        configure_logging(0)
        configure_logging(0)  # once
        logging.getLogger("megatron_spec.rl.trainer").info("resumed from here")
        assert capsys.readouterr().err == "megatron-spec: resumed from here\n"
    finally:
        log.handlers[:], log.level, log.propagate = saved


def test_wandb_logger_offline(tmp_path):
    """``--logger jsonl,wandb``: W&B (offline, no network) gets every numeric metric by step, in the run
    folder, under an id fixed by the run folder (the same command started again continues the same W&B
    run). Each start is its own process, as a resumed run is: two W&B runs of one id in one process share
    W&B's service stream, and the second can start before the first's has closed its file."""
    run = tmp_path / "run"
    run.mkdir()
    script = (
        "import sys\n"
        "from megatron_spec.config import RunConfig\n"
        "from megatron_spec.telemetry import open_metrics\n"
        "cfg = RunConfig()\n"
        "cfg.logging.logger = 'jsonl,wandb'\n"
        "cfg.logging.wandb_project = 'bar'\n"
        "start = None if sys.argv[2] == 'none' else int(sys.argv[2])\n"
        "w = open_metrics(cfg, sys.argv[1], start)\n"
        "print(w._wandb.id)\n"
        "row = {'reward/mean': 0.25, 'spec/accept_length': 2.5, 'note': 'x'}\n"
        "w.write({'step': 1 if start is None else 2, **row})\n"
        "w.close()\n"
    )
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    ids = []
    for start in ("none", "1"):
        proc = subprocess.run([sys.executable, "-c", script, str(run), start], env=env, cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids.append(proc.stdout.split()[-1])
    assert ids[0] == ids[1] and not (run / "tensorboard").exists()
    logs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(
        b"reward/mean" in p.read_bytes() and b"spec/accept_length" in p.read_bytes() for p in logs
    )
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
