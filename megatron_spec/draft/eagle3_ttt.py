"""The training-time-test unroll of an EAGLE-3 head over cached segments, and the acceptance it measures.

:func:`ttt_unroll` is ModelOpt's recipe on right-padded segments: ``h0 = fc(aux)``, then ``steps``
forwards of the head, where step s attends to the verified rows ``<= q - s`` and to its own chain's
earlier steps (``ttt_attention_mask``), takes the previous step's hidden state shifted by one row,
and is scored on rows ``q >= s`` that are scored rows of the cache (context rows never are).

:func:`eagle3_acceptance` runs the unroll without gradients and returns, per cache row, the
expected acceptance ``alpha`` of each step, its soft cross-entropy ``ce`` and the expected tokens
per verify step ``tau`` of the chain that starts there; :func:`acceptance_metrics` averages them
into the ``draft/eval_*`` metrics.

It knows no optimizer, loss weighting or process group (``megatron_spec.draft.trainer`` trains
through the unroll).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from megatron_spec.capture.cache import DraftCache, micro_batches
from megatron_spec.draft.eagle3 import Eagle3Head, Eagle3Output, ttt_attention_mask
from megatron_spec.draft.losses import (
    acceptance_rows,
    chain_acceptance_rows,
    soft_cross_entropy_rows,
    ttt_valid_rows,
)
from megatron_spec.draft.optim import HOST


class TttStep(NamedTuple):
    """One unrolled step of :func:`ttt_unroll`."""

    step: int
    """s, 0-based."""
    out: Eagle3Output
    """The head's output at step s (logits ``[B, S, Vd]``, hidden ``[B, S, H]``, this step's keys/values)."""
    valid: torch.Tensor
    """``[B, S]`` bool: the rows scored at step s (inside the segment, ``q >= s``, a scored cache row)."""


class RowAcceptance(NamedTuple):
    """Per cache row results of :func:`eagle3_acceptance` (float64, on the host)."""

    alpha: torch.Tensor
    """``[steps, N]``: ``sum_x min(p, q_s)`` of row n at unrolled step s, NaN where not scored at s."""
    ce: torch.Tensor
    """``[steps, N]``: the soft cross-entropy, NaN likewise."""
    tau: torch.Tensor
    """``[N]``: expected tokens per verify step of the chain starting at row n, NaN where none does."""


def ttt_unroll(head: Eagle3Head, cache: DraftCache, segs: list[int], steps: int) -> Iterator[TttStep]:
    """The training-time-test unroll of ``head`` over segments ``segs`` of ``cache`` (right-padded):
    one :class:`TttStep` per step."""
    dev = head.lm_head.weight.device
    embeds = cache.padded("embeds", segs).to(dev, torch.float32)  # [B, S, H]
    aux = cache.padded("aux", segs).to(dev, torch.float32)  # [B, S, n_aux H]
    positions = cache.padded("positions", segs).to(dev)  # [B, S]
    scored = cache.pad_rows(cache.scored_mask(), segs, False).to(dev)  # [B, S]
    lens = torch.tensor([int(cache.seqlens[s]) for s in segs], device=dev)
    t = positions.shape[1]
    hidden = head.fuse(aux)  # h0 = fc(aux), [B, S, H]
    past = None
    for s_i in range(steps):
        out = head.forward_full(
            embeds, hidden, positions, attn_mask=ttt_attention_mask(t, s_i, dev), past_kv=past
        )
        yield TttStep(s_i, out, ttt_valid_rows(lens, t, s_i) & scored)
        past = (
            out.kv
            if past is None
            else (torch.cat([past[0], out.kv[0]], 2), torch.cat([past[1], out.kv[1]], 2))
        )
        hidden = out.hidden.roll(1, dims=1)  # row q of step s+1 continues the chain of row q-1


@torch.no_grad()
def eagle3_acceptance(
    head: Eagle3Head, cache: DraftCache, steps: int, micro_batch_rows: int
) -> RowAcceptance:
    """Per-row expected acceptance of ``head`` on ``cache`` over ``steps`` unrolled steps (no update,
    no collective), in micro-batches of ``micro_batch_rows`` padded rows.

    ``alpha`` is :func:`acceptance_rows` against the target's distribution p (the teacher scaled by
    its mass on a reduced draft vocabulary when the cache holds it, ``teacher_log_mass``); ``tau``
    is :func:`chain_acceptance_rows` of the ``steps``-token chain, NaN where no complete chain
    starts at a scored row.
    """
    was_training = head.training
    head.eval()
    n_rows = cache.num_rows
    result = RowAcceptance(
        alpha=torch.full((steps, n_rows), float("nan"), dtype=torch.float64, device=HOST),
        ce=torch.full((steps, n_rows), float("nan"), dtype=torch.float64, device=HOST),
        tau=torch.full((n_rows,), float("nan"), dtype=torch.float64, device=HOST),
    )
    lens_all = [int(n) for n in cache.seqlens]
    try:
        for segs in micro_batches(lens_all, micro_batch_rows):
            _score_micro_batch(head, cache, segs, lens_all, steps, result)
    finally:
        head.train(was_training)
    return result


def _cache_row_index(cache: DraftCache, segs: list[int], lens_all: list[int], t: int) -> torch.Tensor:
    """``[B, t]`` long, on the host: the cache row of every padded row of ``segs`` (-1: padding)."""
    where = torch.full((len(segs), t), -1, dtype=torch.long, device=HOST)
    for b, s in enumerate(segs):
        start = int(cache.cu_seqlens[s])
        where[b, : lens_all[s]] = torch.arange(start, start + lens_all[s], device=HOST)
    return where


def _score_micro_batch(
    head: Eagle3Head, cache: DraftCache, segs: list[int], lens_all: list[int], steps: int,
    result: RowAcceptance,
) -> None:
    """Fill ``result``'s rows of segments ``segs`` (one micro-batch)."""
    dev = head.lm_head.weight.device
    teacher_lp = cache.padded("teacher_logprobs", segs).to(dev)  # [B, S, k | Vd]
    teacher_ids = cache.padded("teacher_ids", segs).to(dev) if cache.teacher_ids is not None else None
    log_mass = (
        cache.padded("teacher_log_mass", segs).to(dev) if cache.teacher_log_mass is not None else None
    )  # [B, S]: the target's mass on a reduced draft vocabulary
    lens = torch.tensor([lens_all[s] for s in segs], device=dev)
    t = int(lens.max())
    where = _cache_row_index(cache, segs, lens_all, t)  # indexes alpha, ce, tau
    alphas, start_ok = [], None
    for s_i, out, valid in ttt_unroll(head, cache, segs, steps):
        logq = out.logits.log_softmax(-1)
        if teacher_ids is not None:
            logq = logq.gather(-1, teacher_ids)
        a = acceptance_rows(logq, teacher_lp, log_mass)  # [B, S]: against the target's own p
        rows = where[valid.cpu()]
        result.alpha[s_i, rows] = a[valid].double().cpu()
        result.ce[s_i, rows] = soft_cross_entropy_rows(logq, teacher_lp)[valid].double().cpu()
        alphas.append(a)
        if s_i == 0:
            start_ok = valid
    chain = chain_acceptance_rows(torch.stack(alphas))  # [B, S - steps + 1]
    # a chain starting at row r needs rows r .. r + steps - 1 in its segment
    complete = torch.arange(t, device=dev).unsqueeze(0) + steps - 1 < lens.unsqueeze(1)
    ok = (start_ok & complete)[:, : chain.shape[1]]
    result.tau[where[:, : chain.shape[1]][ok.cpu()]] = chain[ok].cpu()


def acceptance_metrics(acc: RowAcceptance) -> dict[str, float]:
    """Means of ``acc`` over the rows that have them: ``draft/eval_accept{s}``, ``draft/eval_ce{s}``,
    ``draft/eval_tau`` and ``draft/eval_rows`` (rows scored at step 0)."""
    alpha, ce, tau = acc
    out = {}
    for s in range(alpha.shape[0]):
        ok = ~alpha[s].isnan()
        out[f"draft/eval_accept{s}"] = float(alpha[s][ok].mean()) if ok.any() else float("nan")
        out[f"draft/eval_ce{s}"] = float(ce[s][ok].mean()) if ok.any() else float("nan")
    ok = ~tau.isnan()
    out["draft/eval_tau"] = float(tau[ok].mean()) if ok.any() else float("nan")
    out["draft/eval_rows"] = float((~alpha[0].isnan()).sum())
    return out


__all__ = ["RowAcceptance", "TttStep", "acceptance_metrics", "eagle3_acceptance", "ttt_unroll"]
