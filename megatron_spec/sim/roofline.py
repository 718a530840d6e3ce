"""Roofline cost of one forward pass of an inference engine, and of one decode/verify step.

A forward over T tokens (b sequences x q tokens each) on one engine of ``tp x ep`` devices costs,
per device, the sum of three kernel classes, each bound by memory or by compute:

    GEMMs      max(weight bytes read / BW,  2 N_active T / FLOP/s)
    attention  max(KV bytes read / BW,      attn_flops_per_ctx * q * ctx_sum / FLOP/s)
    logits     T * V * 4 B * 3 passes / BW  (fp32 logits, softmax, sampling / rejection)

plus tensor-parallel all-reduces (2 per layer) and expert-parallel all-to-alls (dispatch and
combine per MoE layer), and a host overhead: a fixed cost per forward, plus a per-layer launch
cost when the forward has more tokens than the engine captures in CUDA graphs.
BW and FLOP/s are peak x the fitted efficiencies (GPUs) or the measured figures (``cpu``).
On the CPU, GEMMs are not a max of two bounds: each call costs a fixed ``gemm_call_s`` (oneDNN
dispatch, thread fork/join) plus its weight bytes / ``weight_bw`` scaled by the measured curve
t(n)/t(1) of a linear stack over the n tokens in the forward (interpolated in log n; past the
table's last point the time grows linearly in n, compute-bound). All three are measured by
benchmarks/measure_cpu_profile.py; none is fitted to engine speedups.

MoE weights: a forward reads the always-active weights plus each *touched* expert once; with
uniform routing of T tokens to top-k of E experts, the expected touched fraction is
1 - (1 - k/E)^T. So verifying k+1 tokens on an MoE touches more experts than decoding one:
speculation pays less on MoE at moderate batch, which this term captures.

Step costs: autoregressive decode = one forward at q=1; speculative step = a verify forward at
q=k+1, plus the draft (EAGLE-3 / MTP / draft model: a first pass over the k+1 verified positions,
then k-1 passes of one token; n-gram: host-side proposer time, per step and per running sequence).

What it does not know: kernel fusion details, overlap of communication with compute,
scheduler stalls, routing imbalance, prefix caching.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_spec.sim.hardware import DTYPE_BYTES, HardwareProfile, canonical_dtype
from megatron_spec.sim.models import ModelProfile
from megatron_spec.sim.params import EfficiencyParams, EngineSettings

DRAFT_KINDS = ("eagle3", "mtp", "model", "ngram")


@dataclass(frozen=True)
class Parallelism:
    """One engine = ``max(tp, ep)`` devices: attention and dense weights split ``tp`` ways
    (replicated ``engine_devices / tp`` times as data-parallel attention groups), routed
    experts split ``ep`` ways."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"tp={self.tp} and ep={self.ep} must be >= 1")
        big, small = max(self.tp, self.ep), min(self.tp, self.ep)
        if big % small:
            raise ValueError(f"tp={self.tp} and ep={self.ep}: the smaller must divide the larger "
                             "(an engine spans max(tp, ep) devices)")

    @property
    def engine_devices(self) -> int:
        return max(self.tp, self.ep)

    @property
    def attn_groups(self) -> int:
        return self.engine_devices // self.tp


def expected_distinct_experts(num_experts: int, top_k: int, n_tokens) -> np.ndarray:
    """Expected number of distinct experts one MoE layer touches when ``n_tokens`` tokens are each
    routed to ``top_k`` of ``num_experts`` experts, uniformly and independently:

        E (1 - (1 - top_k / E)^n)

    (each expert is missed by one token with probability 1 - top_k/E). A decode step of B
    sequences routes n = B tokens; a verify step of k+1 tokens per sequence routes n = B(k+1),
    so it streams more expert weights at small and moderate B and the same at large B, where
    every expert is touched anyway. Real routers are not uniform (popular experts), which makes
    the true count lower: this is the upper end for a given n."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k={top_k} <= num_experts={num_experts}")
    n = np.asarray(n_tokens, dtype=float)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


def _curve(tokens, curve: dict[int, float]):
    """Measured t(n)/t(1) of a linear stack at ``tokens`` (log-n interpolation, linear beyond)."""
    ns = np.array(sorted(curve), dtype=float)
    rs = np.array([curve[int(n)] for n in ns], dtype=float)
    t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    inside = np.interp(np.log(np.minimum(t, ns[-1])), np.log(ns), rs)
    return np.where(t > ns[-1], rs[-1] * t / ns[-1], inside)


class ForwardModel:
    """Per-device time of engine forwards for one (model, hardware, parallelism, dtype)."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, eff: EfficiencyParams,
                 settings: EngineSettings, par: Parallelism, dtype: str = "bf16", measured=None) -> None:
        self.model, self.hw, self.eff, self.settings, self.par = model, hw, eff, settings, par
        self.measured = measured
        """``sim.measured.MeasuredForwards`` of this forward on this GPU, or None: the roofline alone."""
        self.dtype = canonical_dtype(dtype)
        self.wbytes = DTYPE_BYTES[self.dtype]
        self.flops = hw.peak_flops(self.dtype) * eff.flop_eff
        self.mem_bw = hw.mem_bw * eff.mem_eff
        wbw = (hw.weight_bw or {}).get(self.dtype)
        self.weight_bw = wbw * eff.mem_eff if wbw else self.mem_bw
        extra = hw.extra or {}
        self.gemm_curve = extra.get("gemm_curve", {}).get(self.dtype)
        self.gemm_call_s = extra.get("gemm_call_s", {}).get(self.dtype, 0.0)
        if par.engine_devices > 1:
            within = par.engine_devices <= hw.scaleup_domain
            self.comm_bw = hw.link_bw if within else hw.net_bw
            self.comm_lat = hw.link_latency_s if within else hw.net_latency_s
        else:
            self.comm_bw, self.comm_lat = float("inf"), 0.0

    # ---- memory footprint --------------------------------------------------------------------
    def weight_bytes_per_device(self) -> float:
        m, par = self.model, self.par
        embed = 0 if m.tie_embeddings else m.embed_params
        dense = (m.always_read_params + embed) / par.tp
        experts = m.routed_expert_params / par.ep
        return (dense + experts) * self.wbytes

    def kv_bytes_per_token_per_device(self) -> float:
        """KV bytes one cached token of one sequence occupies on each device holding it."""
        m = self.model
        shard = min(self.par.tp, m.kv_shard_limit)
        return m.kv_bytes_per_token(self.settings.kv_dtype_bytes) / shard

    # ---- attention bandwidth (measured per query count on CPU) -------------------------------
    def _attn_bw(self, q: int) -> float:
        table = (self.hw.attn_bw or {}).get(self.dtype)
        if not table:
            return self.mem_bw
        keys = sorted(table)
        below = [k for k in keys if k <= q]
        return table[below[-1] if below else keys[0]] * self.eff.mem_eff

    # ---- one forward -------------------------------------------------------------------------
    def forward(self, b, q: int, ctx_sum, fixed_overhead_s: float) -> dict[str, np.ndarray]:
        """Seconds per component for forwards of ``b`` sequences x ``q`` tokens whose KV caches
        hold ``ctx_sum`` tokens in total (arrays broadcast). Where a measured point covers ``(b, q)``
        (``sim.measured``), ``total`` is the measurement moved to this context by the roofline's
        difference, and ``measured`` is True; the components stay the roofline's."""
        out = self._roofline(b, q, ctx_sum, fixed_overhead_s)
        out["measured"] = np.zeros(np.shape(out["total"]), dtype=bool)
        if self.measured is not None:
            t, hit = self.measured.lookup(b, q)
            if hit.any():
                b_arr = np.asarray(b, dtype=float)
                at_measured = self._roofline(b_arr, q, b_arr * self.measured.ctx_per_seq, fixed_overhead_s)[
                    "total"
                ]
                moved = np.maximum(t + out["total"] - at_measured, 0.5 * t)
                out["total"] = np.where(hit, moved, out["total"])
                out["measured"] = hit & np.ones(np.shape(out["total"]), dtype=bool)
        return out

    def _roofline(self, b, q: int, ctx_sum, fixed_overhead_s: float) -> dict[str, np.ndarray]:
        m, par = self.model, self.par
        b = np.asarray(b, dtype=float)
        ctx_sum = np.asarray(ctx_sum, dtype=float)
        G, D = par.engine_devices, par.attn_groups
        T = b * q  # tokens in the engine's forward
        Ta = T / D  # tokens per attention (data-parallel) group
        # GEMMs: always-read weights + touched experts.
        w_bytes = m.always_read_params * self.wbytes / par.tp
        touched = np.zeros_like(T)
        if m.is_moe:
            # fraction of experts a forward's T routed tokens touch; each device streams its
            # E/ep experts' share of them once per forward
            touched = expected_distinct_experts(m.num_experts, m.experts_per_tok, T) / m.num_experts
            w_bytes = (
                w_bytes + m.moe_layers * (m.num_experts / par.ep) * touched * m.expert_params * self.wbytes
            )
        gemm_comp = 2.0 * m.active_params * T / G / self.flops
        if self.gemm_curve:  # measured CPU curve plus a fixed cost per GEMM call
            calls = m.gemm_calls_per_forward
            if m.is_moe:
                calls = calls + m.moe_layers * 2 * m.num_experts / par.ep * touched
            gemm = np.maximum(
                calls * self.gemm_call_s + w_bytes / self.weight_bw * _curve(T, self.gemm_curve), gemm_comp
            )
        else:
            gemm = np.maximum(w_bytes / self.weight_bw, gemm_comp)
        # Attention over the KV cache (each sequence's cache is read once per forward).
        kv_bytes = ctx_sum * self.kv_bytes_per_token_per_device() / D
        fused_q = self.settings.fused_verify_max_q
        if fused_q and q > fused_q:
            kv_bytes = kv_bytes * q  # unfused fallback: the cache is read once per query token
        attn_flops = m.attn_flops_per_ctx * q * ctx_sum / G
        if m.linear_state_elems:
            # recurrent state (bf16, split over tp by value heads): a decode step reads and writes
            # it once; a verify step reads it once and writes one snapshot per verified position
            # (kept for rollback to the accepted prefix).
            passes = 2.0 if q == 1 else 1.0 + q
            kv_bytes = kv_bytes + (b / D) * m.linear_state_elems * 2 * passes / par.tp
        attn = np.maximum(kv_bytes / self._attn_bw(q), attn_flops / self.flops)
        # Logits: fp32, vocab-parallel; written once and read by softmax and the sampler.
        logits = Ta * m.vocab * 4 * 3 / par.tp / self.mem_bw
        # Collectives.
        comm = np.zeros_like(T)
        if par.tp > 1:
            ar_bytes = Ta * m.hidden * 2
            comm = comm + m.layers * 2 * (self.comm_lat + 2 * (par.tp - 1) / par.tp * ar_bytes / self.comm_bw)
        if par.ep > 1 and m.is_moe:
            a2a_bytes = (T / G) * m.experts_per_tok * m.hidden * 2 * (par.ep - 1) / par.ep
            comm = comm + m.moe_layers * 2 * (self.comm_lat + a2a_bytes / self.comm_bw)
        # Host overhead: fixed per forward; per-layer launches when not captured in a graph.
        eager = Ta > self.settings.graph_max_tokens
        overhead = fixed_overhead_s + np.where(eager, self.eff.eager_layer_overhead_s * m.layers, 0.0)
        total = gemm + attn + logits + comm + overhead
        return {"gemm": gemm, "attn": attn, "logits": logits, "comm": comm, "overhead": overhead,
                "total": total, "eager": eager, "weight_bytes": w_bytes, "kv_bytes": kv_bytes,
                "distinct_experts": touched * m.num_experts}


class StepModel:
    """Decode-step costs of one engine: autoregressive, and speculative with a given draft."""

    def __init__(self, target: ForwardModel, draft: ForwardModel | None, draft_kind: str | None,
                 k: int) -> None:
        if draft_kind is not None and draft_kind not in DRAFT_KINDS:
            raise ValueError(f"unknown draft kind {draft_kind!r}; expected one of {', '.join(DRAFT_KINDS)}")
        if draft_kind is not None and k < 1:
            raise ValueError(f"num_draft_tokens k={k} must be >= 1")
        if draft_kind in ("eagle3", "mtp", "model") and draft is None:
            raise ValueError(f"draft kind {draft_kind!r} needs a draft network")
        self.target, self.draft, self.kind, self.k = target, draft, draft_kind, k

    def ar_step(self, b, ctx_sum) -> dict[str, np.ndarray]:
        f = self.target.forward(b, 1, ctx_sum, self.target.eff.step_overhead_s)
        zero = np.zeros_like(f["total"])
        return {"verify": f["total"], "draft": zero, "host": zero, "total": f["total"], "eager": f["eager"]}

    def spec_step(self, b, ctx_sum) -> dict[str, np.ndarray]:
        k, eff = self.k, self.target.eff
        v = self.target.forward(b, k + 1, ctx_sum, eff.step_overhead_s)
        draft = np.zeros_like(v["total"])
        host = np.zeros_like(v["total"])
        if self.kind == "ngram":
            host = host + eff.ngram_s_per_step + eff.ngram_s_per_seq * np.asarray(b, dtype=float)
        else:
            # First draft pass re-reads the k+1 verified positions, then k-1 one-token passes.
            first = self.draft.forward(b, k + 1, ctx_sum, eff.draft_pass_overhead_s)["total"]
            draft = draft + first
            if k > 1:
                draft = (
                    draft + (k - 1) * self.draft.forward(b, 1, ctx_sum, eff.draft_pass_overhead_s)["total"]
                )
        return {"verify": v["total"], "draft": draft, "host": host, "total": v["total"] + draft + host,
                "eager": v["eager"]}

    def prefill(self, sequences: float, prompt_len: int, with_draft: bool) -> float:
        """Time to prefill ``sequences`` prompts (one batched pass; chunking overhead ignored)."""
        if sequences <= 0 or prompt_len <= 0:
            return 0.0
        ctx = sequences * prompt_len / 2.0  # mean causal context per prompt token
        t = float(self.target.forward(sequences, prompt_len, ctx, self.target.eff.step_overhead_s)["total"])
        if with_draft and self.draft is not None:
            t += float(
                self.draft.forward(sequences, prompt_len, ctx, self.target.eff.draft_pass_overhead_s)["total"]
            )
        return t
