"""Builds the native engine's drafter from its :class:`EngineConfig` (``draft_kind``), loading the draft's
weights from ``draft_path`` where the kind has any, and says which module holds a drafter's weights.

This module does not know about weight updates, memory release or the engine's scheduling: it returns
the drafter and whether its weights came from a checkpoint (the caller records the version).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_spec.layers.linear import Linear, TiedLinear
from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.drafters import Drafter, Eagle3Drafter, ModelDrafter, NgramDrafter
from megatron_spec.rollout.native.model import CausalLM
from megatron_spec.rollout.native.mtp_drafter import MtpDrafter

INITIAL_DRAFT_VERSION = "init"
"""The version of draft weights loaded from ``draft_path`` at start."""


@dataclasses.dataclass
class BuiltDrafter:
    """What :func:`build_drafter` made."""

    drafter: Drafter | None
    """None: ``draft_kind`` ``none`` (autoregressive decoding only)."""
    version: str | None = None
    """:data:`INITIAL_DRAFT_VERSION` when the draft's weights were loaded from a checkpoint; None when it
    has none yet (the trainer streams them) or has no weights at all (n-gram, history)."""


def build_drafter(config: EngineConfig, target: CausalLM, device: torch.device, dtype: torch.dtype
                  ) -> BuiltDrafter:
    """The drafter ``config.draft_kind`` names, on ``device`` in ``dtype``, beside ``target``; its linear
    layers compute with their weights rounded to bf16 where they are fp32 and packed on a CPU
    (``config.draft_bf16``, ``layers.linear.Linear.round_bf16``)."""
    built = _build(config, target, device, dtype)
    module = draft_module(built.drafter)
    if module is not None and config.draft_bf16:
        for m in module.modules():  # (not a tied head: its table is the target's)
            if isinstance(m, Linear) and not isinstance(m, TiedLinear):
                m.round_bf16 = True
    return built


def _build(config: EngineConfig, target: CausalLM, device: torch.device, dtype: torch.dtype) -> BuiltDrafter:
    kind = config.draft_kind
    if kind == "none":
        return BuiltDrafter(None)
    if kind == "ngram":
        return BuiltDrafter(NgramDrafter(config.ngram_min, config.ngram_max))
    if kind == "history":
        from megatron_spec.rollout.native.history_drafter import HistoryDrafter

        return BuiltDrafter(HistoryDrafter(live=config.history_live))
    if kind == "model":
        return BuiltDrafter(_model_drafter(config, target, device, dtype), INITIAL_DRAFT_VERSION)
    if kind == "eagle3":
        from megatron_spec.draft.modelopt_io import load_eagle3

        head = load_eagle3(config.draft_path, target.cfg, dtype=dtype, device=device).eval()
        return BuiltDrafter(Eagle3Drafter(head, target.embed_tokens), INITIAL_DRAFT_VERSION)
    if kind == "mtp":
        return _mtp_drafter(config, target, device, dtype)
    raise ValueError(f"draft_kind {kind!r} is not available in the native engine")


def _model_drafter(config: EngineConfig, target: CausalLM, device: torch.device, dtype: torch.dtype
                   ) -> ModelDrafter:
    """A small causal LM from ``config.draft_path``; it must share the target's vocabulary."""
    dck = HFCheckpoint(config.draft_path)
    dcfg = dck.decoder_config
    if dcfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(
            f"draft model {config.draft_path} has vocab_size {dcfg.vocab_size}, the target "
            f"{target.cfg.vocab_size}: a draft model must share the target's tokenizer"
        )
    model = CausalLM(dcfg, max_positions=config.context_length + config.k + 1).to(device, dtype).eval()
    model.load_weights((n, dck.get(n)) for n in dck.weight_names())
    return ModelDrafter(model)


def _mtp_drafter(config: EngineConfig, target: CausalLM, device: torch.device, dtype: torch.dtype
                 ) -> BuiltDrafter:
    """MTP heads: streamed by the trainer, or loaded from an MTP export directory (``draft_path``)."""
    from megatron_spec.draft.mtp import load_mtp_head
    from megatron_spec.draft.mtp_head import MtpHead

    if config.draft_path:
        head = load_mtp_head(config.draft_path, target.cfg, dtype=dtype, num_layers=config.mtp_num_layers,
                             device=device)
        version = INITIAL_DRAFT_VERSION
    else:
        head = MtpHead(target.cfg, config.mtp_num_layers).to(device, dtype).eval()
        version = None
    return BuiltDrafter(MtpDrafter(head, target, config.k), version)


def draft_module(drafter: Drafter | None) -> torch.nn.Module | None:
    """The module holding ``drafter``'s weights (what weight updates load into); None: it has none."""
    if isinstance(drafter, ModelDrafter):
        return drafter.model
    if isinstance(drafter, (Eagle3Drafter, MtpDrafter)):
        return drafter.head
    return None
