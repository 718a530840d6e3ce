"""Which compiled CPU kernel variant runs (csrc/cpu/kernels.h): the highest this CPU runs, capped at
AVX2 by MEGATRON_SPEC_NO_NATIVE_BF16 and by ATEN_CPU_CAPABILITY, and switchable for tests.

Each variant's results are compared with the references in test_ops_fp8.py / test_ops_verify.py
(the ``kernel_variant`` fixture); this file checks the choice itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_spec import _ext

ORDER = ["default", "avx2", "avx512"]

requires_ext = pytest.mark.skipif(not _ext.compiled_ops_available(),
                                  reason="megatron_spec._C not built or MEGATRON_SPEC_FORCE_REFERENCE=1")


def kernel_isa_in_child(**env: str) -> str:
    """kernel_isa() of a fresh interpreter with the caps cleared and ``env`` set."""
    child = {k: v for k, v in os.environ.items()
             if k not in ("MEGATRON_SPEC_NO_NATIVE_BF16", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    child.update(env)
    out = subprocess.run([sys.executable, "-c", "from megatron_spec import _ext; print(_ext.kernel_isa())"],
                         env=child, capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]


@requires_ext
def test_best_variant_unless_capped():
    best = _ext.supported_kernel_isas()[-1]
    assert _ext.supported_kernel_isas() == ORDER[: ORDER.index(best) + 1]
    assert kernel_isa_in_child() == best
    # the no-native-bf16 switch runs this machine as an AVX2 CPU, compiled kernels included
    assert kernel_isa_in_child(MEGATRON_SPEC_NO_NATIVE_BF16="1") == min(best, "avx2", key=ORDER.index)
    # torch's own switch caps our kernels as it caps torch's
    assert kernel_isa_in_child(ATEN_CPU_CAPABILITY="default") == "default"


@requires_ext
def test_set_kernel_isa_checks_the_name_and_the_cpu():
    before = _ext.kernel_isa()
    with pytest.raises(ValueError, match="one of default, avx2, avx512"):
        _ext.set_kernel_isa("sse9")
    best = _ext.supported_kernel_isas()[-1]
    for name in ORDER[ORDER.index(best) + 1:]:
        with pytest.raises(ValueError, match=f"cannot run the {name} variant"):
            _ext.set_kernel_isa(name)
    assert _ext.kernel_isa() == before


def test_no_extension_means_no_variant(monkeypatch):
    monkeypatch.setattr(_ext, "compiled_ops_available", lambda: False)
    assert _ext.kernel_isa() is None and _ext.supported_kernel_isas() == []
    with pytest.raises(RuntimeError, match="not built"):
        _ext.set_kernel_isa("default")


@requires_ext
def test_info_reports_the_variant():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_spec", "info", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["kernel_isa"] in _ext.supported_kernel_isas()
