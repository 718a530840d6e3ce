"""The decoder architecture of an HF checkpoint, read from its ``config.json``.

Supported families: Llama (``LlamaForCausalLM``), Qwen2 (``Qwen2ForCausalLM``) and Qwen3
(``Qwen3ForCausalLM``): RMSNorm, SwiGLU MLP, rotary embeddings with a theta (Llama 3.x
frequency scaling included), grouped-query attention, Qwen2's q/k/v biases, Qwen3's per-head
q/k RMSNorm, tied or untied embeddings.

Both config.json dialects are read: transformers < 5 (``rope_theta``, ``rope_scaling``) and
transformers >= 5 (``rope_parameters``). Nothing here imports transformers or megatron-core:
the Megatron builder, the weight converter and the native rollout engine all start from
:class:`DecoderConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Llama 3.x frequency scaling as megatron-core implements it (RotaryEmbedding._apply_scaling
# fixes low/high frequency factors and the original context); other values cannot be built.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this package cannot build."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A Llama-family decoder, as far as building and running it needs."""

    architecture: str
    """HF architecture name, e.g. ``Qwen3ForCausalLM``."""
    family: str
    """``llama`` | ``qwen2`` | ``qwen3``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    rope_scaling_factor: float | None = None
    """Llama 3.x frequency scaling factor, None when RoPE is unscaled."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count as stored in the checkpoint (tied embeddings counted once)."""
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise a clear error if ``tp`` cannot shard this model's heads."""
        if tp < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
        if self.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_attention_heads "
                             f"{self.num_attention_heads} of {self.architecture}")
        if self.num_kv_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_key_value_heads "
                             f"{self.num_kv_heads} of {self.architecture} (Megatron shards whole "
                             f"query groups)")
        if self.intermediate_size % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide intermediate_size "
                             f"{self.intermediate_size}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DecoderConfig:
        """Parse an HF ``config.json`` dictionary; errors name ``source``."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if not archs and model_type in by_type:
                arch = by_type[model_type]
            else:
                raise UnsupportedModelError(
                    f"{source}: architectures {archs or model_type!r} not supported; "
                    f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise UnsupportedModelError(f"{source}: missing required field {key!r} for {arch}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)

        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        scaling_factor = None
        if rope_type == "llama3":
            for key, expected in _MEGATRON_LLAMA3_ROPE.items():
                if float(rope.get(key, expected)) != expected:
                    raise UnsupportedModelError(
                        f"{source}: llama3 rope scaling with {key}={rope.get(key)} is not supported "
                        f"(megatron-core implements {key}={expected})")
            scaling_factor = float(rope["factor"])
        elif rope_type not in ("default", None):
            raise UnsupportedModelError(f"{source}: rope_type {rope_type!r} is not supported "
                                        f"(supported: default, llama3)")

        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not "
                                        f"supported (SwiGLU with silu only)")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported")

        if family != "qwen2" and cfg.get("attention_bias"):
            # Megatron's add_bias_linear would also add MLP biases the checkpoint lacks.
            raise UnsupportedModelError(f"{source}: attention_bias=true is not supported for {arch}")
        qkv_bias = family == "qwen2"  # Qwen2 always has q/k/v biases and none on o_proj

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family == "qwen3",
            rope_scaling_factor=scaling_factor,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=str(dtype),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DecoderConfig:
        """Read ``<path>/config.json`` (or ``path`` itself if it is a JSON file)."""
        path = os.fspath(path)
        cfg_path = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json at {cfg_path}")
        with open(cfg_path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as exc:
                raise UnsupportedModelError(f"{cfg_path}: not valid JSON ({exc})") from exc
        return cls.from_hf_dict(cfg, source=cfg_path)
