"""Decoder building blocks shared by the native engine's target model and the draft heads.

Same math as transformers' models (RMSNorm in fp32, rotate-half RoPE with Llama 3.x
frequency scaling, GQA, Qwen2 q/k/v biases, Qwen3 per-head q/k norms), laid out for
inference: q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (the layout
SGLang and vLLM use), attention over the slot cache of :class:`~megatron_spec.layers.kv_cache.KVCache`.
A :class:`DecoderLayer` runs one or several segments of rows at once (:class:`LayerPlan`), so
a forward can mix decode and prefill rows (``megatron_spec.rollout.native.model.CausalLM``).

It does not know about whole models, weight names, requests, sampling or drafting, nor when a stack of
layers may run as the extension's C++ layers (``megatron_spec.layers.fused_layers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_spec.layers.kv_cache import KVCache, attention_mask
from megatron_spec.layers.linear import Linear
from megatron_spec.models.hf_config import DecoderConfig


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
        return rms_norm(x, self.weight, self.eps)


_KERNELS: dict[str, bool] = {}


def kernel_available(op: str) -> bool:
    """Whether the extension's op ``megatron_spec::{op}`` runs here: ``megatron_spec._C`` built with it and
    not disabled (``MEGATRON_SPEC_FORCE_REFERENCE=1``); decided once per process and op (``_KERNELS``)."""
    if op not in _KERNELS:
        from megatron_spec._ext import compiled_ops_available

        _KERNELS[op] = compiled_ops_available() and hasattr(torch.ops.megatron_spec, op)
    return _KERNELS[op]


KERNEL_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""The dtypes the extension's norm, RoPE and attention kernels take, with the suffix of their op names."""


def norm_rope_kernels_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the extension's RMSNorm and RoPE for ``dtype`` (fp32 or bf16, ``csrc/norm_rope_cpu.cpp``, built
    together) run here."""
    return dtype in KERNEL_SUFFIX and kernel_available(f"rope_{KERNEL_SUFFIX[dtype]}")


def _eager_cpu_kernel(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """The dtype suffix of the extension's norm/RoPE kernels (``"f32"``, ``"bf16"``) when ``x`` and ``w`` are
    both fp32 or both bf16 on the CPU, no gradient is asked for, torch.compile is not tracing (it fuses
    torch's own arithmetic better than it could call an opaque op) and the kernels are built; else None."""
    if x.dtype != w.dtype or x.dtype not in KERNEL_SUFFIX or x.device.type != "cpu" or w.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None
    if torch.compiler.is_compiling() or not norm_rope_kernels_available(x.dtype):
        return None
    return KERNEL_SUFFIX[x.dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` as a function (the compiled layer, ``layers.compiled``, calls it too).

    On a CPU outside autograd it is the extension's one-pass kernel: fp32 (``rms_norm_f32``: 5x torch's
    composite ``rms_norm`` at decode sizes, 30x at a 1024-row prefill; results agree to fp32 rounding, the
    sum of squares accumulated in another order) or bf16 (``rms_norm_bf16``: the two bf16 roundings of
    the formula below, in one pass instead of eight ops)."""
    dtype = x.dtype
    kernel = _eager_cpu_kernel(x, weight)
    if kernel is not None:
        return getattr(torch.ops.megatron_spec, f"rms_norm_{kernel}")(x, weight, eps)
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)  # one op (fp32)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [B, n, T, d]`` with tables ``cos, sin [B, 1, T, d]`` (:meth:`Rotary.tables`).

    On a CPU outside autograd, in fp32 or bf16, it is the extension's one-pass kernel (``rope_f32`` /
    ``rope_bf16``, 4-7x the six torch ops below at decode and verify sizes): the same bits, products and sum
    rounded as these are."""
    if x.dim() == 4 and cos.dim() == 4 and sin.dtype == cos.dtype:
        kernel = _eager_cpu_kernel(x, cos)
        if kernel is not None:
            return getattr(torch.ops.megatron_spec, f"rope_{kernel}")(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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

    _memo: dict | None = None

    @contextlib.contextmanager
    def reuse_tables(self):
        """Within this block a lookup at the same ``positions`` tensor is made once (one forward: every
        layer rotates at the same positions, so 30 layers make one lookup instead of 30 - two gathers and
        two casts a layer). Nothing may modify a positions tensor in place inside the block."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, T, d]`` at ``positions [B, T]`` in ``dtype``."""
        memo, key = self._memo, (id(positions), dtype)
        if memo is not None and key in memo:
            return memo[key][1:]
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        if memo is not None:
            memo[key] = (positions, cos, sin)  # holds positions, so no other tensor takes its id in the block
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [B, n, T, d]`` (queries and keys alike, or both heads stacked on ``n``)."""
        return rotate(x, *self.tables(positions, x.dtype))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, nq, T, d]``, k ``[B, nkv, T, d]``, positions ``[B, T]``."""
        return self.apply(q, positions), self.apply(k, positions)


def gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention as two batched matmuls with an fp32 softmax.

    q ``[B, nq, T, d]``, k/v ``[B, nkv, L, d]`` (strided cache views are fine), mask
    ``[B, 1, T, L]`` (True = attend). Query head h uses KV head h // (nq / nkv), as in
    transformers. On CPU it beats ``scaled_dot_product_attention`` for batches of several queries a
    row (a batched verify) and in bf16 (:func:`use_fused_attention`; fp32 results agree to 1e-6).
    """
    b, nq, t, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    # [B, nkv, g*T, L]
    scores = torch.matmul(q.reshape(b, nkv, g * t, d), k.transpose(-1, -2)).float() * scale
    scores = scores.view(b, nkv, g, t, -1).masked_fill(~mask.view(b, 1, 1, t, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(b, nkv, g * t, -1)
    return torch.matmul(probs, v).view(b, nq, t, d)


def attention_kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the extension's attention for ``dtype`` (fp32 or bf16, ``csrc/attention_cpu.cpp``) runs here
    (:func:`kernel_available`)."""
    return dtype in KERNEL_SUFFIX and kernel_available(f"attention_{KERNEL_SUFFIX[dtype]}")


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention of ``q [B, nq, T, d]`` over ``k, v [B, nkv, L, d]`` with ``mask [B, 1, T, L]``
    (True = attend): in fp32 or bf16 on a CPU, where no gradient is asked for, the extension's kernel (one
    task a row and KV head, reading the cache views in place: fp32 1.2-2.6x faster than torch's kernels at
    decode and verify sizes on a 2-core AVX2 EPYC; bf16, arithmetic in fp32 inside, 1.6-20x on a 2-core
    Zen 4; ``csrc/attention_cpu.cpp``, ``benchmarks/bench_attention.py``), else torch's fused kernel or
    :func:`gqa_attention`, whichever :func:`use_fused_attention` says is faster for the shape. Results agree
    to the dtype's rounding."""
    b, _, t, _ = q.shape
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and not grad and attention_kernel_available(q.dtype):
        return getattr(torch.ops.megatron_spec, f"attention_{KERNEL_SUFFIX[q.dtype]}")(q, k, v, mask, scale)
    if use_fused_attention(q.dtype, b, t):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return gqa_attention(q, k, v, mask, scale)


def use_fused_attention(dtype: torch.dtype, b: int, t: int) -> bool:
    """Whether torch's ``scaled_dot_product_attention`` beats :func:`gqa_attention` for ``b`` rows of
    ``t`` queries. Measured with torch 2.13 on a 2-core AVX2 CPU (SmolLM2's 9 query / 3 KV heads of 64,
    cache 128-512): fp32, one query a row (decode) or one row (a batch-1 verify), the fused kernel
    takes 0.4-0.8x the time (B=1: 61 vs 146 us; B=16 decode: 423 vs 561 us), while several rows of
    several queries (a batched verify) take 1.2-2.7x longer in it (16 x 4: 1160 vs 861 us). Its bf16
    path is fast only for a single row (below 8 queries in all)."""
    if dtype == torch.float32:
        return t == 1 or b == 1
    return b * t < 8


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
        qk, v = qkv.split([(self.nq + self.nkv) * self.d, self.nkv * self.d], dim=-1)
        if self.q_norm is not None:
            q, k = qk.view(b, t, -1, self.d).split([self.nq, self.nkv], dim=2)
            # [B, n, T, d]
            q, k = rotary(self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), positions)
        else:  # queries and keys rotated in one go (the same elementwise arithmetic, half the ops)
            q, k = rotary.apply(qk.view(b, t, -1, self.d).transpose(1, 2), positions).split(
                [self.nq, self.nkv], 1
            )
        v = v.view(b, t, self.nkv, self.d).transpose(1, 2)
        if write_index is None:
            write_index = cache.write_index(positions, slot_offset)
        cache.write(layer, write_index, k, v)
        k_all, v_all = cache.view(layer, b, read_len, slot_offset)
        if rows is not None:
            t = rows.shape[1]
            q = q.gather(2, rows.view(b, 1, t, 1).expand(-1, self.nq, -1, self.d))  # [B, nq, T', d]
            positions = positions.gather(1, rows)
            if mask is not None:  # a given mask (a tree's) keeps the rows of the kept queries
                mask = mask.gather(2, rows.view(b, 1, t, 1).expand(-1, 1, -1, mask.shape[-1]))
        if mask is None:
            mask = attention_mask(positions, kv_lens, read_len)
        out = attend(q, k_all, v_all, mask, self.scale)
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
class LayerPlan:
    """What every layer of one forward needs to know about one segment of its rows (computed once):
    ``b x t`` rows at ``positions [b, t]`` of slots ``slot_offset..slot_offset+b-1``, ``kv_lens [b]``
    valid cache entries per row after the forward, the cache length ``read_len`` attention reads,
    and optionally the cache write rows and attention mask every layer shares."""

    b: int
    t: int
    positions: torch.Tensor
    kv_lens: torch.Tensor
    read_len: int
    slot_offset: int = 0
    write_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    pack: torch.Tensor | None = None
    """Flat indices (into ``b * t``) of the tokens this segment really runs, in order (None: all):
    the projections and the MLP see only these rows; attention scatters them back into the
    ``[b, t]`` layout (the others as zeros, whose K/V land beyond ``kv_lens`` and are never read)."""

    @property
    def n(self) -> int:
        """Rows this segment holds in a layer's flat input."""
        return self.b * self.t if self.pack is None else int(self.pack.numel())


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along rows, without a copy when there is only one part."""
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
        plan = LayerPlan(b, t, positions, kv_lens, read_len, slot_offset, write_index, mask)
        return self.forward_flat(x.reshape(b * t, h), [plan], rotary, cache, layer, [rows]).view(b, -1, h)

    def forward_flat(self, x: torch.Tensor, plans: Sequence[LayerPlan], rotary: Rotary, cache: KVCache,
                     layer: int, rows: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Segments laid end to end: ``x [N, H]`` holds each plan's ``B x T`` rows (or its packed
        rows, ``LayerPlan.pack``) in turn.

        The projections and the MLP run once over all of them (one pass over the weights);
        attention runs per segment over its slots. ``rows[j]``: as in :meth:`forward`, per
        segment. Returns ``[N', H]`` (N' counts only the kept rows)."""
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        sizes = [p.n for p in plans]
        outs, kept = [], []
        for p, part, xs, r in zip(plans, qkv.split(sizes), x.split(sizes), rows):
            if p.pack is not None:  # a packed segment: attention runs on the padded layout
                if r is not None:
                    raise ValueError("a packed segment computes every row it runs (rows must be None)")
                part = part.new_zeros(p.b * p.t, part.shape[-1]).index_copy_(0, p.pack, part)
            o = self.self_attn.attend(part.view(p.b, p.t, -1), p.positions, rotary, cache, layer, p.kv_lens,
                                      p.read_len, p.slot_offset, p.write_index, p.mask, r)
            o = o.reshape(-1, o.shape[-1])
            outs.append(o if p.pack is None else o.index_select(0, p.pack))
            kept.append(xs if r is None else gather_rows(xs.view(p.b, p.t, -1), r).reshape(-1, xs.shape[-1]))
        x = cat_rows(kept) + self.self_attn.o_proj(cat_rows(outs))
        return x + self.mlp(self.post_attention_layernorm(x))
