"""Performance simulator: project speculative-decoding gains for RL at cluster scale.

A roofline model of one GRPO step (rollout decode with its long tail, verification of k+1
tokens, the draft, log-prob recompute, training, weight sync; sync or async), with public
hardware and model profiles and a handful of efficiency parameters fitted to the reference
paper's measured 8B numbers (``python -m megatron_spec.sim.calibrate``). docs/simulator.md
explains the model, its assumptions and its limits.

It knows no real engine: everything is bytes, FLOPs and fitted overheads. It does not import
torch.
"""

from megatron_spec.sim.acceptance import AcceptanceProfile
from megatron_spec.sim.engine_bench import validate_engine_benchmark
from megatron_spec.sim.hardware import HARDWARE_NAMES, HardwareProfile, get_hardware
from megatron_spec.sim.models import MODEL_NAMES, ModelProfile, get_model
from megatron_spec.sim.params import EfficiencyParams, EngineSettings
from megatron_spec.sim.rl_step import SimConfig, SimResult, optimal_k, simulate, speedup_by_k
from megatron_spec.sim.roofline import Parallelism
from megatron_spec.sim.workload import PRESETS, Workload

__all__ = [
    "AcceptanceProfile", "EfficiencyParams", "EngineSettings", "HARDWARE_NAMES", "HardwareProfile",
    "MODEL_NAMES", "ModelProfile", "PRESETS", "Parallelism", "SimConfig", "SimResult", "Workload",
    "get_hardware", "get_model", "optimal_k", "simulate", "speedup_by_k", "validate_engine_benchmark",
]
