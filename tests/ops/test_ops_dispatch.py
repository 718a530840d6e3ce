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
    assert facts["fp32_linear_tiles"] == _ext.fp32_linear_tiles()


def fp32_tiles_in_child(**env: str) -> str:
    """fp32_linear_tiles() and cpu_facts()'s fp32 kernel in a fresh interpreter, caps cleared, ``env`` set."""
    child = {k: v for k, v in os.environ.items()
             if k not in ("MEGATRON_SPEC_NO_NATIVE_BF16", "ATEN_CPU_CAPABILITY", "MEGATRON_SPEC_FP32_TILES")}
    child.update(env)
    code = ("from megatron_spec import _ext; "
            "print(_ext.fp32_linear_tiles(), '|', _ext.cpu_facts()['linear_kernel']['float32'])")
    out = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, check=True,
                         timeout=300)
    return out.stdout.strip().splitlines()[-1]


def amd_zen4() -> bool:
    """AMD family 0x19 (25) with AVX-512, from /proc/cpuinfo: 512-bit vectors run there as two halves."""
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read().split("\n\n")[0]
    except OSError:
        return False
    info = dict(line.split(":", 1) for line in head.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


@requires_ext
def test_fp32_linear_tiles_follow_the_cpu_and_the_switches():
    """Under the AVX-512 variant the fp32 linear kernel runs its AVX-512 tiles, except on AMD Zen 4 (its AVX2
    tiles: the same bits, faster there); MEGATRON_SPEC_FP32_TILES forces either; a capped variant caps it."""
    best = _ext.supported_kernel_isas()[-1]
    if best != "avx512":
        assert fp32_tiles_in_child() == f"{'avx2' if best == 'avx2' else 'scalar'} | fp32 panels ({best})"
        with pytest.raises(ValueError, match="no AVX-512 tiles"):
            _ext.set_fp32_avx512_tiles(True)
        return
    mine = "avx2" if amd_zen4() else "avx512"
    assert fp32_tiles_in_child() == (
        f"{mine} | fp32 panels (avx512{', avx2 tiles' if mine == 'avx2' else ''})")
    assert fp32_tiles_in_child(MEGATRON_SPEC_FP32_TILES="avx512") == "avx512 | fp32 panels (avx512)"
    assert fp32_tiles_in_child(MEGATRON_SPEC_FP32_TILES="avx2") == "avx2 | fp32 panels (avx512, avx2 tiles)"
    assert fp32_tiles_in_child(MEGATRON_SPEC_NO_NATIVE_BF16="1") == "avx2 | fp32 panels (avx2)"
    isa = _ext.kernel_isa()
    _ext.set_kernel_isa("avx512")  # (this process may run capped: MEGATRON_SPEC_NO_NATIVE_BF16=1)
    tiles = _ext.fp32_linear_tiles() == "avx512"  # the switch as it was, read under the AVX-512 variant
    try:
        _ext.set_fp32_avx512_tiles(False)
        assert _ext.fp32_linear_tiles() == "avx2"
        _ext.set_fp32_avx512_tiles(True)
        assert _ext.fp32_linear_tiles() == "avx512"
        _ext.set_kernel_isa("avx2")  # the variant's cap caps the tiles
        assert _ext.fp32_linear_tiles() == "avx2"
    finally:
        _ext.set_fp32_avx512_tiles(tiles)
        _ext.set_kernel_isa(isa)
