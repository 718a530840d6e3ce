"""Loads the compiled extension ``megatron_spec._C`` if it was built.

Every op in ``megatron_spec.ops`` has a pure-PyTorch reference; this module only decides
which one runs. ``MEGATRON_SPEC_FORCE_REFERENCE=1`` forces the references (tests use it to
exercise the fallback path). Which implementation is active is logged once at DEBUG level.

The compiled CPU kernels exist in three variants in one binary, ``default`` (baseline x86-64, or
the only one elsewhere), ``avx2`` and ``avx512``; the extension picks the highest this CPU runs,
capped at ``avx2`` by ``MEGATRON_SPEC_NO_NATIVE_BF16=1`` (``megatron_spec.isa``) and by
``ATEN_CPU_CAPABILITY`` as torch's own kernels are (``csrc/cpu/kernels.h``). :func:`kernel_isa` says
which one runs; :func:`set_kernel_isa` lets tests run each.

It does not know what the ops compute.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("megatron_spec")


@functools.lru_cache(maxsize=1)
def compiled_ops_available() -> bool:
    """True when ``megatron_spec._C`` is importable and not disabled by the environment."""
    if os.environ.get("MEGATRON_SPEC_FORCE_REFERENCE", "0") == "1":
        logger.debug("megatron-spec ops: pure-PyTorch references (MEGATRON_SPEC_FORCE_REFERENCE=1)")
        return False
    try:
        import torch  # noqa: F401  (the extension registers into torch.ops)

        from megatron_spec import _C
    except ImportError as exc:
        logger.debug("megatron-spec ops: pure-PyTorch references (_C not importable: %s)", exc)
        return False
    logger.debug("megatron-spec ops: compiled kernels from %s", _C.__file__)
    return True


def kernel_isa() -> str | None:
    """The CPU kernel variant in use: ``"default"``, ``"avx2"`` or ``"avx512"`` (None without ``_C``)."""
    if not compiled_ops_available():
        return None
    from megatron_spec import _C

    return _C.kernel_isa()


def supported_kernel_isas() -> list[str]:
    """The CPU kernel variants this CPU can run, lowest first (``[]`` without ``_C``)."""
    if not compiled_ops_available():
        return []
    from megatron_spec import _C

    order = ["default", "avx2", "avx512"]
    return order[: order.index(_C.best_kernel_isa()) + 1]


def bf16_dot_available() -> bool:
    """Whether ``megatron_spec::linear_small_bf16`` runs its AVX512-BF16 tiles here (a CPU with bf16 dot
    products, the AVX-512 kernel variant active); else it runs scalar loops, and the layers keep oneDNN for
    bf16."""
    if not compiled_ops_available():
        return False
    from megatron_spec import _C

    return bool(_C.bf16_dot_active())


def amx_supported() -> bool:
    """Whether this CPU and its OS run AMX-BF16 tiles (before ``MEGATRON_SPEC_NO_AMX`` and the other
    switches)."""
    if not compiled_ops_available():
        return False
    from megatron_spec import _C

    return bool(_C.amx_supported())


def amx_active() -> bool:
    """Whether ``megatron_spec::linear_small_bf16`` runs on AMX tiles (csrc/linear_amx_cpu.cpp): AMX here, the
    AVX-512 variant active, neither ``MEGATRON_SPEC_NO_AMX=1`` nor ``MEGATRON_SPEC_NO_NATIVE_BF16=1`` set."""
    if not compiled_ops_available():
        return False
    from megatron_spec import _C

    return bool(_C.amx_active())


def set_amx(on: bool) -> None:
    """Run the bf16 linear kernel on AMX tiles (True) or AVX512-BF16 dot products (False) from now on, in this
    process (tests compare both). ValueError for True where AMX does not run; RuntimeError without ``_C``."""
    if not compiled_ops_available():
        raise RuntimeError(
            "megatron_spec._C is not built (or MEGATRON_SPEC_FORCE_REFERENCE=1): no AMX kernel"
        )
    from megatron_spec import _C

    _C.set_amx(bool(on))


def bf16_linear_kernel() -> str:
    """The kernel the bf16 engine's decode/verify linear layers run here, for logs and benchmark JSON:
    ``amx`` (AMX tiles), ``avx512bf16`` (vdpbf16ps), or ``onednn`` (no bf16 dot products: oneDNN's matmul)."""
    if amx_active():
        return "amx"
    return "avx512bf16" if bf16_dot_available() else "onednn"


def fp32_linear_tiles() -> str | None:
    """The tiles ``megatron_spec::linear_small_f32`` runs: ``avx512``, ``avx2`` or ``scalar`` (None without
    ``_C``). Under the AVX-512 variant its AVX2 tiles (the same bits) where the CPU runs 512-bit vectors as
    two 256-bit halves (AMD Zen 4), or where ``MEGATRON_SPEC_FP32_TILES=avx2`` says so."""
    isa = kernel_isa()
    if isa is None:
        return None
    from megatron_spec import _C

    if _C.fp32_avx512_tiles():
        return "avx512"
    return "scalar" if isa == "default" else "avx2"


def set_fp32_avx512_tiles(on: bool) -> None:
    """Run ``linear_small_f32``'s AVX-512 tiles (True) or its AVX2 tiles (False) under the AVX-512 variant,
    from now on in this process (tests run both). Raises ValueError where the CPU has no AVX-512,
    RuntimeError without ``_C``."""
    if not compiled_ops_available():
        raise RuntimeError(
            "megatron_spec._C is not built (or MEGATRON_SPEC_FORCE_REFERENCE=1): no AVX-512 tiles"
        )
    from megatron_spec import _C

    _C.set_fp32_avx512_tiles(bool(on))


def set_kernel_isa(name: str) -> None:
    """Run the CPU kernel variant ``name`` from now on, in this process (tests compare each with the
    references). Raises ValueError for a variant this CPU cannot run, RuntimeError without ``_C``."""
    if not compiled_ops_available():
        raise RuntimeError(
            "megatron_spec._C is not built (or MEGATRON_SPEC_FORCE_REFERENCE=1): no kernel variants"
        )
    from megatron_spec import _C

    _C.set_kernel_isa(name)


def cpu_facts() -> dict[str, object]:
    """What a benchmark's JSON line says of the machine and the kernels that ran: the CPU kind (``AVX2``,
    ``AVX-512``, ``AVX-512-BF16``, ``AMX``), its model and torch's capability, and the linear kernel of each
    engine dtype (fp32: the panels' kernel variant, and its tiles where they are not the variant's own:
    ``avx512, avx2 tiles`` on AMD Zen 4), and the engines' allocator setting (``host_heap``:
    ``host_memory.setting()``) and whether their panels go to huge pages (``huge_pages``)."""
    from megatron_spec.host_memory import huge_pages, setting
    from megatron_spec.isa import probe

    info = probe()
    isa, tiles = kernel_isa(), fp32_linear_tiles()
    own = isa != "avx512" or tiles == "avx512"
    fp32 = f"fp32 panels ({isa})" if own else f"fp32 panels ({isa}, {tiles} tiles)"
    return {"cpu_kind": info.kind, "cpu_model": info.model, "cpu_capability": info.capability,
            "linear_kernel": {"bfloat16": bf16_linear_kernel(), "float32": fp32}, "host_heap": setting(),
            "huge_pages": huge_pages()}
