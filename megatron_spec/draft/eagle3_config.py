"""Architecture of an EAGLE-3 draft as its exported ``config.json`` describes it, checked against the target.

Fields and flags follow ModelOpt 0.47's exporter (``export/plugins/hf_spec_configs.py``:
``llama_eagle_template_config``) and what SGLang's ``LlamaForCausalLMEagle3`` reads. Flags whose
math is not implemented (MTP norms, pre-fc norms, several layers, biases, quantisation) are
rejected with the flag's name rather than ignored. ``d2t`` is validated here too (one-to-one
into the target vocabulary).

It knows no tensors other than ``d2t`` and no files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from megatron_spec.capture.config import default_aux_layer_ids
from megatron_spec.draft.rope import rope_frequencies
from megatron_spec.models.hf_config import DecoderConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"


# config.json flags whose non-default value changes the math in a way no exporter we read produces.
_UNSUPPORTED_TRUE = {
    "use_mtp_layernorm": "MTP-style enorm/hnorm",
    "norm_before_fc": "an RMSNorm over the concatenated features before fc",
    "fc_norm": "per-feature RMSNorms before fc",
    "use_aux_norm": "per-feature RMSNorms before fc",
    "attention_bias": "q/k/v/o biases",
    "mlp_bias": "MLP biases",
    "tie_word_embeddings": "an lm_head tied to a draft embedding",
}


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Architecture of an EAGLE-3 draft head, as its config.json describes it."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary (the export's ``vocab_size``)."""
    draft_vocab_size: int
    """Rows of ``lm_head``; ``< vocab_size`` means a reduced vocabulary mapped through ``d2t``."""
    aux_layer_ids: tuple[int, ...]
    """0-based target decoder layers whose *outputs* are fused by ``fc``, in ``fc``'s input order."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """``None``, a ``rope_type: default`` or a YaRN dict, as exported; what the serving engine
    applies (see :mod:`.rope`). ModelOpt trains with plain RoPE whatever it exports."""
    max_position_embeddings: int = 4096
    norm_output: bool = False
    """Feed ``norm(h2)`` (EAGLE 3.1) instead of ``h2`` to the next draft step."""
    double_hidden_norm: bool = False
    """Compute ``hidden_norm(input_layernorm(h))`` as ModelOpt 0.47's HF trainer does (not stored
    in exports; SGLang/vLLM semantics when False)."""
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The rest of config.json (token ids, transformers_version, ...), written back on save."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"eagle3 {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"eagle3 num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"eagle3 draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}"
            )
        if not self.aux_layer_ids:
            raise ValueError("eagle3 eagle_aux_hidden_state_layer_ids is empty")
        if len(set(self.aux_layer_ids)) != len(self.aux_layer_ids):
            raise ValueError(
                f"eagle3 eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} has duplicates"
            )
        rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)  # raises on unsupported RoPE

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    def layer_config(self) -> DecoderConfig:
        """The draft layer as a Llama :class:`DecoderConfig` (for the native Attention/MLP modules)."""
        return DecoderConfig(
            architecture="LlamaForCausalLM",
            family="llama",
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            qkv_bias=False,
            qk_norm=False,
        )

    @classmethod
    def for_target(cls, target: DecoderConfig, draft_vocab_size: int, **kw: Any) -> Eagle3Config:
        """A head shaped like one layer of ``target`` (its widths, heads and vocabulary) reading
        ModelOpt's default aux layers; ``kw`` sets any other field."""
        kw.setdefault("aux_layer_ids", default_aux_layer_ids(target.num_layers))
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            **kw,
        )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json",
                     target_num_layers: int | None = None) -> Eagle3Config:
        """Parse an exported draft ``config.json``.

        ``target_num_layers`` supplies ModelOpt's default feature layers when the export has no
        ``eagle_config.eagle_aux_hidden_state_layer_ids``.

        Raises:
            ValueError: a missing field or a flag whose math is not implemented (named).
        """
        cfg = dict(cfg)
        archs = cfg.get("architectures") or []
        if archs and ARCHITECTURE not in archs:
            raise ValueError(
                f"{source}: architectures {archs} is not an EAGLE-3 draft (expected {ARCHITECTURE})"
            )
        eagle = dict(cfg.get("eagle_config") or {})
        _reject_unsupported(cfg, eagle, source)
        hidden = int(_need(cfg, "hidden_size", source))
        if cfg.get("target_hidden_size") not in (None, hidden):
            raise ValueError(
                f"{source}: target_hidden_size {cfg['target_hidden_size']} != hidden_size {hidden} "
                f"is not supported"
            )
        heads = int(_need(cfg, "num_attention_heads", source))
        ids = _aux_layer_ids(eagle, source, target_num_layers)
        rope = _rope(cfg, source)
        vocab = int(_need(cfg, "vocab_size", source))
        extra = _extra_fields(cfg, eagle)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_need(cfg, "intermediate_size", source)),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            aux_layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.theta if rope.theta is not None else 10000.0),
            rope_scaling=rope.scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            norm_output=bool(eagle.get("norm_output", cfg.get("norm_output", False))),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            extra=extra,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents in ModelOpt's export layout (unknown fields of a parsed file kept)."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
                               "num_hidden_layers": 1, "tie_word_embeddings": False}
        out.update({k: v for k, v in self.extra.items() if k != "eagle_config"})
        out.update(
            {
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
                "max_position_embeddings": self.max_position_embeddings,
                "torch_dtype": self.torch_dtype,
            }
        )
        eagle = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                 "use_last_layernorm": True, "use_mtp_layernorm": False}
        eagle.update(self.extra.get("eagle_config", {}))
        eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if self.norm_output:
            eagle["norm_output"] = True
        out["eagle_config"] = eagle
        return out

    def validate_against(self, target: DecoderConfig, *, source: str = "eagle3 config") -> None:
        """Check this draft fits ``target``.

        Raises:
            ValueError: naming the field and both values.
        """
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size} in {source}"
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size} "
                             f"in {source}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(
                f"draft eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} out of range for "
                f"a target with {target.num_layers} layers (valid 0..{target.num_layers - 1}) "
                f"in {source}"
            )


# ---------------------------------------------------------------------- config.json parsing steps
_KNOWN_FIELDS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "torch_dtype", "dtype", "eagle_config"}
"""config.json fields :class:`Eagle3Config` holds as its own; the rest travel in ``extra``."""


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{source}: missing required field {key!r}")
    return cfg[key]


def _reject_unsupported(cfg: dict[str, Any], eagle: dict[str, Any], source: str) -> None:
    """Raise, naming the flag, for a config.json whose math the head does not implement."""
    for key, what in _UNSUPPORTED_TRUE.items():
        if cfg.get(key) or eagle.get(key):
            raise ValueError(f"{source}: {key}=true ({what}) is not supported")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{source}: num_hidden_layers {cfg['num_hidden_layers']} is not supported "
                         f"(EAGLE-3 drafts with one decoder layer only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("quantization_config"):
        raise ValueError(f"{source}: quantized drafts (quantization_config) are not supported")
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError(f"{source}: eagle_config.use_aux_hidden_state=false is EAGLE-1/2, not EAGLE-3")
    if eagle.get("use_input_layernorm_in_first_layer") is False:
        raise ValueError(
            f"{source}: eagle_config.use_input_layernorm_in_first_layer=false (no hidden_norm) "
            f"is not supported"
        )
    if eagle.get("use_last_layernorm") is False:
        raise ValueError(f"{source}: eagle_config.use_last_layernorm=false is not supported (ModelOpt's "
                         f"exporter requires norm.weight and SGLang always applies it)")


def _aux_layer_ids(eagle: dict[str, Any], source: str, target_num_layers: int | None) -> Sequence[int]:
    """The export's feature layers, or ModelOpt's default for a target of ``target_num_layers``."""
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        if target_num_layers is None:
            raise ValueError(f"{source}: no eagle_config.eagle_aux_hidden_state_layer_ids and no target "
                             f"layer count to derive ModelOpt's default from")
        ids = default_aux_layer_ids(target_num_layers)
    return ids


class _Rope(NamedTuple):
    theta: Any
    """``rope_theta`` as exported (top level, else inside the scaling dict); None if neither has it."""
    scaling: dict[str, Any] | None
    """``rope_scaling`` (or ``rope_parameters``) as exported, copied; None if absent."""


def _rope(cfg: dict[str, Any], source: str) -> _Rope:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    rope = dict(rope) if rope else None
    theta = cfg.get("rope_theta")
    if theta is None and rope is not None:
        theta = rope.get("rope_theta")
    if rope is not None and rope.get("rope_theta") not in (None, theta):
        raise ValueError(f"{source}: rope_scaling.rope_theta {rope['rope_theta']} != rope_theta {theta}")
    return _Rope(theta, rope)


def _extra_fields(cfg: dict[str, Any], eagle: dict[str, Any]) -> dict[str, Any]:
    """The rest of config.json (written back on save), ``eagle_config`` without what the head holds."""
    extra = {k: v for k, v in cfg.items() if k not in _KNOWN_FIELDS}
    extra["eagle_config"] = {
        k: v for k, v in eagle.items() if k not in ("eagle_aux_hidden_state_layer_ids", "norm_output")
    }
    return extra


def check_d2t(d2t: torch.Tensor, vocab_size: int, draft_vocab_size: int, *, source: str = "d2t") -> None:
    """``d2t`` must map the draft vocabulary one-to-one into ``[0, vocab_size)``.

    Raises:
        ValueError: wrong shape or dtype, a target id out of range (named), or two draft ids
            mapped to one target id.
    """
    if d2t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{source} has dtype {d2t.dtype}, expected int64")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"{source} has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    target_ids = torch.arange(draft_vocab_size, device="cpu") + d2t.long().cpu()  # checked on the host
    bad = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{source} out of range: draft id {i} maps to target id {int(target_ids[i])}, "
                         f"outside [0, {vocab_size}) ({bad.numel()} ids out of range)")
    if torch.unique(target_ids).numel() != draft_vocab_size:
        raise ValueError(f"{source} maps several draft ids to the same target id")
