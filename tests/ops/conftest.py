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
    try:
        yield name
    finally:
        _ext.set_kernel_isa(before)
