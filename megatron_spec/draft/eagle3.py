"""The EAGLE-3 draft head: one Llama decoder layer over [token embedding ; target features].

EAGLE-3 (Li et al. 2025, arXiv:2503.01840), in the layout ModelOpt 0.47 exports and SGLang runs
(``sglang/srt/models/llama_eagle3.py``; ModelOpt ``torch/speculative/plugins/modeling_eagle.py``
and ``hf_eagle.py``). Row t of a forward pairs the target's features at position p with the
embedding of the token at p + 1, and sits at RoPE position p:

    h0  = fc(cat(a_1, ..., a_n))                                  a_j = output of target layer ids[j]
    x   = cat(input_layernorm(e), hidden_norm(h))                 [.., 2H] -> q/k/v projections
    h1  = h + o_proj(attn(x))                                     the residual is h, not x
    h2  = h1 + mlp(post_attention_layernorm(h1))
    q   = lm_head(norm(h2))                                        draft logits, draft vocabulary

``h`` is ``h0`` for rows whose features come from the target, and the draft's own ``h2`` of the
previous row for later draft steps. ``h2`` is fed back *before* the final norm: SGLang's
``LlamaModel.forward`` returns ``norm(h, residual)``'s un-normed sum as the aux hidden state
("Draft decode captures pre-norm hidden by default"), and ModelOpt feeds ``eagle_prenorm_h``
into the next training-time-test step and into ``pseudo_speculative_generate``. The
``eagle_config.norm_output`` flag (EAGLE 3.1) feeds ``norm(h2)`` instead.

Reduced draft vocabulary: ``target_id = draft_id + d2t[draft_id]``.

One known disagreement between trainer and servers, reproduced here behind a flag: ModelOpt
0.47's HF trainer reuses ``LlamaDecoderLayer``, which applies ``input_layernorm`` to ``h``
before its attention pre-hook applies ``hidden_norm``, so it trains ``hidden_norm(input_layernorm(h))``;
SGLang, vLLM and the EAGLE reference run ``hidden_norm(h)``. The two agree (to RMSNorm's eps)
while ``input_layernorm.weight`` is all ones, which is why :mod:`megatron_spec.draft.modelopt_train`
keeps it frozen at ones. ``Eagle3Config.double_hidden_norm=True`` reproduces the trainer.

This module does not know files (see :mod:`megatron_spec.draft.modelopt_io`; the config is in
:mod:`megatron_spec.draft.eagle3_config`), sampling or scheduling; the KV cache is the native engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_spec.draft.eagle3_config import (
    ARCHITECTURE,
    Eagle3Config,
    check_d2t,
    default_aux_layer_ids,
)
from megatron_spec.draft.rope import ScaledRotary
from megatron_spec.layers.decoder import MLP, Attention, RMSNorm, gather_rows
from megatron_spec.layers.kv_cache import KVCache, read_length
from megatron_spec.layers.linear import Linear

if TYPE_CHECKING:
    from megatron_spec.sync.fingerprint import Fingerprint


class Eagle3Output(NamedTuple):
    logits: torch.Tensor
    """``[B, T', Vd]`` float32 draft logits (draft vocabulary)."""
    hidden: torch.Tensor
    """``[B, T, H]`` hidden state to feed the next draft step (pre-final-norm unless norm_output)."""
    kv: tuple[torch.Tensor, torch.Tensor]
    """This call's keys and values after RoPE, ``[B, nkv, T, d]`` each (for TTT unrolls)."""


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Keys visible to training-time-test step ``step`` (ModelOpt's ``get_ttt_msk_func``).

    Keys are the concatenation of steps ``0..step`` (``T`` each). Row q of step j sees step-0 keys
    at rows ``<= q - j`` (the verified context of its chain) and, for each step ``1 <= i <= j``,
    the key at row ``q - (j - i)`` (its own chain's earlier draft steps). Returns ``[T, (j+1) T]`` bool
    on ``device``.
    """
    q = torch.arange(seq_len, device=device).view(-1, 1)
    kv = torch.arange(seq_len * (step + 1), device=device).view(1, -1)
    mask = kv <= q - step
    for i in range(1, step + 1):
        mask |= (kv == q + i * seq_len - (step - i)) & (kv >= seq_len * i)
    return mask


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head (fc + one decoder layer + norm + lm_head) with an optional ``d2t``.

    It has no embedding: callers pass the target's token embeddings (:meth:`embed` uses a
    reference set with :meth:`set_target_embedding`, which is not a parameter of the head).
    """

    def __init__(self, cfg: Eagle3Config, *, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        layer_cfg = cfg.layer_config()
        self.fc = Linear(cfg.num_aux * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(layer_cfg, in_features=2 * h, qkv_bias=False, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = ScaledRotary(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling)
        if cfg.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None
        self.__dict__["_embed_weight"] = None  # not a parameter: the target owns it

    # ------------------------------------------------------------- helpers
    def set_target_embedding(self, weight: torch.Tensor | None) -> None:
        """Reference the target's ``[V, H]`` embedding for :meth:`embed` (not owned, not saved)."""
        if weight is not None and tuple(weight.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"target embedding has shape {tuple(weight.shape)}, expected "
                             f"({self.cfg.vocab_size}, {self.cfg.hidden_size})")
        self.__dict__["_embed_weight"] = weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target token embeddings ``[B, T, H]`` for ``input_ids [B, T]``."""
        weight = self.__dict__["_embed_weight"]
        if weight is None:
            raise RuntimeError(
                "Eagle3Head has no target embedding: call set_target_embedding(...) or pass embeddings"
            )
        return F.embedding(input_ids, weight)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``h0 = fc(aux)``: aux ``[..., n_aux * H]`` (target layer outputs in ``aux_layer_ids`` order) ->
        ``[..., H]``."""
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(f"aux hidden states have width {aux.shape[-1]}, expected {self.cfg.num_aux} x "
                             f"{self.cfg.hidden_size} = {self.fc.in_features}")
        return self.fc(aux.to(self.fc.weight.dtype))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without ``d2t``)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    @property
    def target_ids(self) -> torch.Tensor:
        """``[Vd]`` target id of every draft-vocabulary entry (SGLang's ``hot_token_id``)."""
        ids = torch.arange(self.cfg.draft_vocab_size, device=self.lm_head.weight.device)
        return ids if self.d2t is None else ids + self.d2t

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A one-layer slot KV cache for this head (same layout as the target's)."""
        return KVCache(1, num_slots, self.cfg.num_kv_heads, max_len, self.cfg.head_dim,
                       dtype or self.lm_head.weight.dtype, device=self.lm_head.weight.device)

    # ------------------------------------------------------------- math
    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden) if self.cfg.double_hidden_norm else hidden
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)  # [B, T, 2H]

    def _finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = hidden + attn_out
        h2 = h1 + self.mlp(self.post_attention_layernorm(h1))  # [B, T, H]
        normed = self.norm(h2)
        feed = normed if self.cfg.norm_output else h2
        return self.lm_head(normed).float(), feed

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        kv_lens: torch.Tensor,
        *,
        logits_index: torch.Tensor | None = None,
        slot_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Engine mode: new rows of slots ``slot_offset..slot_offset+B-1`` over the head's KV cache.

        Args:
            embeds: ``[B, T, H]`` target embeddings of the tokens at ``positions + 1``.
            hidden: ``[B, T, H]`` ``fuse(aux)`` at ``positions`` or the previous draft step's hidden.
            positions: ``[B, T]`` absolute positions (RoPE and cache rows).
            cache: from :meth:`new_cache`; kv_lens: ``[B]`` valid entries per row after this call.
            logits_index: ``[B, T']`` rows (into T) whose logits and hidden states are wanted;
                None = all. Every row's keys and values enter the cache either way; the other
                rows skip the attention output and the MLP (a draft-extend pass over the accepted
                tokens needs only the last row's, a prompt prefill none).

        Returns:
            draft logits ``[B, T', Vd]`` float32 and the hidden state ``[B, T', H]`` for the next step.
        """
        dtype = self.lm_head.weight.dtype
        embeds, hidden = embeds.to(dtype), hidden.to(dtype)
        read_len = read_length(kv_lens, cache.max_len)  # host sync, as the target's forward
        attn_out = self.self_attn(self._attention_input(embeds, hidden), positions, self.rotary, cache, 0,
                                  kv_lens, read_len, slot_offset, rows=logits_index)
        if logits_index is not None:
            hidden = gather_rows(hidden, logits_index)
        return self._finish(hidden, attn_out)

    def forward_full(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Eagle3Output:
        """Whole sequences without a cache (tests, training). Differentiable.

        Args:
            embeds, hidden: ``[B, T, H]`` as in :meth:`forward`.
            positions: ``[B, T]`` or ``[T]``; default ``0..T-1``.
            attn_mask: bool, broadcastable to ``[B, 1, T, S]`` with ``S = T + past keys``; True =
                attend. Default: causal over this call's rows, all of ``past_kv`` visible.
            past_kv: keys/values ``[B, nkv, S0, d]`` of earlier calls (e.g. earlier TTT steps)
                placed before this call's keys.
        """
        b, t, _ = embeds.shape
        dtype = self.lm_head.weight.dtype
        embeds, hidden = embeds.to(dtype), hidden.to(dtype)
        if positions is None:
            positions = torch.arange(t, device=embeds.device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(b, t)
        attn = self.self_attn
        qkv = attn.qkv_proj(self._attention_input(embeds, hidden))  # [B, T, (nq + 2 nkv) d]
        q, k, v = qkv.split([attn.nq * attn.d, attn.nkv * attn.d, attn.nkv * attn.d], dim=-1)
        q, k = self.rotary(q.view(b, t, attn.nq, attn.d).transpose(1, 2),
                           k.view(b, t, attn.nkv, attn.d).transpose(1, 2), positions)  # [B, n, T, d]
        v = v.view(b, t, attn.nkv, attn.d).transpose(1, 2)
        k_all, v_all = k, v
        s0 = 0
        if past_kv is not None:
            s0 = past_kv[0].shape[2]
            k_all, v_all = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        if attn_mask is None:
            attn_mask = torch.ones(t, s0 + t, dtype=torch.bool, device=embeds.device).tril(s0)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask, scale=attn.scale,
                                             enable_gqa=True)
        attn_out = attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.nq * attn.d))
        logits, feed = self._finish(hidden, attn_out)
        return Eagle3Output(logits, feed, (k, v))

    # ------------------------------------------------------------- weights by export name
    def named_export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in ModelOpt's export naming (q/k/v and gate/up split back out)."""
        cfg = self.cfg
        q, k, v = self.self_attn.qkv_proj.weight.split(
            [cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
             cfg.num_kv_heads * cfg.head_dim], dim=0)
        gate, up = self.mlp.gate_up_proj.weight.split([cfg.intermediate_size] * 2, dim=0)
        yield "fc.weight", self.fc.weight
        yield "layers.0.input_layernorm.weight", self.input_layernorm.weight
        yield "layers.0.hidden_norm.weight", self.hidden_norm.weight
        yield "layers.0.post_attention_layernorm.weight", self.post_attention_layernorm.weight
        yield "layers.0.self_attn.q_proj.weight", q
        yield "layers.0.self_attn.k_proj.weight", k
        yield "layers.0.self_attn.v_proj.weight", v
        yield "layers.0.self_attn.o_proj.weight", self.self_attn.o_proj.weight
        yield "layers.0.mlp.gate_proj.weight", gate
        yield "layers.0.mlp.up_proj.weight", up
        yield "layers.0.mlp.down_proj.weight", self.mlp.down_proj.weight
        yield "norm.weight", self.norm.weight
        yield "lm_head.weight", self.lm_head.weight
        if self.d2t is not None:
            yield "d2t", self.d2t

    def expected_hf_names(self) -> set[str]:
        """Names a complete weight update carries: every export tensor but ``d2t``, which
        engines read once at start-up (SGLang does) and which must not change afterwards."""
        return {name for name, _ in self.named_export_tensors() if name != "d2t"}

    def export_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected export name -> shape (``d2t`` only with a reduced vocabulary)."""
        return {name: tuple(t.shape) for name, t in self.named_export_tensors()}

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, strict_complete: bool = True,
        fingerprint: Fingerprint | None = None,
    ) -> set[str]:
        """Copy export-named tensors (``layers.0.*`` or legacy ``midlayer.*``) into the head.

        Returns the (canonical) names loaded. ``fingerprint``: accumulate the floating tensors as written (the
        parameters; ``d2t`` is a buffer), in the same pass as the copy (:meth:`Fingerprint.copy_in`).

        Raises:
            ValueError: an unknown name, a shape mismatch, an invalid ``d2t`` or (with
                ``strict_complete``) missing tensors, each named.
        """
        targets = {name: t for name, t in self.named_export_tensors()}
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                canon = canonical_name(name)
                if canon not in targets:
                    hint = " (the head has no d2t: draft_vocab_size == vocab_size)" if canon == "d2t" else ""
                    raise ValueError(f"unexpected tensor {name} for an EAGLE-3 head{hint}")
                if canon in loaded:
                    raise ValueError(f"tensor {canon} given twice (as {name})")
                dst = targets[canon]
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                if canon == "d2t":
                    check_d2t(tensor, self.cfg.vocab_size, self.cfg.draft_vocab_size, source=f"tensor {name}")
                    dst.copy_(tensor.long())
                else:
                    if not tensor.is_floating_point():
                        raise ValueError(f"tensor {name} has dtype {tensor.dtype}, expected a floating type")
                    if fingerprint is None:
                        dst.copy_(tensor.to(dst.dtype))
                    else:
                        fingerprint.copy_in(dst, tensor)
                loaded.add(canon)
        if strict_complete:
            missing = sorted(set(targets) - loaded)
            if missing:
                raise ValueError(f"missing tensor {missing[0]} in EAGLE-3 weights"
                                 + (f" ({len(missing)} missing: {missing})" if len(missing) > 1 else ""))
        return loaded


def canonical_name(name: str) -> str:
    """Legacy ``midlayer.`` names (older exports) -> ``layers.0.``."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def select_aux_hidden_states(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Fuse-ready aux features from transformers' ``output_hidden_states`` tuple.

    ``hidden_states[0]`` is the embedding output and ``hidden_states[i + 1]`` the output of layer
    ``i`` — except the last entry, which transformers replaces by the *final-normed* output, so
    the raw output of the last layer is not in the tuple (use a forward hook for it).

    Returns ``[B, T, len(layer_ids) * H]`` in ``layer_ids`` order.
    """
    num_layers = len(hidden_states) - 1
    for i in layer_ids:
        if not 0 <= i < num_layers - 1:
            raise ValueError(f"aux layer id {i}: transformers' hidden_states hold raw outputs of layers "
                             f"0..{num_layers - 2} only (entry {num_layers} is post-final-norm)")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


__all__ = [
    "ARCHITECTURE", "Eagle3Config", "Eagle3Head", "Eagle3Output", "canonical_name", "check_d2t",
    "default_aux_layer_ids", "select_aux_hidden_states", "ttt_attention_mask",
]
