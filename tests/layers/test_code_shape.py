"""The shape the codebase keeps: no library file over 400 lines, no library function over 80 (counted by
the AST, docstring included: a joined line does not pass a long function), the GRPO recipe under 200."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted((ROOT / "megatron_spec").rglob("*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def function_lengths(path: Path) -> dict[str, int]:
    """``{qualified name: lines}`` of every function and method in ``path``, nested ones included."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return out


def test_no_library_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): lines(p) for p in LIBRARY if lines(p) > MAX_FILE_LINES}
    assert long == {}


def test_no_library_function_over_80_lines():
    long = {
        f"{p.relative_to(ROOT)}:{name}": n
        for p in LIBRARY
        for name, n in function_lengths(p).items()
        if n > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_function_lengths_are_counted_by_the_ast(tmp_path):
    # a 3-line function joined onto one line with semicolons is still 1 line; a nested def counts inside
    # its parent and on its own; a method is named by its class
    src = tmp_path / "m.py"
    src.write_text(
        'def f():\n    """Doc."""\n    return 1\n\n\nclass C:\n    def g(self):\n'
        "        def h():\n            pass\n\n        return h\n"
    )
    assert function_lengths(src) == {"f": 3, "C.g": 5, "C.g.h": 2}


def test_the_grpo_recipe_reads_in_under_200_lines():
    assert lines(ROOT / "megatron_spec" / "rl" / "trainer.py") < 200
