"""Hardware profiles: the public peak figures of each accelerator, and this CPU as measured.

A profile holds *peaks* (vendor datasheet numbers) or, for ``cpu``, *achieved* figures measured
by ``benchmarks/measure_cpu_profile.py``. How much of a GPU's peak an inference engine reaches is
not a property of the chip: it lives in :class:`megatron_spec.sim.params.EfficiencyParams`,
fitted by ``python -m megatron_spec.sim.calibrate``.

Conventions: bytes are SI (1 GB = 1e9 B); bandwidths are per direction and per device;
FLOP/s are dense (no 2:4 sparsity). Collective latencies are typical NCCL small-message
figures (order of magnitude, not vendor numbers); they only matter with TP/EP > 1.

What it does not know: clocks under power capping, NUMA, PCIe topology, or anything a
datasheet does not state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CPU_PROFILE_PATH = DATA_DIR / "cpu_profile.json"

#: dtype names the simulator understands -> bytes per element.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "fp8": "fp8", "fp32": "fp32", "bf16": "bf16"}


def canonical_dtype(name: str) -> str:
    """``bfloat16`` -> ``bf16`` etc.; ValueError for anything else."""
    try:
        return _DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPE_ALIASES)}") from None


@dataclass(frozen=True)
class HardwareProfile:
    """One device (GPU, or the CPU as one 'device') and the fabric around it."""

    name: str
    kind: str  # "gpu" or "cpu": selects the efficiency parameters that apply
    memory_bytes: float  # device memory (HBM) capacity
    mem_bw: float  # device memory bandwidth, B/s
    flops: dict[str, float]  # dense peak FLOP/s per dtype ("bf16", "fp8", "fp32")
    link_bw: float  # scale-up (NVLink) bandwidth per direction per device, B/s
    scaleup_domain: int  # devices per scale-up (NVLink) domain
    net_bw: float  # scale-out (InfiniBand) bandwidth per device, B/s
    link_latency_s: float = 10e-6
    net_latency_s: float = 25e-6
    # Measured-only refinements (the cpu profile): achieved weight-streaming bandwidth per
    # dtype (a GEMV at 1 token), KV-read bandwidth per dtype per query-token count, and the
    # launch overhead of one decoder layer. None: derive from mem_bw and the fitted params.
    weight_bw: dict[str, float] | None = None
    attn_bw: dict[str, dict[int, float]] | None = None
    layer_overhead_s: float | None = None
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def peak_flops(self, dtype: str) -> float:
        dtype = canonical_dtype(dtype)
        if dtype not in self.flops:
            raise ValueError(f"hardware {self.name!r} has no {dtype} FLOP/s figure "
                             f"(has {sorted(self.flops)})")
        return self.flops[dtype]


# Public figures. Sources:
# H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS
#   and FP8 3,958 TFLOPS *with sparsity* -> dense 989.5 / 1,979; NVLink 900 GB/s total ->
#   450 GB/s per direction; HGX: 8 GPUs per NVLink domain; ConnectX-7 NDR 400 Gb/s per GPU).
# H200 SXM: NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s; same tensor cores and NVLink as H100).
# B200 (HGX/DGX B200, 1,000 W): DGX B200 datasheet (1,440 GB and 64 TB/s over 8 GPUs -> 180 GB,
#   8 TB/s per GPU; FP8 72 PFLOPS dense training per 8 GPUs -> 4.5 PF dense FP8, 2.25 PF dense
#   BF16 per GPU); NVLink 5: 1.8 TB/s total -> 900 GB/s per direction; ConnectX-7 400 Gb/s.
# GB200 (NVL72, 1,200 W): NVIDIA GB200 NVL72 spec (13.4 TB HBM3e and 576 TB/s over 72 GPUs ->
#   186 GB, 8 TB/s per GPU; FP8 720 PF and BF16 360 PF *sparse* per rack -> 5 PF / 2.5 PF dense
#   per GPU); NVLink 5 1.8 TB/s total per GPU, 72 GPUs per NVLink domain; ConnectX-7 400 Gb/s.
# H20 (HGX H20, the export Hopper): 96 GB HBM3, 4.0 TB/s, dense BF16 148 TFLOPS and FP8 296
#   TFLOPS (the BF16 figure as verl-project/verl docs/advance/mtp.md tabulates it), NVLink 900 GB/s
#   total -> 450 GB/s per direction, 8 GPUs per board. Its FLOP/s-to-bandwidth ratio (37 FLOP/B,
#   against 295 for H100) makes verification compute-bound at a few dozen tokens per forward.
_GPU_PROFILES = {
    "h20": HardwareProfile(
        name="h20", kind="gpu", memory_bytes=96e9, mem_bw=4.0e12,
        flops={"bf16": 148e12, "fp8": 296e12, "fp32": 44e12},
        link_bw=450e9, scaleup_domain=8, net_bw=50e9,
        source="NVIDIA HGX H20 specification"),
    "h100": HardwareProfile(
        name="h100", kind="gpu", memory_bytes=80e9, mem_bw=3.35e12,
        flops={"bf16": 989.5e12, "fp8": 1979e12, "fp32": 66.9e12},
        link_bw=450e9, scaleup_domain=8, net_bw=50e9,
        source="NVIDIA H100 SXM5 datasheet"),
    "h200": HardwareProfile(
        name="h200", kind="gpu", memory_bytes=141e9, mem_bw=4.8e12,
        flops={"bf16": 989.5e12, "fp8": 1979e12, "fp32": 66.9e12},
        link_bw=450e9, scaleup_domain=8, net_bw=50e9,
        source="NVIDIA H200 SXM datasheet"),
    "b200": HardwareProfile(
        name="b200", kind="gpu", memory_bytes=180e9, mem_bw=8.0e12,
        flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp32": 75e12},
        link_bw=900e9, scaleup_domain=8, net_bw=50e9,
        source="NVIDIA DGX/HGX B200 datasheet"),
    "gb200": HardwareProfile(
        name="gb200", kind="gpu", memory_bytes=186e9, mem_bw=8.0e12,
        flops={"bf16": 2.5e15, "fp8": 5.0e15, "fp32": 80e12},
        link_bw=900e9, scaleup_domain=72, net_bw=50e9,
        source="NVIDIA GB200 NVL72 specification"),
}

HARDWARE_NAMES = (*_GPU_PROFILES, "cpu")


def gemm_curve(stack: dict) -> dict[int, float]:
    """t(n) / t(1) of a measured linear stack (tokens -> relative forward time): the CPU's GEMM
    cost per weight byte as a function of the tokens in the forward."""
    times = {int(n): float(t) for n, t in stack["forward_s"].items()}
    if 1 not in times:
        raise ValueError("linear_stack table lacks the 1-token time")
    return {n: t / times[1] for n, t in sorted(times.items())}


def load_cpu_profile(path: str | Path = CPU_PROFILE_PATH) -> HardwareProfile:
    """The ``cpu`` profile from a JSON written by ``benchmarks/measure_cpu_profile.py``."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no CPU profile at {path}; run `python benchmarks/measure_cpu_profile.py`")
    raw = json.loads(path.read_text())
    for key in ("mem_bw", "weight_bw", "flops", "attn_bw", "layer_overhead_s"):
        if key not in raw:
            raise ValueError(f"CPU profile {path} lacks {key!r}; re-run benchmarks/measure_cpu_profile.py")
    flops = {canonical_dtype(k): float(v) for k, v in raw["flops"].items()}
    weight_bw = {canonical_dtype(k): float(v) for k, v in raw["weight_bw"].items()}
    attn_bw = {
        canonical_dtype(k): {int(q): float(b) for q, b in t.items()} for k, t in raw["attn_bw"].items()
    }
    mem_bw = float(raw["mem_bw"])
    stacks = raw.get("linear_stack", {})
    curves = {canonical_dtype(dt): gemm_curve(st) for dt, st in stacks.items()}
    gemm_call_s = {canonical_dtype(k): float(v) for k, v in raw.get("gemm_call_s", {}).items()}
    return HardwareProfile(
        name="cpu", kind="cpu",
        memory_bytes=float(raw.get("machine", {}).get("memory_bytes") or 16e9),
        mem_bw=mem_bw, flops=flops,
        # Ranks on one CPU talk through shared memory (gloo): a copy at memcpy speed, and a
        # latency typical of gloo's small-message all-reduce. Rough; TP>1 on CPU is not a target.
        link_bw=mem_bw / 2, scaleup_domain=1 << 30, net_bw=mem_bw / 2,
        link_latency_s=50e-6, net_latency_s=50e-6,
        weight_bw=weight_bw, attn_bw=attn_bw, layer_overhead_s=float(raw["layer_overhead_s"]),
        source=f"measured by {raw.get('source', 'benchmarks/measure_cpu_profile.py')} "
               f"at {raw.get('measured_at', '?')}",
        extra={"linear_stack": stacks, "machine": raw.get("machine", {}), "gemm_curve": curves,
               "gemm_call_s": gemm_call_s, "gemm_calls": raw.get("gemm_calls", {})},
    )


def get_hardware(name: str, cpu_profile_path: str | Path | None = None) -> HardwareProfile:
    """A profile by name (``h20``, ``h100``, ``h200``, ``b200``, ``gb200``, ``cpu``)."""
    key = name.lower()
    if key == "cpu":
        return load_cpu_profile(cpu_profile_path or CPU_PROFILE_PATH)
    if key not in _GPU_PROFILES:
        raise ValueError(f"unknown hardware {name!r}; expected one of {', '.join(HARDWARE_NAMES)}")
    return _GPU_PROFILES[key]
