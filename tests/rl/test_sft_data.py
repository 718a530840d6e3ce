"""launch/sft_base.py on a prompt set (--data): trains on the answer column, scores the held-out
set with the named reward, and refuses half-given data flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sft_base_trains_on_a_jsonl_prompt_set(tmp_path):
    rows = [
        {"question": f"What is the units digit of {n}?", "answer": str(n % 10)} for n in range(1000, 1064)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [sys.executable, str(ROOT / "launch" / "sft_base.py"), "--out", str(tmp_path / "out"),
            "--prompt-key", "question", "--reward", "math", "--max-new-tokens", "4", "--steps", "3",
            "--batch-size", "8", "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "1",
            "--num-attention-heads", "2", "--num-kv-heads", "1", "--eval-prompts", "16"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        base + ["--data", str(data), "--eval-data", str(data)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and 0.0 <= summary["greedy_accuracy"] <= 1.0
    assert (tmp_path / "out" / "config.json").is_file()
    proc = subprocess.run(base + ["--data", str(data)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(ROOT))
    assert proc.returncode != 0 and "--data and --eval-data go together" in proc.stderr
