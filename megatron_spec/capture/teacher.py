"""The draft's teacher from vocab-parallel logits, without gathering the vocabulary.

The teacher of a draft row is the target's distribution at T=1 restricted to the draft
vocabulary and renormalised there (ModelOpt's ``_map_logits_to_draft_vocab`` + softmax):

    p_d(v) = exp(z_{tid(v)} - logZ_d),    logZ_d = logsumexp_{v < Vd} z_{tid(v)},   tid = arange + d2t

Under tensor parallelism rank r holds logits of target ids ``[r V/tp, (r+1) V/tp)``. Each rank
works on the draft ids whose target id it owns, so what crosses the TP group per row is:

* ``logZ_d``: one max and one sum all-reduce of ``[N]`` floats;
* top-k mode: an all-gather of each rank's local top-k (``[N, k]`` values and ids, ``tp * k``
  numbers per row), followed by a top-k of the gathered candidates;
* full mode: one all-reduce (sum) of ``[N, Vd]`` where every rank fills the columns it owns and
  zeros elsewhere (exact: each column has one owner). That is the draft vocabulary, never the
  target's padded vocabulary, and only for the captured rows.

:func:`vocab_parallel_logprobs_at` is the differentiable counterpart used by the MTP loss (the
MTP head shares the target's vocab-parallel output layer): log-probs at chosen ids with the
same three small reductions as ``capture.logprobs``.

Pure tensor math plus explicit TP-group collectives; it knows no models or hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import _reduce, _tp_info


def _owned_columns(
    target_ids: torch.Tensor | None, vocab_size: int, v_start: int, v_local: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids whose target id this rank owns, their local logit columns), on ``device``."""
    if target_ids is None:  # the draft vocabulary is the target's (unpadded) vocabulary
        end = min(v_start + v_local, vocab_size)
        draft = torch.arange(v_start, max(end, v_start), device=device)
        return draft, draft - v_start
    tid = target_ids.to(device=device, dtype=torch.long)
    owned = (tid >= v_start) & (tid < v_start + v_local)
    draft = owned.nonzero().flatten()
    return draft, tid[draft] - v_start


def draft_vocab_teacher(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    target_ids: torch.Tensor | None = None,
    topk: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Teacher log-probs over the draft vocabulary for ``N`` rows of vocab-parallel logits.

    Args:
        logits: ``[N, V_local]`` this rank's slice (any float dtype; not modified).
        vocab_size: the target's true vocabulary size (padded columns are ignored).
        target_ids: ``[Vd]`` target id of every draft id (``arange + d2t``); None = full vocabulary.
        topk: keep the k most likely draft ids per row; None = the full draft vocabulary.
        tp_group: tensor-parallel group (None: no tensor parallelism). Collective over it.

    Returns:
        ``(ids [N, k] int64 draft ids in descending order, logprobs [N, k])`` for top-k, or
        ``(None, logprobs [N, Vd])``; float32, normalised over the whole draft vocabulary.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local], got {tuple(logits.shape)}")
    tp_rank, tp_size = _tp_info(tp_group)
    n, v_local = logits.shape
    vd = vocab_size if target_ids is None else int(target_ids.numel())
    if topk is not None and not 1 <= topk <= vd:
        raise ValueError(f"teacher top-k {topk} must be in 1..{vd} (the draft vocabulary size)")
    draft_ids, cols = _owned_columns(target_ids, vocab_size, tp_rank * v_local, v_local, logits.device)
    x = logits.detach().index_select(1, cols).float()  # [N, n_owned]

    m = x.amax(dim=1) if x.shape[1] else x.new_full((n,), float("-inf"))
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    s = (x - m.unsqueeze(1)).exp().sum(dim=1)
    if tp_size > 1:
        dist.all_reduce(s, group=tp_group)
    log_z = m + s.log()  # [N]

    if topk is None:
        full = x.new_zeros(n, vd)
        full[:, draft_ids] = x - log_z.unsqueeze(1)
        if tp_size > 1:
            dist.all_reduce(full, group=tp_group)  # each column has exactly one owner
        return None, full

    kk = min(topk, x.shape[1])
    vals = x.new_full((n, topk), float("-inf"))
    ids = torch.full((n, topk), -1, dtype=torch.long, device=x.device)
    if kk:
        v, i = x.topk(kk, dim=1)
        vals[:, :kk], ids[:, :kk] = v, draft_ids[i]
    if tp_size > 1:
        all_vals = [torch.empty_like(vals) for _ in range(tp_size)]
        all_ids = [torch.empty_like(ids) for _ in range(tp_size)]
        dist.all_gather(all_vals, vals, group=tp_group)
        dist.all_gather(all_ids, ids, group=tp_group)
        vals, ids = torch.cat(all_vals, dim=1), torch.cat(all_ids, dim=1)  # [N, tp * k]
        vals, pick = vals.topk(topk, dim=1)
        ids = ids.gather(1, pick)
    return ids, vals - log_z.unsqueeze(1)


@torch.no_grad()
def draft_vocab_log_mass(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    target_ids: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``log sum_{v < Vd} p(tid(v))`` per row: the log of the target's probability mass (T=1, over its
    whole vocabulary) on the draft vocabulary, ``[N]`` float32, 0 for the full vocabulary.

    The teacher of :func:`draft_vocab_teacher` is renormalised over the draft vocabulary (what the draft
    trains on); a draft that can only propose those ids is accepted at most with this probability,
    so the expected acceptance the engine sees is measured against the teacher scaled by it
    (``draft.losses.acceptance_rows``'s ``log_mass``). One max and one sum all-reduce over the TP group.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local], got {tuple(logits.shape)}")
    if target_ids is None:
        return logits.new_zeros(logits.shape[0], dtype=torch.float32)
    sums = _exp_sums(logits, vocab_size, target_ids, None, tp_group)
    return (sums[0].log() - sums[1].log()).clamp(max=0.0)


@torch.no_grad()
def log_mass_and_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    target_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_vocab_log_mass` and ``log p(tokens)`` (T=1, the whole vocabulary; what
    ``capture.logprobs.vocab_parallel_token_logprobs`` gives without gradients) from one exp pass over
    the logits: the capture's logits hook needs both for every captured row. ``tokens``: ``[N]`` global
    ids in ``[0, vocab_size)``. Returns two ``[N]`` float32 tensors; one max and one sum all-reduce."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits [N, V_local] and tokens [N] expected, got {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}")
    sums = _exp_sums(logits, vocab_size, target_ids, tokens, tp_group)
    log_z = sums[1].log()
    return (sums[0].log() - log_z).clamp(max=0.0), sums[2] - log_z


def _exp_sums(logits: torch.Tensor, vocab_size: int, target_ids: torch.Tensor, tokens: torch.Tensor | None,
              tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``sums [2 or 3, N]``, with ``m`` the row max of the unpadded logits over the TP group and summed over
    it: ``sums[0] = sum_{v < Vd} exp(z_tid(v) - m)``, ``sums[1] = sum_all exp(z - m)`` and, with ``tokens``,
    ``sums[2] = z_token - m`` (from the rank that owns the token). One float copy of this rank's logits."""
    tp_rank, tp_size = _tp_info(tp_group)
    n, v_local = logits.shape
    v_start = tp_rank * v_local
    _, cols = _owned_columns(target_ids, vocab_size, v_start, v_local, logits.device)
    x = logits.detach()[:, : max(0, min(v_local, vocab_size - v_start))]  # padded columns come last
    m = x.amax(dim=1).float() if x.shape[1] else x.new_full((n,), float("-inf"), dtype=torch.float32)
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    parts = []
    if tokens is not None:  # read before the logits are overwritten by their exp
        local = (tokens >= v_start) & (tokens < v_start + x.shape[1])
        z = (
            x.gather(1, (tokens - v_start).clamp(0, x.shape[1] - 1).unsqueeze(1)).squeeze(1).float()
            if x.shape[1]
            else m.new_zeros(n)
        )  # a rank holding only padded columns owns no token
        parts.append(torch.where(local, z - m, torch.zeros_like(z)))
    e = (x.float() - m.unsqueeze(1)).exp_()
    sums = torch.stack([e.index_select(1, cols).sum(dim=1), e.sum(dim=1), *parts])  # [2 or 3, N]
    if tp_size > 1:
        dist.all_reduce(sums, group=tp_group)
    return sums


def vocab_parallel_logprobs_at(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Differentiable ``log_softmax(logits)[ids]`` over the full (unpadded) vocabulary.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary slice.
        ids: ``[N, k]`` global target ids (all ranks pass the same ids).
    Returns:
        ``[N, k]`` float32; gradients reach each rank's own slice only (Megatron's
        reduce-from-TP-region: forward all-reduce, backward identity).
    """
    tp_rank, tp_size = _tp_info(tp_group)
    n, v_local = logits.shape
    v_start = tp_rank * v_local
    x = logits.float()
    invalid = torch.arange(v_start, v_start + v_local, device=x.device) >= vocab_size
    if bool(invalid.any()):
        x = x.masked_fill(invalid, float("-inf"))
    with torch.no_grad():
        m = x.amax(dim=1)
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = _reduce((x - m.unsqueeze(1)).exp().sum(dim=1), tp_group, tp_size)  # [N]
    local = (ids >= v_start) & (ids < v_start + v_local)
    picked = x.gather(1, (ids - v_start).clamp(0, v_local - 1))
    picked = _reduce(torch.where(local, picked - m.unsqueeze(1), torch.zeros_like(picked)), tp_group, tp_size)
    return picked - sum_exp.log().unsqueeze(1)


def vocab_parallel_log_softmax(
    logits: torch.Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's slice of ``log_softmax`` over the full vocabulary, ``[N, V_local]`` float32
    (padded columns are ``-inf``). Differentiable like :func:`vocab_parallel_logprobs_at`."""
    tp_rank, tp_size = _tp_info(tp_group)
    v_local = logits.shape[-1]
    x = logits.float()
    invalid = torch.arange(tp_rank * v_local, (tp_rank + 1) * v_local, device=x.device) >= vocab_size
    if bool(invalid.any()):
        x = x.masked_fill(invalid, float("-inf"))
    with torch.no_grad():
        m = x.amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = _reduce((x - m.unsqueeze(-1)).exp().sum(dim=-1), tp_group, tp_size)
    return x - (m + sum_exp.log()).unsqueeze(-1)


@torch.no_grad()
def vocab_parallel_argmax(
    logits: torch.Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global argmax ids ``[N]`` of vocab-parallel ``logits [N, V_local]`` (lowest id on ties)."""
    tp_rank, tp_size = _tp_info(tp_group)
    v_local = logits.shape[-1]
    x = logits.float()
    invalid = torch.arange(tp_rank * v_local, (tp_rank + 1) * v_local, device=x.device) >= vocab_size
    x = x.masked_fill(invalid, float("-inf"))
    best, idx = x.max(dim=-1)
    if tp_size == 1:
        return idx
    m = best.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    big = torch.iinfo(torch.long).max
    ids = torch.where(best == m, idx + tp_rank * v_local, torch.full_like(idx, big))
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=tp_group)
    return ids


__all__ = [
    "draft_vocab_log_mass",
    "draft_vocab_teacher",
    "log_mass_and_token_logprobs",
    "vocab_parallel_argmax",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logprobs_at",
]
