"""What this CPU can do, and the one place that turns it into a compute dtype.

On a CPU, bf16 only pays where the hardware does bf16 arithmetic (AVX512-BF16, AMX-BF16,
AVX-NE-CONVERT, Arm's BF16 extension). Elsewhere (AVX2-only x86, for example AMD Zen 3) oneDNN
refuses to prepack bf16 weights ("bf16 path needs the cpu support avx_ne_convert or avx512bw,
avx512vl and avx512dq") and a plain bf16 matmul runs 30-130x slower than fp32 (docs/design.md,
"CPUs without AVX-512"). So the engines, the launcher, ``megatron-spec generate`` and every
benchmark ask :func:`resolve_dtype` which dtype to compute in, and nothing else decides it:

* ``auto`` (the default): bf16 where it is native and fast, fp32 elsewhere; bf16 on a GPU.
* ``bfloat16`` on a CPU without native bf16: fp32, with one warning line saying why
  (weights streamed as bf16 are upcast when the engine loads them). Never the slow path.
* ``float32``: fp32.

:func:`probe` reads the CPU's flags (``/proc/cpuinfo``), torch's reported capability and oneDNN's
own bf16 check. ``MEGATRON_SPEC_NO_NATIVE_BF16=1`` makes it report "no native bf16" (and caps the
compiled kernels at AVX2, see ``megatron_spec._ext``), so a machine with AVX-512 runs the path an
AVX2 machine runs. ``megatron-spec info`` prints what the probe found.

:attr:`CpuInfo.kind` names the CPU kinds the benchmarks report (``AVX2``, ``AVX-512`` without bf16,
``AVX-512-BF16``, ``AMX``):
on an AMX CPU the bf16 engine's linear layers run on AMX tiles (``csrc/linear_amx_cpu.cpp``;
``MEGATRON_SPEC_NO_AMX=1`` keeps the AVX512-BF16 kernel, as the tests do to compare both).

This module does not know about models or engines; it only answers "which dtype".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys

NO_NATIVE_BF16_ENV = "MEGATRON_SPEC_NO_NATIVE_BF16"
"""Set to 1 to make the probe report no native bf16 (and the compiled kernels run their AVX2 code)."""

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
"""What a user may ask for (``--rollout-dtype``, ``generate --dtype``, benchmarks' ``--dtype``)."""

#: x86 flags that give bf16 arithmetic (dot products / tiles), not only conversion.
_X86_BF16_ARITH = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
#: what oneDNN needs to prepack a bf16 weight at all (its error message names these).
_X86_BF16_PACK = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


def switch_on(name: str) -> bool:
    """Whether the environment switch ``name`` is on: ``1``, ``true``, ``yes`` or ``on`` (any case, spaces
    trimmed), the rule the compiled kernels' own switches follow (``env_truthy``, csrc/cpu/dispatch.cpp)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def no_native_bf16_forced() -> bool:
    """True when ``MEGATRON_SPEC_NO_NATIVE_BF16`` asks for the no-native-bf16 path."""
    return switch_on(NO_NATIVE_BF16_ENV)


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """The probe's findings. ``native_bf16`` is the one fact the dtype choice reads."""

    model: str
    """CPU model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    arch: str
    """``x86_64``, ``aarch64``, ..."""
    torch_capability: str
    """``torch.backends.cpu.get_cpu_capability()``: the ISA torch's own kernels dispatch to."""
    flags: frozenset[str]
    """CPU feature flags (x86 ``flags`` / Arm ``Features``)."""
    bf16_arith: bool
    """The CPU does bf16 arithmetic in hardware (see ``_X86_BF16_ARITH``; Arm ``bf16``)."""
    onednn_bf16: bool
    """oneDNN says it supports bf16 here (``torch.ops.mkldnn._is_mkldnn_bf16_supported``)."""
    forced_off: bool
    """``MEGATRON_SPEC_NO_NATIVE_BF16`` is set."""

    @property
    def native_bf16(self) -> bool:
        return self.bf16_arith and self.onednn_bf16 and not self.forced_off

    @property
    def amx_bf16(self) -> bool:
        """The CPU has AMX bf16 tiles (``amx_tile`` and ``amx_bf16``: Intel Sapphire Rapids and later), and
        bf16 is native here: the bf16 engine's linear layers then run on AMX tiles
        (``megatron_spec._ext.amx_active`` says whether they do: the OS must grant the tile state,
        ``MEGATRON_SPEC_NO_AMX=1`` keeps AVX512-BF16)."""
        return self.native_bf16 and "amx_tile" in self.flags and "amx_bf16" in self.flags

    @property
    def kind(self) -> str:
        """The CPU kind benchmarks name (docs/benchmarks.md): ``AMX``, ``AVX-512-BF16``, ``AVX-512`` or
        ``AVX2`` (what the engines run here, so ``AVX2`` with ``MEGATRON_SPEC_NO_NATIVE_BF16=1``)."""
        if self.amx_bf16:
            return "AMX"
        if self.native_bf16:
            return "AVX-512-BF16"
        return "AVX-512" if self.capability.startswith("AVX512") else self.capability

    @property
    def capability(self) -> str:
        """One word for logs and benchmark JSON, e.g. ``AVX512``, or ``AVX2`` when the switch is set."""
        if self.forced_off and self.torch_capability.startswith("AVX512"):
            return "AVX2"
        return self.torch_capability

    def why_not_bf16(self) -> str:
        """Why bf16 is not native here ("" when it is)."""
        if self.forced_off:
            return f"{NO_NATIVE_BF16_ENV} is set"
        if not self.bf16_arith:
            return (f"this CPU ({self.model}, {self.torch_capability}) has no bf16 arithmetic "
                    f"(none of avx512_bf16, amx_bf16, avx_ne_convert)" if self.arch in ("x86_64", "AMD64")
                    else f"this CPU ({self.model}) reports no bf16 feature")
        if not self.onednn_bf16:
            return "oneDNN reports no bf16 support on this CPU"
        return ""

    def as_dict(self) -> dict:
        return {"cpu_model": self.model, "arch": self.arch, "cpu_capability": self.capability,
                "torch_cpu_capability": self.torch_capability, "native_bf16": self.native_bf16,
                "bf16_flags": sorted(f for f in self.flags if "bf16" in f or f == "avx_ne_convert"),
                "no_native_bf16_forced": self.forced_off, "amx_bf16": self.amx_bf16, "cpu_kind": self.kind}


def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown", frozenset(flags)


def _bf16_arith(arch: str, flags: frozenset[str]) -> bool:
    if arch in ("x86_64", "AMD64", "i686"):
        packable = any(all(f in flags for f in group) for group in _X86_BF16_PACK)
        return packable and any(f in flags for f in _X86_BF16_ARITH)
    if arch in ("aarch64", "arm64"):
        return "bf16" in flags
    return False


@functools.lru_cache(maxsize=1)
def _probe_hardware() -> tuple[str, str, str, frozenset[str], bool, bool]:
    import torch

    model, flags = _cpuinfo()
    arch = platform.machine()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "unknown"
    try:
        onednn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    return model, arch, capability, flags, _bf16_arith(arch, flags), onednn


def probe() -> CpuInfo:
    """What this CPU can do (the hardware facts are read once; the switch is read every call)."""
    model, arch, capability, flags, arith, onednn = _probe_hardware()
    return CpuInfo(model=model, arch=arch, torch_capability=capability, flags=flags, bf16_arith=arith,
                   onednn_bf16=onednn, forced_off=no_native_bf16_forced())


_warned: set[str] = set()


def resolve_dtype(requested: str | None = "auto", device: str = "cpu") -> str:
    """The compute dtype an engine (or benchmark) runs in: ``"float32"`` or ``"bfloat16"``.

    Args:
        requested: ``auto`` | ``float32`` | ``bfloat16`` (``None`` means ``auto``; ``fp32`` and
            ``bf16`` are accepted as aliases).
        device: ``cpu`` for the native engine; ``cuda`` (a GPU engine such as SGLang) keeps bf16
            and makes ``auto`` bf16.

    An explicit ``bfloat16`` on a CPU without native bf16 gives ``float32`` and logs one warning
    saying why (once per process).
    """
    req = {None: "auto", "fp32": "float32", "bf16": "bfloat16"}.get(requested, requested)
    if req not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if req == "float32":
        return "float32"
    if device != "cpu":
        return "bfloat16"
    info = probe()
    if info.native_bf16:
        return "bfloat16"
    if req == "bfloat16" and "warned" not in _warned:
        _warned.add("warned")
        # One plain line on stderr (not a logger that may not be configured in this process).
        print(f"megatron-spec: warning: bfloat16 asked for, but {info.why_not_bf16()}: computing in float32 "
              "instead (bf16 matmuls without hardware support run 30-130x slower; streamed bf16 weights "
              "are upcast at load)", file=sys.stderr, flush=True)
    return "float32"
