"""Multi-token-prediction heads in plain PyTorch, for the native engine (same math as megatron-core).

megatron-core's ``MultiTokenPredictionLayer`` (DeepSeek-V3's MTP module), depth k = 1..D::

    x    = eh_proj(cat(enorm(embed(x_{p+k})), hnorm(h_{k-1, p})))   [.., 2H] -> [.., H]
    y    = decoder_layer(x)                                  causal attention over rows p, RoPE position p
    h_k  = final_layernorm(y)                                fed to depth k+1 and to the output layer
    logits_k = lm_head(h_k)                                  predicts x_{p+k+1}

with ``h_0`` the target's *final-normed* hidden state (megatron's decoder output includes the final
layernorm) and the embedding and output layer shared with the target. Each depth keeps its own
KV cache (one :class:`KVCache` per depth).

Weights travel under DeepSeek-V3's HF names, layer ``L + k`` of the target's ``L`` layers
(``model.layers.{L+k}.enorm.weight``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` for the final
layernorm, and the usual decoder-layer names). The shared ``embed_tokens`` / ``shared_head.head``
copies DeepSeek checkpoints carry are not sent: the engine uses the target's.

This module knows no Megatron (``megatron_spec.draft.mtp`` maps Megatron parameters to these names)
and no scheduling (``MtpDrafter`` in the native engine's ``drafters.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_spec.layers.decoder import DecoderLayer, RMSNorm, Rotary
from megatron_spec.layers.kv_cache import KVCache, read_length
from megatron_spec.layers.linear import Linear
from megatron_spec.models.hf_config import DecoderConfig

if TYPE_CHECKING:
    from megatron_spec.sync.fingerprint import Fingerprint

ARCHITECTURE = "MegatronSpecMTP"
"""``architectures`` entry of an MTP export's config.json (see ``megatron_spec.draft.mtp.save_mtp``)."""


def mtp_layer_prefix(target_cfg: DecoderConfig, depth: int) -> str:
    """HF name prefix of MTP depth ``depth`` (0-based): ``model.layers.{L + depth}``."""
    return f"model.layers.{target_cfg.num_layers + depth}"


class MtpLayer(nn.Module):
    """One MTP depth: enorm/hnorm, ``eh_proj``, a decoder layer of the target's architecture, final norm."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        cache: KVCache,
        kv_lens: torch.Tensor,
        slot_offset: int = 0,
    ) -> torch.Tensor:
        """``embeds``, ``hidden``: ``[B, T, H]`` (embedding of ``x_{p+k}``, ``h_{k-1,p}``); ``positions``
        ``[B, T]``; ``kv_lens`` ``[B]`` valid cache rows after this call. Returns ``h_k`` ``[B, T, H]``."""
        dtype = self.eh_proj.weight.dtype
        x = self.eh_proj(torch.cat([self.enorm(embeds.to(dtype)), self.hnorm(hidden.to(dtype))], dim=-1))
        read_len = read_length(kv_lens, cache.max_len)  # host sync, as the target's forward
        x = self.layer(x, positions, rotary, cache, 0, kv_lens, read_len, slot_offset)
        return self.final_layernorm(x)


class MtpHead(nn.Module):
    """``num_layers`` MTP depths for a target of config ``target_cfg``."""

    def __init__(self, target_cfg: DecoderConfig, num_layers: int):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"mtp_num_layers must be >= 1, got {num_layers}")
        self.target_cfg = target_cfg
        self.layers = nn.ModuleList(MtpLayer(target_cfg) for _ in range(num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_caches(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        cfg = self.target_cfg
        dtype = dtype or self.layers[0].eh_proj.weight.dtype
        device = self.layers[0].eh_proj.weight.device
        return [
            KVCache(1, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device) for _ in self.layers
        ]

    # ------------------------------------------------------------------ weights by HF name
    def _views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf name, view of the parameter it fills)``; fused q/k/v and gate/up are split by rows.
        Computed on demand: the engine may swap parameter storage (memory release)."""
        cfg = self.target_cfg
        q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        for k, m in enumerate(self.layers):
            p = mtp_layer_prefix(cfg, k)
            layer = m.layer
            attn = layer.self_attn
            yield f"{p}.enorm.weight", m.enorm.weight
            yield f"{p}.hnorm.weight", m.hnorm.weight
            yield f"{p}.eh_proj.weight", m.eh_proj.weight
            yield f"{p}.shared_head.norm.weight", m.final_layernorm.weight
            yield f"{p}.input_layernorm.weight", layer.input_layernorm.weight
            w = attn.qkv_proj.weight
            yield f"{p}.self_attn.q_proj.weight", w.narrow(0, 0, q)
            yield f"{p}.self_attn.k_proj.weight", w.narrow(0, q, kv)
            yield f"{p}.self_attn.v_proj.weight", w.narrow(0, q + kv, kv)
            if attn.qkv_proj.bias is not None:
                bias = attn.qkv_proj.bias
                yield f"{p}.self_attn.q_proj.bias", bias.narrow(0, 0, q)
                yield f"{p}.self_attn.k_proj.bias", bias.narrow(0, q, kv)
                yield f"{p}.self_attn.v_proj.bias", bias.narrow(0, q + kv, kv)
            yield f"{p}.self_attn.o_proj.weight", attn.o_proj.weight
            if attn.q_norm is not None:
                yield f"{p}.self_attn.q_norm.weight", attn.q_norm.weight
                yield f"{p}.self_attn.k_norm.weight", attn.k_norm.weight
            yield f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight
            gu = layer.mlp.gate_up_proj.weight
            yield f"{p}.mlp.gate_proj.weight", gu.narrow(0, 0, f)
            yield f"{p}.mlp.up_proj.weight", gu.narrow(0, f, f)
            yield f"{p}.mlp.down_proj.weight", layer.mlp.down_proj.weight

    def named_export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._views()

    def expected_hf_names(self) -> set[str]:
        return {name for name, _ in self._views()}

    def export_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self._views()}

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, strict_complete: bool = True,
        fingerprint: Fingerprint | None = None,
    ) -> set[str]:
        """Copy HF-named MTP tensors in; returns the names loaded. ``fingerprint``: accumulate what was
        written, in the same pass as the copy (:meth:`Fingerprint.copy_in`).

        Raises:
            KeyError: a name this head does not have (never skipped silently).
            ValueError: a shape mismatch, a name given twice, or (``strict_complete``) missing names.
        """
        views = dict(self._views())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                dst = views.get(name)
                if dst is None:
                    raise KeyError(
                        f"unknown MTP weight {name} (expected {mtp_layer_prefix(self.target_cfg, 0)}.* .. "
                        f"{mtp_layer_prefix(self.target_cfg, self.num_layers - 1)}.*)"
                    )
                if name in loaded:
                    raise ValueError(f"MTP weight {name} given twice")
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"MTP weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                if fingerprint is None:
                    dst.copy_(tensor.to(dst.dtype))
                else:
                    fingerprint.copy_in(dst, tensor)
                loaded.add(name)
        if strict_complete:
            missing = sorted(set(views) - loaded)
            if missing:
                raise ValueError(f"MTP weights missing after load: {missing[:3]} ({len(missing)} in all)")
        return loaded


__all__ = ["ARCHITECTURE", "MtpHead", "MtpLayer", "mtp_layer_prefix"]
