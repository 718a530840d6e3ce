"""The support of the processed distribution, from vocab-parallel logits.

Top-k / top-p / min-p remove tokens; the verifier's log-probs must be taken under exactly
the distribution the engine sampled from, which ``megatron_spec.speculative.process_logits`` defines
(mask -> temperature -> top-k -> top-p -> min-p, thresholds with ties kept). Under tensor
parallelism each rank holds a vocabulary slice, so:

* temperature only: nothing to mask;
* top-k > 0: the global k-th largest logit is the k-th largest of the union of the per-rank
  top-k lists (all-gathered, ``[B, S, tp * k]``); tokens at or above it form the top-k set
  (ties kept). Every kept set of process_logits is a value threshold, so top-p and min-p
  reduce to thresholds too: all values strictly above the k-th are among the candidates, and
  only the number of tokens tied at the k-th is all-reduced to renormalise exactly;
* top-p or min-p without top-k: the kept set can be most of the vocabulary; the rows are
  all-gathered (``[B, S, V]`` per rank for that micro-batch) and processed whole. RL runs
  usually sample with top_p = 1 (exact on-policy), which never takes this path.

Returns a boolean *exclude* mask over this rank's slice for
:func:`megatron_spec.capture.logprobs.vocab_parallel_token_logprobs`.

:func:`vocab_parallel_entropy_and_log_mass` reads two more quantities off the same mask, for
metrics and for engines that report unrenormalised log-probs: the entropy of the processed
distribution and the log of the mass the support keeps under the temperature-scaled
distribution (``log Z <= 0``; SGLang reports ``log p(t) + log Z`` for a sampled token t, see
``megatron_spec/rollout/sglang_protocol.py``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import _tp_info, scale_by_temperature
from megatron_spec.speculative import SamplingTensors, process_logits


def _all_gather(x: torch.Tensor, group, tp_size: int, dim: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def vocab_parallel_support_mask(logits: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int = 0,
                                top_p: float = 1.0, min_p: float = 0.0,
                                tp_group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """``[B, S, V_local]`` bool, True where the processed distribution is zero; None if nothing is cut.

    Greedy (temperature 0) is scored under the unscaled policy (see logprobs.py): no mask.
    """
    if temperature <= 0 or (top_k <= 0 and top_p >= 1.0 and min_p <= 0.0):
        return None
    tp_rank, tp_size = _tp_info(tp_group)
    b, s, v_local = logits.shape
    v_start = tp_rank * v_local
    x = scale_by_temperature(logits, 1.0)  # fp32; T is applied by process_logits below
    ids = torch.arange(v_start, v_start + v_local, device=x.device)
    x = x.masked_fill(ids >= vocab_size, float("-inf"))
    if top_k > 0 and top_k < vocab_size:
        k = top_k
        vals = x.topk(min(k, v_local), dim=-1).values  # [B, S, k_local]
        cand = _all_gather(vals, tp_group, tp_size, dim=-1)  # [B, S, tp * k_local] >= k entries
        thr = cand.topk(k, dim=-1).values[..., -1:]  # global k-th largest (ties at it are kept)
        keep = x >= thr
        if top_p >= 1.0 and min_p <= 0.0:
            return ~keep
        # Every value above thr is among the candidates; only the count of ties at thr is
        # unknown to a rank, so it is all-reduced. Probabilities are over the top-k set.
        ties = (x == thr).sum(dim=-1, keepdim=True).to(torch.float64)
        if tp_size > 1:
            dist.all_reduce(ties, group=tp_group)
        cv = cand.to(torch.float64)
        above = cv > thr  # distinct-valued candidates strictly above the threshold
        top = cv.amax(dim=-1, keepdim=True)
        w = torch.where(above, ((cv - top) / temperature).exp(), torch.zeros_like(cv))  # [B, S, C]
        w_thr = ((thr.to(torch.float64) - top) / temperature).exp()
        z = w.sum(dim=-1, keepdim=True) + ties * w_thr
        tau = thr.to(torch.float64)
        if top_p < 1.0:
            # keep value v iff the mass of values strictly above v is < top_p: in descending
            # order, the first of a run of ties has exactly that mass before it
            sv, order = cv.sort(dim=-1, descending=True)
            sw = w.gather(-1, order)
            mass_before = (sw.cumsum(dim=-1) - sw) / z  # [B, S, C]
            kept_vals = torch.where(above.gather(-1, order) & (mass_before < top_p), sv,
                                    torch.full_like(sv, float("inf")))
            thr_mass = w.sum(dim=-1, keepdim=True) / z  # mass strictly above thr
            tau_p = torch.where(thr_mass < top_p, tau, kept_vals.amin(dim=-1, keepdim=True))
            tau = torch.maximum(tau, tau_p)
        if min_p > 0.0:
            # p(v) >= min_p * p(max)  <=>  v >= max + T log(min_p); renormalisation cancels
            tau = torch.maximum(tau, top + temperature * math.log(min_p))
        return ~(keep & (x.to(torch.float64) >= tau))
    full = _all_gather(x, tp_group, tp_size, dim=-1)[..., :vocab_size]  # [B, S, V]
    sampling = SamplingTensors.from_values(temperature, 0, top_p, min_p, batch_size=b * s)
    kept = torch.isfinite(process_logits(full.reshape(b * s, -1), sampling)).view(b, s, -1)
    pad = v_local * tp_size - vocab_size
    if pad:
        kept = torch.cat([kept, kept.new_zeros(b, s, pad)], dim=-1)
    return ~kept[..., v_start:v_start + v_local]


def _lse_parts(x: torch.Tensor, group, tp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, Z, sum e (x - m)) of masked logits ``x`` [B, S, V_local] over the whole vocabulary,
    with e = exp(x - m): logsumexp = m + log Z and the entropy is log Z - sum e (x - m) / Z."""
    m = x.amax(dim=-1)  # [B, S]
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    y = x - m.unsqueeze(-1)
    e = y.exp()
    ey = torch.where(e > 0, e * y, torch.zeros_like(e))  # 0 * -inf would be NaN
    z, s = e.sum(dim=-1), ey.sum(dim=-1)
    if tp_size > 1:
        zs = torch.stack([z, s])
        dist.all_reduce(zs, group=group)
        z, s = zs[0], zs[1]
    return m, z, s


@torch.no_grad()
def vocab_parallel_entropy_and_log_mass(logits: torch.Tensor, exclude_mask: torch.Tensor | None, *,
                                        vocab_size: int, temperature: float,
                                        tp_group: dist.ProcessGroup | None = None, log_mass: bool = True
                                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Entropy (nats) of the processed distribution and ``log Z``, the log of the mass its support
    holds under the temperature-scaled, untruncated distribution; both ``[B, S]`` float32.

    One sequence at a time: the float32 temporaries are ``[S, V_local]``, not ``[B, S, V_local]``
    (a few GB per copy at B=8, S=4096 and a 150k vocabulary).

    Args:
        logits: this rank's vocabulary slice ``[B, S, V_local]``.
        exclude_mask: :func:`vocab_parallel_support_mask`'s result (None: nothing cut, log Z = 0).
        temperature: as the rollout; <= 0 (greedy) scores the unscaled policy.
        log_mass: False skips ``log Z`` (returned as None) and its pass over the vocabulary.
    """
    tp_rank, tp_size = _tp_info(tp_group)
    v_local = logits.shape[-1]
    ids = torch.arange(tp_rank * v_local, (tp_rank + 1) * v_local, device=logits.device)
    entropies, masses = [], []
    for i in range(logits.shape[0]):  # the same count on every TP rank: the collectives line up
        x = scale_by_temperature(logits[i:i + 1], temperature).masked_fill(ids >= vocab_size, float("-inf"))
        kept = x if exclude_mask is None else x.masked_fill(exclude_mask[i:i + 1], float("-inf"))
        m, z, s = _lse_parts(kept, tp_group, tp_size)
        entropies.append(z.log() - s / z)
        if not log_mass:
            continue
        if exclude_mask is None:
            masses.append(torch.zeros_like(z))
            continue
        m_all, z_all, _ = _lse_parts(x, tp_group, tp_size)
        masses.append(((m + z.log()) - (m_all + z_all.log())).clamp(max=0.0))  # logsumexp: support - all
    entropy = torch.cat(entropies) if entropies else logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    if not log_mass:
        return entropy, None
    return entropy, (torch.cat(masses) if masses else torch.zeros_like(entropy))
