"""The public math task (scripts/make_math_task.sh): DeepMind's mathematics_dataset generated in
its own environment, read as JSONL by the trainer's loader and scored by the math reward.

Needs ``.venv-mathds`` (made by scripts/make_math_task.sh or scripts/demo_math.sh, which install
from PyPI): skipped where it is missing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_spec.rl.data import load_prompts
from megatron_spec.rl.rewards import get_reward

ROOT = Path(__file__).resolve().parents[2]
MATHDS_PYTHON = ROOT / ".venv-mathds" / "bin" / "python"
MODULES = ["numbers__place_value", "arithmetic__add_or_sub", "numbers__gcd", "algebra__linear_1d",
           "numbers__round_number", "comparison__pair"]

pytestmark = pytest.mark.skipif(not MATHDS_PYTHON.exists(),
                                reason=".venv-mathds missing (scripts/make_math_task.sh creates it)")


def generate(out: Path, seed: int = 0) -> None:
    subprocess.run([str(MATHDS_PYTHON), str(ROOT / "scripts" / "mathds_generate.py"), "--out", str(out),
                    "--modules", ",".join(MODULES), "--splits", "train-easy,interpolate,extrapolate",
                    "--num-train", "40", "--num-test", "20", "--seed", str(seed)],
                   check=True, capture_output=True, text=True, timeout=300)


def test_generated_splits_load_and_the_math_reward_reads_their_answers(tmp_path):
    generate(tmp_path / "a")
    math = get_reward("math")
    for module in MODULES:
        for split, n in (("train-easy", 40), ("interpolate", 20)):
            path = tmp_path / "a" / module / f"{split}.jsonl"
            rows = load_prompts(
                str(path), prompt_key="question", answer_key="answer", cache_dir=str(tmp_path)
            )
            assert len(rows) == n and all(r.prompt and r.answer for r in rows)
            # every reference answer is rewarded as itself, and another problem's differing answer is not
            assert all(math(r.prompt, r.answer, r.answer) == 1.0 for r in rows), (module, split)
            others = [(r, o) for r, o in zip(rows, rows[1:]) if r.answer != o.answer]
            assert others and all(math(r.prompt, o.answer, r.answer) == 0.0 for r, o in others), (
                module,
                split,
            )
    # the harder variant sits under the module's own folder where the generator has one
    big = [json.loads(x) for x in (tmp_path / "a" / "numbers__place_value" / "extrapolate.jsonl").open()]
    assert {r["module"] for r in big} == {"numbers__place_value_big"} and len(big) == 20
    assert not (tmp_path / "a" / "numbers__gcd" / "extrapolate.jsonl").exists()


def test_generation_is_seeded_per_module_and_split(tmp_path):
    generate(tmp_path / "a", seed=0)
    generate(tmp_path / "b", seed=0)
    generate(tmp_path / "c", seed=1)
    f = "numbers__gcd/interpolate.jsonl"
    assert (tmp_path / "a" / f).read_text() == (tmp_path / "b" / f).read_text()
    assert (tmp_path / "a" / f).read_text() != (tmp_path / "c" / f).read_text()
    train = (tmp_path / "a" / "numbers__gcd" / "train-easy.jsonl").read_text().splitlines()
    test = (tmp_path / "a" / f).read_text().splitlines()
    assert not {json.loads(x)["question"] for x in train} & {json.loads(x)["question"] for x in test}
