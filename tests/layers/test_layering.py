"""Import direction, read from the source with ``ast`` (imports inside functions count too; those under
``if TYPE_CHECKING:`` never run and only name types for annotations, so they do not): every import of the
package runs from a higher layer of :data:`LAYERS` to a lower one or within a unit (issue 56), no files import
each other in a circle, the shared layers stand on nothing above them, and the drafters stand on the layers,
never on the rollout engine (the engine imports the drafters, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # holds megatron_spec/


PKG = ROOT / "megatron_spec"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "__init__",
        "exit",
        "host_memory",
        "dtypes",
        "faults",
        "isa",
        "telemetry",
        "config_values",
        "interfaces",
        "compat",
        "sim",
    ),
    ("_ext", "models", "parallel", "train"),
    ("layers", "ops"),
    ("speculative", "capture"),
    ("draft", "sync"),
    ("rollout",),
    ("config",),
    ("rl",),
    ("commands", "cli", "__main__"),
)
"""The package's units (top-level modules and subpackages), bottom first: a unit may import its own layer's
units and those below, never one above."""


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (
            getattr(test, "id", None),
            getattr(test, "attr", None),
        ):
            out.update(id(n) for n in ast.walk(node))
    return out


def is_module(name: str, root: Path = ROOT) -> bool:
    rel = root / Path(*name.split("."))
    return rel.is_dir() or rel.with_suffix(".py").is_file()


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module ``path`` (a file under ``root``) imports at run time, relative imports
    resolved; ``from package import name`` counts ``package.name`` too where that is a module."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _typing_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names if is_module(f"{module}.{a.name}", root))
    return names


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def unit_of(module: str) -> str | None:
    """The unit of a ``megatron_spec...`` module (None: not this package's, or the compiled ``_C``)."""
    parts = module.split(".")
    if parts[0] != "megatron_spec":
        return None
    if len(parts) == 1 or is_module(f"megatron_spec.{parts[1]}"):
        return "__init__" if len(parts) == 1 else parts[1]
    return "__init__" if parts[1].startswith("__") else None  # a name of the package itself (__version__)


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
    src.write_text(
        src.read_text()
        + "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_spec.rl import x\n"
    )
    (src.parent / "rope.py").write_text("")
    assert imported_modules(src, tmp_path) == {
        "torch",
        "typing",
        "megatron_spec.draft",
        "megatron_spec.draft.rope",
        "megatron_spec.rollout.native",
        "megatron_spec.layers.linear",
    }


def test_draft_does_not_import_the_rollout_engine():
    assert imports_of("draft", "megatron_spec.rollout") == []


def test_layers_import_only_the_model_config():
    inside = imports_of("layers", "megatron_spec")
    # _ext: the kernels' loader; host_memory: the huge-page memory the panels move to (layers.panel_memory)
    allowed = ("megatron_spec.layers", "megatron_spec.models", "megatron_spec._ext",
               "megatron_spec.host_memory")
    assert [v for v in inside if not v.split(": ")[1].startswith(allowed)] == []
    assert inside, "expected the layers to import each other (is ROOT right?)"


def test_every_unit_has_a_layer():
    units = {unit_of(module_of(f)) for f in sorted(PKG.rglob("*.py"))}
    placed = {u for layer in LAYERS for u in layer}
    assert units - placed == set(), "units missing from LAYERS"
    assert placed - units == set(), "LAYERS names units that do not exist"


def test_no_import_runs_up_a_layer():
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward = []
    for f in sorted(PKG.rglob("*.py")):
        src = unit_of(module_of(f))
        for module in sorted(imported_modules(f)):
            dst = unit_of(module)
            if dst is not None and rank[dst] > rank[src]:
                upward.append(
                    f"{f.relative_to(ROOT)} ({src}, layer {rank[src]}) imports {module} ({dst}, layer "
                    f"{rank[dst]})"
                )
    assert upward == []


def test_no_files_import_each_other_in_a_circle():
    graph: dict[str, set[str]] = {}
    for f in sorted(PKG.rglob("*.py")):
        mod = module_of(f)
        graph[mod] = {
            m for m in imported_modules(f) if m != mod and m.startswith("megatron_spec.") and is_module(m)
        }
    # a package's __init__ importing its own submodules is how a package hands names on, not a circle
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not d.startswith(mod + ".")}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == []
