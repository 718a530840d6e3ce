"""The simulator's free parameters (fitted) and engine settings (chosen, not fitted).

:class:`EfficiencyParams` are the few numbers no datasheet gives: the fraction of peak an engine achieves and
its fixed overheads. For GPUs they are fitted to the measured 8B numbers of the reference paper
(docs/design.md, "Reference measurements") by ``python -m megatron_spec.sim.calibrate``, which writes
``data/calibration.json``; every simulation reads that file, so results are reproducible without refitting.
For the ``cpu`` profile they come from the measured profile (achieved figures, so the efficiencies are 1) and
are never fitted to engine runs.

:class:`EngineSettings` are knobs of the rollout engine (CUDA-graph capture size, max running
sequences, memory fraction) with the defaults of vLLM, which the paper used.

What it does not know: how efficiency changes across GPU generations. The GPU parameters are
fitted on GB200 and applied to H100/H200/B200 as well; docs/simulator.md lists this as a limit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_spec.sim.hardware import DATA_DIR, HardwareProfile

CALIBRATION_PATH = DATA_DIR / "calibration.json"


@dataclass(frozen=True)
class EfficiencyParams:
    """Achieved fractions of peak and overheads of one engine + trainer on one device kind."""

    mem_eff: float = 0.7
    """Fraction of peak memory bandwidth that decode kernels (GEMV, KV reads) achieve."""
    flop_eff: float = 0.6
    """Fraction of peak dense FLOP/s that decode/verify GEMMs and attention achieve."""
    step_overhead_s: float = 1e-3
    """Fixed host/launch time per target forward (scheduler, sampling, graph replay)."""
    eager_layer_overhead_s: float = 0.0
    """Extra time per layer per forward when the forward's tokens exceed the CUDA-graph capture
    size and it runs eagerly (kernel launches)."""
    draft_pass_overhead_s: float = 0.0
    """Fixed host time per draft forward (the proposer loop between draft steps)."""
    ngram_s_per_step: float = 0.0
    """Host time per verify step of the n-gram proposer, which runs on the CPU between GPU steps
    and needs the sampled tokens on the host (a GPU->CPU sync that stops the engine from
    overlapping scheduling with the GPU)."""
    ngram_s_per_seq: float = 0.0
    """Host time per running sequence per verify step of the n-gram proposer (it loops over
    requests)."""
    train_mfu: float = 0.35
    """Model FLOPs utilisation of Megatron training and of the log-prob recompute forward."""
    step_fixed_s: float = 0.0
    """Fixed time per RL step outside the modelled stages (data, rewards, engine wake/sleep)."""

    def __post_init__(self) -> None:
        for name in ("mem_eff", "flop_eff", "train_mfu"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency parameter {name}={value} must be in (0, 1]")
        for name in ("step_overhead_s", "eager_layer_overhead_s", "draft_pass_overhead_s",
                     "ngram_s_per_step", "ngram_s_per_seq", "step_fixed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"overhead parameter {name}={getattr(self, name)} must be >= 0")

    def replace(self, **changes) -> EfficiencyParams:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineSettings:
    """Rollout-engine knobs (vLLM defaults for GPUs)."""

    graph_max_tokens: int = 512
    """Largest tokens-per-forward captured as a CUDA graph (vLLM's default max capture size);
    bigger forwards run eagerly. 0: never graphed (the CPU engine)."""
    max_num_seqs: int = 512
    """Most sequences an engine runs at once (vLLM ``max_num_seqs``)."""
    fused_verify_max_q: int = 4
    """Most query tokens per sequence the engine's fused decode-attention kernel verifies in one
    pass over the KV cache; a verify forward with more (q = k+1 > this) falls back to a path that
    reads each sequence's KV cache once per query token. 0: always fused. The default 4 (k <= 3
    fused) is the engine behaviour that explains the paper's collapse of long-context RL-Think at
    k >= 5 (docs/simulator.md, "Calibration"); set 0 for an engine with multi-token decode kernels."""
    max_batched_tokens: int = 0
    """Token budget of one decode forward (vLLM ``max_num_batched_tokens``); a speculative step
    spends k+1 tokens per sequence, so at most budget // (k+1) sequences run. 0: unlimited."""
    mem_util: float = 0.9
    """Fraction of device memory the engine may use (vLLM ``gpu_memory_utilization``)."""
    workspace_bytes: float = 3e9
    """Memory per device kept for activations, logits and graphs (not for weights or KV)."""
    kv_dtype_bytes: int = 2
    """Bytes per KV-cache element (2: bf16 cache)."""

    def __post_init__(self) -> None:
        if self.graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens={self.graph_max_tokens} must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 < self.mem_util <= 1.0:
            raise ValueError(f"mem_util={self.mem_util} must be in (0, 1]")
        if self.fused_verify_max_q < 0 or self.max_batched_tokens < 0:
            raise ValueError(f"fused_verify_max_q={self.fused_verify_max_q} and max_batched_tokens="
                             f"{self.max_batched_tokens} must be >= 0")

    def replace(self, **changes) -> EngineSettings:
        return dataclasses.replace(self, **changes)


def default_engine_settings(hw: HardwareProfile) -> EngineSettings:
    if hw.kind == "cpu":  # eager PyTorch, no graphs; a small workspace
        return EngineSettings(graph_max_tokens=0, max_num_seqs=256, mem_util=0.8, workspace_bytes=0.5e9,
                              fused_verify_max_q=0)
    return EngineSettings()


def cpu_efficiency(hw: HardwareProfile) -> EfficiencyParams:
    """Parameters for the measured CPU profile: its figures are already achieved ones."""
    return EfficiencyParams(mem_eff=1.0, flop_eff=1.0, step_overhead_s=0.0,
                            eager_layer_overhead_s=hw.layer_overhead_s or 0.0,
                            draft_pass_overhead_s=0.0, ngram_s_per_step=0.0, ngram_s_per_seq=0.0,
                            # Training on CPU is not what the profile measured; half of the
                            # measured GEMM rate is an assumption, stated in docs/simulator.md.
                            train_mfu=0.5, step_fixed_s=0.0)


def load_calibration(path: str | Path = CALIBRATION_PATH) -> dict:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no calibration file at {path}; run `python -m megatron_spec.sim.calibrate`")
    return json.loads(path.read_text())


def efficiency_for(hw: HardwareProfile, calibration_path: str | Path | None = None) -> EfficiencyParams:
    """The parameters that apply to ``hw``: measured for ``cpu``, fitted for GPUs."""
    if hw.kind == "cpu":
        return cpu_efficiency(hw)
    cal = load_calibration(calibration_path or CALIBRATION_PATH)
    fields = {f.name for f in dataclasses.fields(EfficiencyParams)}
    unknown = set(cal["gpu"]) - fields
    if unknown:
        raise ValueError(f"calibration file has unknown GPU parameters {sorted(unknown)}")
    return EfficiencyParams(**cal["gpu"])
