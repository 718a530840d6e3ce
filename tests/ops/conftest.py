"""``kernel_variant``: runs a test once per compiled CPU kernel variant (default, AVX2, AVX-512) this
CPU can run, so every variant is compared with the references on any machine that has it
(csrc/cpu/kernels.h; ``megatron_spec._ext.set_kernel_isa``). Variants the CPU lacks are skipped."""

from __future__ import annotations

import pytest

from megatron_spec import _ext

KERNEL_VARIANTS = ["default", "avx2", "avx512"]


@pytest.fixture(params=KERNEL_VARIANTS)
def kernel_variant(request):
    name = request.param
    if name not in _ext.supported_kernel_isas():
        pytest.skip(f"the {name} kernels do not run on this CPU (or _C is not built)")
    before = _ext.kernel_isa()
    _ext.set_kernel_isa(name)
    tiles = _ext.fp32_linear_tiles() == "avx512"  # under the AVX-512 variant: the switch as it was
    if name == "avx512":  # the fp32 linear kernel's AVX-512 tiles too, where the CPU would run its AVX2 tiles
        _ext.set_fp32_avx512_tiles(True)
    try:
        yield name
    finally:
        if name == "avx512":
            _ext.set_fp32_avx512_tiles(tiles)
        _ext.set_kernel_isa(before)


@pytest.fixture(params=KERNEL_VARIANTS + ["amx"])
def bf16_linear_variant(request):
    """``kernel_variant`` for the bf16 linear kernel, which has one more: ``avx512`` runs its AVX512-BF16 dot
    products (AMX switched off), ``amx`` its AMX tiles (csrc/linear_amx_cpu.cpp; skipped without AMX)."""
    name = request.param
    isa = "avx512" if name == "amx" else name
    if isa not in _ext.supported_kernel_isas():
        pytest.skip(f"the {isa} kernels do not run on this CPU (or _C is not built)")
    if name == "amx" and not _ext.amx_supported():
        pytest.skip("no AMX-BF16 on this CPU (or its OS does not grant the tile state)")
    before = _ext.kernel_isa()
    _ext.set_kernel_isa(isa)
    if _ext.amx_supported():
        _ext.set_amx(name == "amx")
    try:
        yield name
    finally:
        _ext.set_kernel_isa(before)
        if _ext.amx_supported():
            _ext.set_amx(amx_default())


def amx_default() -> bool:
    """The AMX switch as the process started (``MEGATRON_SPEC_NO_AMX`` unset: on)."""
    import os

    return os.environ.get("MEGATRON_SPEC_NO_AMX", "0").strip().lower() not in ("1", "true", "yes", "on")
