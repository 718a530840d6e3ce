"""Import direction between packages, read from the source with ``ast`` (imports inside
functions count too): the shared layers stand on nothing above them, and the drafters stand on
the layers, never on the rollout engine (the engine imports the drafters, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # holds megatron_spec/


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module ``path`` (a file under ``root``) imports, relative imports resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names.add(".".join(p for p in (base, node.module) if p))
    return names


def imports_of(subpackage: str, prefix: str) -> list[str]:
    """``file: module`` for every import of ``prefix`` (or below it) in ``megatron_spec/<subpackage>``."""
    found = []
    for path in sorted((ROOT / "megatron_spec" / subpackage).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if name == prefix or name.startswith(prefix + "."):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    return found


def test_imported_modules_reads_relative_and_function_level_imports(tmp_path):
    src = tmp_path / "megatron_spec" / "draft" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("import torch\nfrom . import rope\nfrom ..rollout.native import model\n"
                   "def f():\n    from megatron_spec.layers.linear import Linear\n")
    assert imported_modules(src, tmp_path) == {"torch", "megatron_spec.draft", "megatron_spec.rollout.native",
                                               "megatron_spec.layers.linear"}


def test_draft_does_not_import_the_rollout_engine():
    assert imports_of("draft", "megatron_spec.rollout") == []


def test_layers_import_only_the_model_config():
    inside = imports_of("layers", "megatron_spec")
    allowed = ("megatron_spec.layers", "megatron_spec.models", "megatron_spec._ext")  # _ext: the kernels' loader
    assert [v for v in inside if not v.split(": ")[1].startswith(allowed)] == []
    assert inside, "expected the layers to import each other (is ROOT right?)"
