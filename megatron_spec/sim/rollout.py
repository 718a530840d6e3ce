"""Generation time of one rollout engine: continuous batching over a synchronous batch.

The engine runs up to C sequences at once; each decode step advances every running sequence
by tau tokens (tau = 1 autoregressive, the mean accept length when speculating), so sequence i
needs n_i = l_i / tau steps. When one finishes, the next queued prompt takes its slot. The
batch therefore shrinks into a long tail while the last, longest sequences finish: the tail
runs at small batch, memory-bound, where verifying k+1 tokens costs about as much as one, and
is where speculation gains most; the full-batch bulk can be compute-bound, where it gains least.

Because every running sequence advances in lock-step, the schedule in *step* space does not
depend on step costs: it is computed first (admissions, finishes), then the batch size b and
the total cached context of each constant-batch interval are priced by the step model in one
vectorised call. Long intervals are cut into pieces of at most ``max_piece`` steps so the
growing context is priced accurately.

Streaming (async with policy lag >= 2): the engine never drains, C sequences are always
running, and a step's rollouts cost their share of steady-state throughput. The mean context of
a running sequence is then the length-biased mean P + E[l^2] / (2 E[l]).

What it does not know: per-sequence acceptance variance, preemption when the KV cache fills
(concurrency is set so the mean sequence fits), prefill interleaving (prefill is priced as one
batched pass).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

StepFn = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


@dataclass(frozen=True)
class GenerationResult:
    """Decode time of one engine and where it went."""

    decode_s: float
    verify_s: float
    draft_s: float
    host_s: float
    steps: float
    mean_batch: float  # step-weighted
    eager_step_fraction: float  # steps whose forward ran outside CUDA graphs

    def as_dict(self) -> dict:
        return {k: float(v) for k, v in self.__dict__.items()}


def schedule(lengths: np.ndarray, tau: float, concurrency: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and finish step of each sequence under continuous batching (admission order =
    array order)."""
    n = np.asarray(lengths, dtype=float) / tau
    R = len(n)
    start = np.zeros(R)
    finish = n.copy()
    if R > concurrency:
        heap = list(finish[:concurrency])
        heapq.heapify(heap)
        for i in range(concurrency, R):
            s = heapq.heappop(heap)
            start[i] = s
            finish[i] = s + n[i]
            heapq.heappush(heap, finish[i])
    return start, finish


def simulate_engine(lengths: np.ndarray, prompt_len: int, concurrency: int, tau: float,
                    step_fn: StepFn, max_piece: float = 256.0) -> GenerationResult:
    """Decode time of an engine generating ``lengths`` (tokens) with ``tau`` tokens per step."""
    if tau < 1.0:
        raise ValueError(f"tokens per step tau={tau} must be >= 1")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    start, finish = schedule(lengths, tau, concurrency)
    # Sweep events: +1 (and +start) at each start, -1 (and -start) at each finish.
    pos = np.concatenate([start, finish])
    d_b = np.concatenate([np.ones_like(start), -np.ones_like(finish)])
    d_s = np.concatenate([start, -start])
    order = np.argsort(pos, kind="stable")
    pos, d_b, d_s = pos[order], d_b[order], d_s[order]
    b_cum, s_cum = np.cumsum(d_b), np.cumsum(d_s)
    # keep the state after the last event at each position
    last = np.r_[pos[1:] != pos[:-1], True]
    pos, b_cum, s_cum = pos[last], b_cum[last], s_cum[last]
    lo, hi = pos[:-1], pos[1:]
    b, sum_start = b_cum[:-1], s_cum[:-1]
    keep = (b > 0.5) & (hi > lo)
    lo, hi, b, sum_start = lo[keep], hi[keep], b[keep], sum_start[keep]
    # cut long intervals into pieces
    n_pieces = np.maximum(1, np.ceil((hi - lo) / max_piece)).astype(int)
    idx = np.repeat(np.arange(len(lo)), n_pieces)
    k_in = np.arange(len(idx)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    width = (hi - lo)[idx] / n_pieces[idx]
    p_lo = lo[idx] + k_in * width
    mid = p_lo + width / 2
    bb, ss = b[idx], sum_start[idx]
    # cached tokens of the running sequences at the piece midpoint
    ctx_sum = bb * prompt_len + tau * (bb * mid - ss)
    cost = step_fn(bb, ctx_sum)
    steps = width.sum()
    return GenerationResult(
        decode_s=float((width * cost["total"]).sum()),
        verify_s=float((width * cost["verify"]).sum()),
        draft_s=float((width * cost["draft"]).sum()),
        host_s=float((width * cost["host"]).sum()),
        steps=float(steps),
        mean_batch=float((width * bb).sum() / steps) if steps else 0.0,
        eager_step_fraction=float((width * cost["eager"]).sum() / steps) if steps else 0.0,
    )


def simulate_streaming(total_tokens: float, mean_len: float, mean_sq_len: float, prompt_len: int,
                       concurrency: int, tau: float, step_fn: StepFn) -> GenerationResult:
    """Steady-state decode time for ``total_tokens`` when the engine always runs
    ``concurrency`` sequences (no tail)."""
    b = np.array([float(concurrency)])
    mean_ctx = prompt_len + mean_sq_len / (2.0 * mean_len)
    cost = step_fn(b, b * mean_ctx)
    steps = total_tokens / (tau * concurrency)
    return GenerationResult(
        decode_s=float(steps * cost["total"][0]), verify_s=float(steps * cost["verify"][0]),
        draft_s=float(steps * cost["draft"][0]), host_s=float(steps * cost["host"][0]),
        steps=float(steps), mean_batch=float(concurrency), eager_step_fraction=float(cost["eager"][0]))
