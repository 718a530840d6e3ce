"""The shape the codebase keeps (issue 29): no library file over 500 lines, the GRPO recipe under 200."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_library_file_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): lines(p) for p in (ROOT / "megatron_spec").rglob("*.py") if lines(p) > 500
    }
    assert long == {}


def test_the_grpo_recipe_reads_in_under_200_lines():
    assert lines(ROOT / "megatron_spec" / "rl" / "trainer.py") < 200
