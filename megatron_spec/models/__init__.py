"""Policy models: HF configs and checkpoints, megatron-core GPTModel, weight layouts.

Submodules: ``hf_config`` (DecoderConfig), ``checkpoint`` (HF safetensors directories),
``convert`` (HF <-> Megatron layouts for any TP size), ``gpt`` (build/load/export the
megatron-core model), ``tiny`` (small real HF checkpoints made on the spot).
"""

from megatron_spec.models.checkpoint import CheckpointError, HFCheckpoint, save_hf_checkpoint
from megatron_spec.models.hf_config import DecoderConfig, UnsupportedModelError

__all__ = ["CheckpointError", "DecoderConfig", "HFCheckpoint", "UnsupportedModelError", "save_hf_checkpoint"]
