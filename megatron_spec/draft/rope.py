"""RoPE frequencies of an EAGLE-3 draft as its serving engine computes them (default and YaRN).

ModelOpt 0.47 trains the draft with plain RoPE but, by default, writes a YaRN ``rope_scaling``
(``{"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}``,
``EagleConfig.eagle_export_rope_scaling``) into the exported config.json, so every consumer of
the export runs the draft with YaRN. The consumer this module follows is SGLang
(``srt/layers/rotary_embedding/yarn.py``, ``YaRNScalingRotaryEmbedding``; the factory passes
``original_max_position_embeddings`` as the YaRN base context and the optional keys
``extrapolation_factor, attn_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate``):

    inv_freq_i = (1 - m_i) / (s * theta^(2i/d)) + m_i / theta^(2i/d)
    m_i        = (1 - clamp((i - lo) / (hi - lo), 0, 1)) * extrapolation_factor
    lo, hi     = floor/ceil of d * ln(L0 / (2 pi beta)) / (2 ln theta) for beta = beta_fast, beta_slow
    cos, sin   = cos(p * inv_freq) * a, sin(p * inv_freq) * a,  a = (0.1 ln s + 1) * attn_factor

(YaRN, Peng et al. 2023, arXiv:2309.00071). The attention factor ``a`` multiplies both q and k,
so YaRN also sharpens the attention logits by ``a^2`` (1.81 for s = 32) at every position.

This module knows RoPE math only; it does not know checkpoints or models.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_spec.layers.decoder import Rotary

# Keys SGLang's YaRN factory reads; any other key (e.g. transformers' "attention_factor", which
# SGLang ignores and transformers honours) would make the two consumers disagree.
YARN_KEYS = frozenset({"rope_type", "type", "factor", "original_max_position_embeddings", "rope_theta",
                       "extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "truncate"})


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """``"default"`` for no scaling, else the dict's ``rope_type`` (or legacy ``type``)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` (float32) and the cos/sin multiplier.

    Raises:
        ValueError: an unsupported ``rope_type`` or YaRN key (named in the message).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    pos_freqs = theta ** exponent  # [d/2]
    kind = rope_type_of(scaling)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported for an EAGLE-3 draft "
                         f"(supported: default, yarn)")
    assert scaling is not None
    unknown = set(scaling) - YARN_KEYS
    if unknown:
        raise ValueError(f"yarn rope_scaling key(s) {sorted(unknown)} are not supported "
                         f"(SGLang reads only {sorted(YARN_KEYS)})")
    if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise ValueError("yarn rope_scaling needs 'factor' and 'original_max_position_embeddings'")
    s = float(scaling["factor"])
    base_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))
    extrapolation = float(scaling.get("extrapolation_factor", 1))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(base_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # as SGLang: avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = (1 - ramp) * extrapolation  # 1 = extrapolate (high frequency), 0 = interpolate
    inv_freq = (1.0 / (s * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    if scaling.get("mscale") is not None and scaling.get("mscale_all_dim") is not None:
        mult = _yarn_mscale(s, float(scaling["mscale"])) / _yarn_mscale(s, float(scaling["mscale_all_dim"]))
    else:
        mult = _yarn_mscale(s)
    return inv_freq, float(mult * float(scaling.get("attn_factor", 1)))


class ScaledRotary(Rotary):
    """The native engine's :class:`Rotary` (same rotate-half application) with default/YaRN tables."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__(head_dim, 1, theta, None)
        inv_freq, mult = rope_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [P, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        self.attention_scaling = mult
        self.register_buffer("cos", emb.cos() * mult, persistent=False)
        self.register_buffer("sin", emb.sin() * mult, persistent=False)
