"""The native engine's decoder: Llama / Qwen2 / Qwen3 in plain PyTorch with a KV cache.

Same math as transformers' models (RMSNorm in fp32, rotate-half RoPE with Llama 3.x
frequency scaling, GQA, Qwen2 q/k/v biases, Qwen3 per-head q/k norms), laid out for
inference: q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (the layout
SGLang and vLLM use), attention over the slot cache of ``kv_cache.KVCache``.

A forward can also return the outputs of chosen decoder layers (the auxiliary hidden
states EAGLE-3 fuses) and compute logits only at chosen positions (a prefill needs only the
last one).

Weights arrive by HF name (:meth:`CausalLM.load_weights`), from a checkpoint or from a
weight-update payload; an unknown or missing name is an error, never skipped.

This module does not know about requests, sampling or drafting.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.rollout.native.kv_cache import KVCache, attention_mask, read_length


def _mkldnn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear(nn.Module):
    """``y = x W^T + b`` with W stored transposed (``weight_t [in, out]``, contiguous), and an
    optional oneDNN-prepacked copy for inference.

    Why: at decode sizes (1-64 rows) a plain ``F.linear`` on CPU re-lays-out the weight on every
    call (bf16, oneDNN) or takes MKL's slow small-M path (fp32 on this AMD CPU); a weight packed
    once into oneDNN's blocked format runs 2-12x faster and gives the same fp32 result as
    ``x @ W^T`` (measured: benchmarks/bench_rollout.py). :meth:`pack` builds it after weights
    change (the engine calls it after every load); it is used only when autograd is off, so
    training the same module (the EAGLE-3 head) takes the plain path. ``weight`` is the usual
    ``[out, in]`` view, for loading and export.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight_t, std=0.02)
        self._packed: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def pack(self, batch_hint: int = 16) -> bool:
        """Prepack the weight for oneDNN (CPU, fp32/bf16); returns whether it is packed."""
        w = self.weight_t
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or w.numel() == 0
                or not _mkldnn_packing_available()):
            self._packed = None
            return False
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous(), batch_hint)
        return True

    def unpack(self) -> None:
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and not torch.is_grad_enabled() and x.dtype == self.weight_t.dtype:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, self.bias,
                                                    "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        y = x @ self.weight_t
        return y + self.bias if self.bias is not None else y


def pack_linears(module: nn.Module, enable: bool = True) -> int:
    """(Re)pack every :class:`Linear` in ``module`` (or drop the packed copies); returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            n += m.pack() if enable else (m.unpack() or 0)
    return n


def warm_linears(modules: Iterable[nn.Module], max_rows: int, max_primitives: int | None = None) -> int:
    """Call every distinct packed :class:`Linear` shape once per input row count ``1..max_rows``.

    Why: oneDNN builds a primitive for each input shape on the first call with it (0.3-0.9 ms
    per linear on this CPU, against 0.05-0.2 ms for a call) and caches it by shape, across
    weight updates and modules. A speculative engine meets many row counts (B for a decode,
    B(k+1) for a verify, B x pending tokens for a draft extend), so without this its first
    generate calls pay for building them: the GRPO demo's first three rollouts ran up to 25%
    slower than the later ones. ``max_primitives`` (default: 3/4 of oneDNN's primitive cache,
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` or 1024) caps the rows so warming evicts nothing.
    Returns the number of calls made.
    """
    shapes: dict[tuple, Linear] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, Linear) and m._packed is not None:
                shapes.setdefault((m.in_features, m.out_features, m.weight_t.dtype, m.bias is None), m)
    if not shapes:
        return 0
    if max_primitives is None:
        max_primitives = 3 * int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")) // 4
    rows = min(max_rows, max_primitives // len(shapes))
    with torch.inference_mode():
        for m in shapes.values():
            for r in range(1, rows + 1):
                m(torch.zeros(r, m.in_features, dtype=m.weight_t.dtype))
    return rows * len(shapes)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H]`` at ``rows [B, T']`` (indices into T) -> ``[B, T', H]``."""
    return x.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, llama3_factor: float | None = None) -> torch.Tensor:
    """RoPE inverse frequencies; Llama 3.x scaling with the (1, 4, 8192) factors megatron-core uses."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if llama3_factor is None:
        return inv
    low, high, old = 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / llama3_factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / llama3_factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables for all positions; applied rotate-half style (HF, Megatron non-interleaved)."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, llama3_factor: float | None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, llama3_factor)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)  # [P, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, nq, T, d]``, k ``[B, nkv, T, d]``, positions ``[B, T]``."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [B, 1, T, d]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([-x2, x1], dim=-1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention as two batched matmuls with an fp32 softmax.

    q ``[B, nq, T, d]``, k/v ``[B, nkv, L, d]`` (strided cache views are fine), mask
    ``[B, 1, T, L]`` (True = attend). Query head h uses KV head h // (nq / nkv), as in
    transformers. On CPU at decode sizes this is 1.5-4x faster than
    ``scaled_dot_product_attention`` (whose bf16 path is slow here; fp32 results agree to 1e-6).
    """
    b, nq, t, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    scores = torch.matmul(q.reshape(b, nkv, g * t, d), k.transpose(-1, -2)).float() * scale  # [B, nkv, g*T, L]
    scores = scores.view(b, nkv, g, t, -1).masked_fill(~mask.view(b, 1, 1, t, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(b, nkv, g * t, -1)
    return torch.matmul(probs, v).view(b, nq, t, d)


class Attention(nn.Module):
    """GQA self-attention over the slot cache. ``in_features`` is 2H for an EAGLE-3 layer."""

    def __init__(self, cfg: DecoderConfig, in_features: int | None = None, qkv_bias: bool | None = None,
                 qk_norm: bool | None = None):
        super().__init__()
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        in_features = in_features or cfg.hidden_size
        bias = cfg.qkv_bias if qkv_bias is None else qkv_bias
        self.qkv_proj = Linear(in_features, cfg.q_size + 2 * cfg.kv_size, bias=bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        use_qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if use_qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if use_qk_norm else None
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: KVCache, layer: int,
                kv_lens: torch.Tensor, read_len: int, slot_offset: int = 0,
                write_index: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Writes K/V of all ``T`` new tokens; returns the attention output ``[B, T, H]``, or
        ``[B, T', H]`` for the query rows ``rows [B, T']`` only (rows whose output nobody reads
        need their keys and values, not their queries: a draft's extend pass, a last layer)."""
        out = self.attend(self.qkv_proj(x), positions, rotary, cache, layer, kv_lens, read_len, slot_offset,
                          write_index, mask, rows)
        return self.o_proj(out)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: KVCache, layer: int,
               kv_lens: torch.Tensor, read_len: int, slot_offset: int = 0,
               write_index: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` between the two projections: ``qkv [B, T, (nq + 2 nkv) d]`` (the output
        of ``qkv_proj``) -> attention output ``[B, T', nq d]`` before ``o_proj``."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = q.view(b, t, self.nq, self.d)
        k = k.view(b, t, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), positions)  # [B, n, T, d]
        v = v.view(b, t, self.nkv, self.d).transpose(1, 2)
        if write_index is None:
            write_index = cache.write_index(positions, slot_offset)
        cache.write(layer, write_index, k, v)
        k_all, v_all = cache.view(layer, b, read_len, slot_offset)
        if rows is not None:
            t = rows.shape[1]
            q = q.gather(2, rows.view(b, 1, t, 1).expand(-1, self.nq, -1, self.d))  # [B, nq, T', d]
            positions = positions.gather(1, rows)
            mask = None
        if mask is None:
            mask = attention_mask(positions, kv_lens, read_len)
        if q.dtype == torch.float32 or b * t >= 8:
            out = gqa_attention(q, k_all, v_all, mask, self.scale)
        else:  # a single bf16 row: torch's fused kernel is the faster one
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, self.nq * self.d)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclasses.dataclass
class Segment:
    """One rectangular group of rows of a forward (see :meth:`CausalLM.forward_segments`):
    ``input_ids``/``positions [B, T]`` of slots ``slot_offset..slot_offset+B-1``, ``kv_lens [B]``
    valid cache entries per row after the forward, ``logits_index [B, T']`` the positions whose
    logits are wanted (None: all)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor
    slot_offset: int = 0
    logits_index: torch.Tensor | None = None


@dataclasses.dataclass
class _Plan:
    """What every layer of one forward needs to know about a segment (computed once)."""

    b: int
    t: int
    positions: torch.Tensor
    kv_lens: torch.Tensor
    read_len: int
    slot_offset: int = 0
    write_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rotary, cache, layer, kv_lens, read_len, slot_offset=0, write_index=None,
                mask=None, rows=None):
        """``rows [B, T']``: compute the output of those rows only (all rows' K/V are written)."""
        b, t, h = x.shape
        plan = _Plan(b, t, positions, kv_lens, read_len, slot_offset, write_index, mask)
        return self.forward_flat(x.reshape(b * t, h), [plan], rotary, cache, layer, [rows]).view(b, -1, h)

    def forward_flat(self, x: torch.Tensor, plans: Sequence[_Plan], rotary: Rotary, cache: KVCache, layer: int,
                     rows: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Segments laid end to end: ``x [N, H]`` holds each plan's ``B x T`` rows in turn.

        The projections and the MLP run once over all of them (one pass over the weights);
        attention runs per segment over its slots. ``rows[j]``: as in :meth:`forward`, per
        segment. Returns ``[N', H]`` (N' counts only the kept rows)."""
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        sizes = [p.b * p.t for p in plans]
        outs, kept = [], []
        for p, part, xs, r in zip(plans, qkv.split(sizes), x.split(sizes), rows):
            o = self.self_attn.attend(part.view(p.b, p.t, -1), p.positions, rotary, cache, layer, p.kv_lens,
                                      p.read_len, p.slot_offset, p.write_index, p.mask, r)
            outs.append(o.reshape(-1, o.shape[-1]))
            kept.append(xs if r is None else gather_rows(xs.view(p.b, p.t, -1), r).reshape(-1, xs.shape[-1]))
        x = _cat(kept) + self.self_attn.o_proj(_cat(outs))
        return x + self.mlp(self.post_attention_layernorm(x))


# HF name pieces that load into a fused parameter: (hf piece, fused piece, shard index)
STACKED = (
    ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
)


def _copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, written through the contiguous side when ``dst`` is a (narrowed) ``[out, in]``
    view of a transposed ``weight_t``: a strided write runs at ~0.3-1 GB/s here, while torch's blocked
    transpose copy into a contiguous destination (via a temporary for a narrowed slice) runs 3-4x
    faster (measured on this CPU, bf16 and fp32). Weight updates spend most of their engine time here."""
    if dst.dim() == 2 and dst.stride(0) == 1 and dst.shape[0] > 1 and dst.shape[1] > 1:
        dst_t = dst.t()  # rows contiguous
        dst_t.copy_(src.t() if dst_t.is_contiguous() else src.t().contiguous())
    else:
        dst.copy_(src)


class CausalLM(nn.Module):
    """The target model of the native engine."""

    def __init__(self, cfg: DecoderConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                             cfg.rope_scaling_factor)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache(self.cfg.num_layers, num_slots, self.cfg.num_kv_heads, max_len, self.cfg.head_dim,
                       dtype or self.embed_tokens.weight.dtype)

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
        last = len(self.layers) - 1
        plans, rows = [], []
        for s in segments:
            read_len = read_length(s.kv_lens, cache.max_len)
            plans.append(_Plan(*s.input_ids.shape, s.positions, s.kv_lens, read_len, s.slot_offset,
                               cache.write_index(s.positions, s.slot_offset),  # shared by all layers
                               attention_mask(s.positions, s.kv_lens, read_len)))
            # Only the rows whose logits are wanted need the last layer's output (unless it is an
            # aux layer): the others need its keys and values, not its attention output or MLP.
            rows.append(s.logits_index if s.logits_index is not None and last not in aux_layers else None)
        h = self.cfg.hidden_size
        x = _cat([self.embed_tokens(s.input_ids).reshape(-1, h) for s in segments])
        aux: list[list[torch.Tensor]] = [[] for _ in segments]
        no_rows = [None] * len(segments)
        seg_rows = [p.b * p.t for p in plans]
        for i, layer in enumerate(self.layers):
            x = layer.forward_flat(x, plans, self.rotary, cache, i, rows if i == last else no_rows)
            if i in aux_layers:
                for j, part in enumerate(x.split(seg_rows)):
                    aux[j].append(part.view(plans[j].b, plans[j].t, h))
        outs = []
        for p, s, r, part in zip(plans, segments, rows, x.split([p.b * (p.t if r is None else r.shape[1])
                                                                  for p, r in zip(plans, rows)])):
            part = part.view(p.b, -1, h)
            outs.append(gather_rows(part, s.logits_index) if s.logits_index is not None and r is None else part)
        sizes = [o.shape[1] for o in outs]
        normed = self.norm(_cat([o.reshape(-1, h) for o in outs]))
        logits = (F.linear(normed, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(normed)).float()
        order = sorted(aux_layers)
        result = []
        for p, n, lg, a in zip(plans, sizes, logits.split([p.b * n for p, n in zip(plans, sizes)]), aux):
            aux_out = torch.cat([a[order.index(i)] for i in aux_layers], -1) if aux_layers else None
            result.append((lg.view(p.b, n, -1), aux_out))
        return result

    # ---------------------------------------------------------------- weights
    def expected_hf_names(self) -> set[str]:
        from megatron_spec.models.convert import expected_hf_shapes

        return set(expected_hf_shapes(self.cfg))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict_complete: bool = True) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names loaded.

        Raises:
            KeyError: a name this model does not have (never skipped silently).
            ValueError: a shape that does not fit; with ``strict_complete``, names missing.
        """
        params = dict(self._weight_views())
        loaded: set[str] = set()
        cfg = self.cfg
        sizes = {"qkv_proj": (cfg.q_size, cfg.kv_size, cfg.kv_size),
                 "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        with torch.no_grad():
            for name, tensor in weights:
                if name == "lm_head.weight" and self.lm_head is None:
                    raise KeyError(f"lm_head.weight sent to a model with tied embeddings ({cfg.architecture})")
                target, shard = self._target(name)
                if target not in params:
                    raise KeyError(f"unknown weight {name} for {cfg.architecture} (no parameter {target})")
                param = params[target]
                if shard is None:
                    dst = param
                else:
                    piece, idx = shard
                    offset = sum(sizes[piece][:idx])
                    dst = param.narrow(0, offset, sizes[piece][idx])
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                _copy_weight(dst, tensor.to(dst.dtype))
                loaded.add(name)
        if strict_complete:
            missing = self.expected_hf_names() - loaded
            if missing:
                raise ValueError(f"weights missing after load: {sorted(missing)[:3]} ({len(missing)} in all)")
        return loaded

    def _weight_views(self):
        """``(name, tensor)`` of every parameter, linear weights as ``[out, in]`` views named ``*.weight``."""
        for name, p in self.named_parameters():
            if name.endswith(".weight_t"):
                yield name[: -len("_t")], p.t()
            else:
                yield name, p

    @staticmethod
    def _target(hf_name: str) -> tuple[str, tuple[str, int] | None]:
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        for piece, fused, idx in STACKED:
            token = f".{piece}."
            if token in name:
                return name.replace(token, f".{fused}."), (fused, idx)
        return name, None
