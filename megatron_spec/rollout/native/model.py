"""The native engine's decoder: Llama / Qwen2 / Qwen3 in plain PyTorch with a KV cache.

:class:`CausalLM` stacks the layers of ``megatron_spec.layers`` (same math as transformers'
models, laid out for inference: q/k/v fused into ``qkv_proj`` and gate/up into
``gate_up_proj``, the layout SGLang and vLLM use) over the slot cache of
``megatron_spec.layers.kv_cache.KVCache``.

A forward can also return the outputs of chosen decoder layers (the auxiliary hidden
states EAGLE-3 fuses) and compute logits only at chosen positions (a prefill needs only the
last one).

Weights arrive by HF name (:meth:`CausalLM.load_weights`), from a checkpoint or from a
weight-update payload; an unknown or missing name is an error, never skipped.

This module does not know about requests, sampling or drafting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from megatron_spec.layers import linear
from megatron_spec.layers.decoder import (
    DecoderLayer,
    LayerPlan,
    RMSNorm,
    Rotary,
    cat_rows,
    gather_rows,
)
from megatron_spec.layers.fused_layers import fused_input, fused_stack
from megatron_spec.layers.kv_cache import KVCache, attention_mask, read_length, tree_attention_mask
from megatron_spec.layers.linear import Linear, PanelEmbedding, TiedLinear
from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.rollout.native.hf_weights import HFWeights


@dataclasses.dataclass
class Segment:
    """One rectangular group of rows of a forward (see :meth:`CausalLM.forward_segments`):
    ``input_ids``/``positions [B, T]`` of slots ``slot_offset..slot_offset+B-1``, ``kv_lens [B]``
    valid cache entries per row after the forward, ``logits_index [B, T']`` the positions whose
    logits are wanted (None: all).

    A tree of new tokens (``tree_attention_mask``) also gives ``cache_positions [B, T]``, where each
    token's K/V is written (``positions`` are then its RoPE positions, equal on sibling branches),
    and ``visible [B, T, T]``, which new tokens each one attends to; ``kv_lens`` must cover every
    written position.

    ``pack [B, T]`` (bool; None: all) marks the tokens that really run: a verify whose rows draft
    different lengths pays the projections and the MLP for ``B + sum(k_b)`` tokens, not
    ``B (k_max + 1)`` (attention still reads the padded layout). Logits and aux at the other
    positions are zeros; with ``logits_index``, the logits of those positions alone (each one a
    position the segment runs): a padded prefill runs its prompts' tokens, not the padding."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor
    slot_offset: int = 0
    logits_index: torch.Tensor | None = None
    cache_positions: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    pack: torch.Tensor | None = None


def _unpack(rows: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    """A segment's flat rows -> ``[b, t', ...]``; a packed segment's rows scattered back into its
    ``[b, t]`` layout, zeros elsewhere."""
    if plan.pack is None:
        return rows.view(plan.b, -1, rows.shape[-1])
    full = rows.new_zeros(plan.b * plan.t, rows.shape[-1]).index_copy_(0, plan.pack, rows)
    return full.view(plan.b, plan.t, -1)


def _packed_rows(seg: Segment) -> torch.Tensor:
    """Where the positions ``seg.logits_index [b, t']`` (of the ``[b, t]`` layout) lie among a packed
    segment's rows; each must be one the segment runs."""
    b, t = seg.input_ids.shape
    runs = seg.pack.reshape(-1)
    flat = ((torch.arange(b, device=runs.device) * t).unsqueeze(1) + seg.logits_index).reshape(-1)
    if not bool(runs[flat].all()):
        raise ValueError("logits_index asks for a position its packed segment does not run")
    return (runs.cumsum(0) - 1)[flat]


class CausalLM(HFWeights, nn.Module):
    """The target model of the native engine."""

    def __init__(self, cfg: DecoderConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = PanelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.tied_head = TiedLinear(self.embed_tokens) if cfg.tie_word_embeddings else None
        """The tied LM head: the embedding table, packed for oneDNN like every Linear (no parameter of its
        own)."""
        self.rotary = Rotary(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                             cfg.rope_scaling_factor)
        self.compiled = None
        """:class:`~megatron_spec.layers.compiled.CompiledLayers` once :meth:`compile_layers` is called."""
        self._fused: tuple | None = None
        """(key, ``layers.fused_layers.fused_stack``'s result) of the last forward that asked
        (:meth:`_run_fused`)."""

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of final-normed hidden states, through the LM head or the tied embedding table."""
        return (self.lm_head(normed) if self.lm_head is not None else self.tied_head(normed)).float()

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache(self.cfg.num_layers, num_slots, self.cfg.num_kv_heads, max_len, self.cfg.head_dim,
                       dtype or self.embed_tokens.weight.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        kv_lens: torch.Tensor,
        *,
        logits_index: torch.Tensor | None = None,
        aux_layers: Sequence[int] = (),
        slot_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens of the batch in slots ``slot_offset..slot_offset+B-1``.

        Args:
            input_ids, positions: ``[B, T]`` (padded rows are fine: their extra positions are
                beyond ``kv_lens`` and never attended to).
            kv_lens: ``[B]`` valid cache length per row after this forward.
            logits_index: ``[B, T']`` positions (into T) whose logits are wanted; None = all.
            aux_layers: decoder-layer ids whose *outputs* are returned (EAGLE-3's aux states).

        Returns:
            logits ``[B, T', V]`` float32 and aux ``[B, T, len(aux_layers) * H]`` (or None).
        """
        seg = Segment(input_ids, positions, kv_lens, slot_offset, logits_index)
        return self.forward_segments([seg], cache, aux_layers=aux_layers)[0]

    def forward_segments(self, segments: Sequence[Segment], cache: KVCache, *, aux_layers: Sequence[int] = ()
                         ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over several segments of different shapes (e.g. the running rows' verify
        tokens ``[B, k+1]`` and newly admitted prompts ``[P, L]``): every weight is read once for
        all of them, attention runs per segment. Returns :meth:`forward`'s output per segment.

        Why: decode on a CPU (as on a GPU) is bound by reading the weights; a prompt prefilled
        on its own pays a whole pass over them, while riding along with a decode step it costs
        little more than its own arithmetic (SGLang's and vLLM's mixed prefill/decode batches).
        """
        plans = [self._plan(s, cache) for s in segments]
        # Only the rows whose logits are wanted need the last layer's output (unless it is an
        # aux layer): the others need its keys and values, not its attention output or MLP.
        last = len(self.layers) - 1
        rows = [s.logits_index if s.logits_index is not None and last not in aux_layers and p.pack is None
                else None for s, p in zip(segments, plans)]
        x = cat_rows(  # the segments' flat rows [sum n, H], a packed segment's running tokens only
            [
                self.embed_tokens(
                    s.input_ids.reshape(-1)
                    if p.pack is None
                    else s.input_ids.reshape(-1).index_select(0, p.pack)
                )
                for s, p in zip(segments, plans)
            ]
        )
        aux: list[list[torch.Tensor]] = [[] for _ in segments]
        x = self._run_layers(x, plans, rows, cache, aux_layers, aux)
        outs = self._wanted_rows(x, segments, plans, rows)
        logits = self.head(self.norm(cat_rows(outs)))
        order = sorted(aux_layers)
        result = []
        for s, p, lg, a in zip(segments, plans, logits.split([o.shape[0] for o in outs]), aux):
            aux_out = torch.cat([a[order.index(i)] for i in aux_layers], -1) if aux_layers else None
            result.append(
                (_unpack(lg, p) if s.logits_index is None else lg.view(p.b, -1, lg.shape[-1]), aux_out)
            )
        return result

    @staticmethod
    def _plan(s: Segment, cache: KVCache) -> LayerPlan:
        """What every layer needs to know about segment ``s``: its cache write rows and attention mask
        (shared by all layers) and, when packed, the flat indices of the tokens it runs."""
        read_len = read_length(s.kv_lens, cache.max_len)
        if s.cache_positions is None:
            write, mask = s.positions, attention_mask(s.positions, s.kv_lens, read_len)
        else:
            write, mask = s.cache_positions, tree_attention_mask(s.cache_positions, s.visible, read_len)
        pack = None
        if s.pack is not None:
            pack = s.pack.reshape(-1).nonzero()[:, 0]
        return LayerPlan(*s.input_ids.shape, s.positions, s.kv_lens, read_len, s.slot_offset,
                         cache.write_index(write, s.slot_offset), mask, pack)

    def _run_layers(self, x: torch.Tensor, plans: list[LayerPlan], rows: list[torch.Tensor | None],
                    cache: KVCache, aux_layers: Sequence[int], aux: list[list[torch.Tensor]]) -> torch.Tensor:
        """Every decoder layer over the segments' flat rows ``x [sum n, H]``: the compiled layers or the C++
        stack where one plain segment allows, the Python layers for the rest. The last layer keeps only
        ``rows[j]`` of segment j where that is not None. Appends segment j's aux layer outputs to
        ``aux[j]`` (in layer order); returns the last layer's output."""
        last = len(self.layers) - 1
        no_rows = [None] * len(plans)
        seg_rows = [p.n for p in plans]
        weights = self._compiled_weights(plans)
        done = 0
        if weights is not None:  # one plain segment: the compiled layers (layers.compiled)
            done = last if rows[0] is not None else last + 1
            cos, sin = self.rotary.tables(plans[0].positions, x.dtype)
            flat: list[torch.Tensor] = []
            x = self.compiled.run(x, plans[0], cos, sin, cache, range(done), weights, aux_layers, flat)
            aux[0].extend(_unpack(a, plans[0]) for a in flat)
        elif len(plans) == 1 and plans[0].pack is None:  # the layers in C++ where they can run there
            done, x = self._run_fused(
                x, plans[0], cache, last if rows[0] is not None else last + 1, aux_layers, aux[0]
            )
        with self.rotary.reuse_tables():
            for i, layer in enumerate(self.layers[done:], start=done):
                x = layer.forward_flat(x, plans, self.rotary, cache, i, rows if i == last else no_rows)
                if i in aux_layers:
                    for j, part in enumerate(x.split(seg_rows)):
                        aux[j].append(_unpack(part, plans[j]))
        return x

    def _wanted_rows(self, x: torch.Tensor, segments: Sequence[Segment], plans: list[LayerPlan],
                     rows: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Per segment, the rows of the last layer's output ``x`` whose logits are wanted, ``[n', H]``."""
        h = self.cfg.hidden_size
        outs = []
        for p, s, r, part in zip(plans, segments, rows, x.split([p.n if r is None else p.b * r.shape[1]
                                                                  for p, r in zip(plans, rows)])):
            if p.pack is not None:
                outs.append(part if s.logits_index is None else part.index_select(0, _packed_rows(s)))
                continue
            part = part.view(p.b, -1, h)
            outs.append((gather_rows(part, s.logits_index) if s.logits_index is not None and r is None
                         else part).reshape(-1, h))
        return outs

    def _run_fused(
        self,
        x: torch.Tensor,
        plan: LayerPlan,
        cache: KVCache,
        stop: int,
        aux_layers: Sequence[int],
        aux: list[torch.Tensor],
    ) -> tuple[int, torch.Tensor]:
        """Layers ``0..stop-1`` over ``x`` through ``megatron_spec::decoder_layers``
        (``layers.fused_layers.fused_stack`` says whether they may run there), the aux layers' outputs
        appended to ``aux``. Returns how many layers ran and their output (0 and ``x``: none ran)."""
        if cache.dtype != x.dtype or not fused_input(x):  # the C++ layer writes K/V as they are
            return 0, x
        # the layers' part of the check and the argument lists (~0.3-0.5 ms for SmolLM2's 30 layers) hold
        # until
        # a Linear is packed again or the model changes dtype
        key = (stop, x.dtype, linear.PACK_EPOCH)
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, fused_stack(self.layers[:stop], x))
        stack = self._fused[1]
        if stack is None:
            return 0, x
        weights, biases = stack
        c, attn = self.cfg, self.layers[0].self_attn
        cos, sin = self.rotary.tables(plan.positions, x.dtype)
        out, flat = torch.ops.megatron_spec.decoder_layers(
            x,
            weights,
            biases,
            cache.k[:stop],
            cache.v[:stop],
            plan.write_index,
            cos,
            sin,
            plan.mask,
            plan.b,
            plan.t,
            plan.read_len,
            plan.slot_offset,
            c.num_attention_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            self.layers[0].input_layernorm.eps,
            attn.scale,
            sorted({i for i in aux_layers if i < stop}),
        )
        aux.extend(_unpack(a, plan) for a in flat)
        return stop, out

    def compile_layers(self, enable: bool = True) -> None:
        """Run plain single-segment forwards through the decoder layer compiled by ``torch.compile``
        (:mod:`megatron_spec.layers.compiled`; CPU, weights packed for oneDNN), or stop doing so."""
        if not enable:
            self.compiled = None
            return
        from megatron_spec.layers.compiled import CompiledLayers

        c = self.cfg
        self.compiled = CompiledLayers(self.layers, (c.num_attention_heads, c.num_kv_heads, c.head_dim,
                                                     c.intermediate_size, c.rms_norm_eps))

    def _compiled_weights(self, plans: Sequence[LayerPlan]) -> list | None:
        if (self.compiled is None or len(plans) != 1 or plans[0].pack is not None or plans[0].slot_offset
                or torch.is_grad_enabled() or self.device.type != "cpu"):
            return None
        return self.compiled.weights()
