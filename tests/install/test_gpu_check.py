"""The GPU check kit's dry run (issue 27): every step of ``scripts/gpu_check.sh`` runs here, on the CPU,
so the kit cannot rot between the sessions that are lent a GPU.

The kit folder is prepared as ``--prepare`` prepares it (megatron-core's cp312 wheels from PyPI, an MTP
export), with the session's test models copied in instead of trained again; it must stay under 20 MB.
The dry run must pass every step and write what a GPU run writes: ``summary.json`` with each step's
status and time, the forward costs ``megatron-spec simulate`` reads, and the logs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def kit(setup, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_kit")
    models = root / "models"
    models.mkdir()
    names = {"target": setup.target, "eagle3": setup.eagle3, "draft_model": setup.draft_model,
             "other_target": setup.other_target}
    for name, path in names.items():
        shutil.copytree(path, models / name)
    (models / "setup.json").write_text(json.dumps({n: n for n in names}))
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "prepare", "--kit", str(root)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return root


def test_prepared_kit_is_small_and_complete(kit):
    wheels = sorted(p.name for p in (kit / "wheels").glob("*.whl"))
    assert [w.split("-")[1] for w in wheels] == ["0.16.1", "0.19.2"] and all("cp312" in w for w in wheels)
    assert (kit / "models" / "mtp" / "config.json").is_file()
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    assert size < 20 << 20, f"the kit is {size / 2**20:.1f} MiB"


@pytest.mark.slow
def test_dry_run_passes_every_step(kit, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(KIT), "--dry-run", "--kit", str(kit), "--out", str(out),
                           "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=env)
    summary = json.loads((out / "summary.json").read_text())
    failed = {s["step"]: s.get("tail", s.get("why")) for s in summary["steps"] if s["status"] != "passed"}
    assert proc.returncode == 0 and not failed, f"{failed}\n{proc.stdout[-3000:]}"
    assert [s["step"] for s in summary["steps"]] == [
        "env",
        "install",
        "build",
        "ops",
        "forward_costs",
        "smoke",
        "grpo_fp8",
        "grpo_bf16_mtp",
    ]
    assert summary["dry_run"] is True
    costs = json.loads((out / "forward_costs.json").read_text())
    assert {e["model"] for e in costs["entries"]} == {"llama-3.2-1b", "qwen3-8b"}
    assert all(e["verify_s"]["1"]["2"] > 0 for e in costs["entries"])
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/smoke.log" in names and "logs/grpo_fp8_metrics.jsonl" in names
    assert len(list(out.iterdir())) <= 8  # the device tool brings back at most 8 files
