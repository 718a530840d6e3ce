"""A script of ``benchmarks/`` loaded as a module, for the tests of its pure helpers (the benchmarks are
scripts, not a package)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a fresh module (its own name ``<name>_for_test``)."""
    spec = importlib.util.spec_from_file_location(f"{name}_for_test", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
