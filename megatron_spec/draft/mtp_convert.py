"""Megatron MTP parameter names (``mtp.layers.{k}.*``) <-> DeepSeek-V3's HF names (``model.layers.{L+k}.*``).

The transformer layer of depth k maps like decoder layer ``L + k`` of the policy (the same
``megatron_spec.models.convert`` rules and TP layouts); the MTP-only tensors (``enorm``, ``hnorm``,
``eh_proj``, the final norm as ``shared_head.norm``) are copies, ``eh_proj`` split over TP by output rows.

It knows names, shapes and TP layouts only: no modules, no tensors held, no files.
"""

from __future__ import annotations

import dataclasses

from megatron_spec.draft.mtp_head import mtp_layer_prefix
from megatron_spec.models.convert import ParamRule, canonical_name, megatron_rules
from megatron_spec.models.hf_config import DecoderConfig


def _to_decoder_name(name: str, num_target_layers: int) -> str | None:
    parts = name.split(".", 4)  # mtp, layers, k, transformer_layer, rest
    if len(parts) == 5 and parts[0] == "mtp" and parts[3] == "transformer_layer":
        return f"decoder.layers.{num_target_layers + int(parts[2])}.{parts[4]}"
    return None


def mtp_param_rules(cfg: DecoderConfig, num_layers: int, tp_size: int) -> dict[str, ParamRule]:
    """Megatron MTP parameter (``mtp.layers.{k}.*``, local-spec names) -> HF mapping.

    The transformer layer of depth k maps like decoder layer ``L + k`` of the policy (the same
    TP layouts), the MTP-only tensors are copies (``eh_proj`` split over TP by output rows).
    """
    h, big_l = cfg.hidden_size, cfg.num_layers
    deep = megatron_rules(
        dataclasses.replace(cfg, num_layers=big_l + num_layers),
        tp_size,
        padded_vocab=cfg.vocab_size * tp_size,
    )  # vocabulary rules unused here
    rules: dict[str, ParamRule] = {}
    for k in range(num_layers):
        src = f"decoder.layers.{big_l + k}."
        for name, rule in deep.items():
            if name.startswith(src):
                meg = f"mtp.layers.{k}.transformer_layer.{name[len(src) :]}"
                rules[meg] = dataclasses.replace(rule, megatron_name=meg)
        p = mtp_layer_prefix(cfg, k)
        for meg, hf, shape, dim in (
            (f"mtp.layers.{k}.enorm.weight", f"{p}.enorm.weight", (h,), None),
            (f"mtp.layers.{k}.hnorm.weight", f"{p}.hnorm.weight", (h,), None),
            (f"mtp.layers.{k}.final_layernorm.weight", f"{p}.shared_head.norm.weight", (h,), None),
            (f"mtp.layers.{k}.eh_proj.weight", f"{p}.eh_proj.weight", (h, 2 * h), 0),
        ):
            rules[meg] = ParamRule(
                meg, (hf,), dim, shape, lambda full, hf=hf: {hf: full.contiguous()}, lambda t, hf=hf: t[hf]
            )
    return rules


def canonical_mtp_name(name: str, num_target_layers: int) -> str:
    """TransformerEngine names of an MTP transformer layer -> local-spec names (via the decoder mapping)."""
    dec = _to_decoder_name(name, num_target_layers)
    if dec is None:
        return name
    canon = canonical_name(dec)
    head, rest = canon.split(".", 3)[2], canon.split(".", 3)[3]
    return f"mtp.layers.{int(head) - num_target_layers}.transformer_layer.{rest}"


__all__ = ["canonical_mtp_name", "mtp_param_rules"]
