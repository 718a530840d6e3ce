"""Draft losses as pure functions of tensors (no modules, no process groups, no configs).

Every function returns *sums* over rows plus the number of rows summed, so a caller can
normalise by a count reduced across data-parallel ranks and micro-batches (the loss of a
data-parallel step then equals the loss of one process over the concatenated data).

* Soft cross-entropy against the teacher (EAGLE-3's training loss, ModelOpt's ``_eagle_loss``):
  ``-sum_v p(v) log q(v)`` with ``p`` the target distribution on the draft vocabulary. A top-k
  teacher keeps the mass outside its k entries as one extra *rest* class,
  ``p_rest = 1 - sum_k p``, ``q_rest = 1 - sum_k q``; the minimiser then matches p on the k entries
  and in total elsewhere (for a full teacher ``p_rest = 0`` and this is plain cross-entropy).
  Renormalising the k entries instead would teach the draft to be over-confident wherever the
  target is uncertain (on a high-entropy target that lowered T=1 acceptance here).
* Hard cross-entropy on the sampled next tokens (``-log q(x_{t+1})``), optional.
* Training-time-test weighting: step ``s`` of the unroll is weighted ``decay ** s``
  (ModelOpt's ``eagle_loss_decay_factor``).
* Total variation on the teacher's entries (DistillSpec, Zhou et al. 2024), optional beside the
  soft cross-entropy: ``1 - sum_j min(p_j, q_j)``, the acceptance the verification gives a sampled
  draft token, as a loss. The cross-entropy is minimised by q = p, but a one-layer draft cannot
  reach p, and the q it settles for is not the q that accepts most: on the real model's T=1 answers
  the term raised held-out acceptance beyond what the same steps of cross-entropy alone did
  (docs/draft_training.md, "Training for acceptance").
* Top-1 agreement: the draft's argmax equals the teacher's argmax.
* Expected acceptance of a sampled draft token (Leviathan et al. 2023, Theorem 3.5):
  ``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)``, what speculative sampling's verification
  accepts on average at one position. It is the quantity acceptance length is made of
  (``tau = 1 + sum_j prod_{s <= j} alpha_s`` along a draft chain), so the draft is *evaluated*
  with it; the soft cross-entropy is only a surrogate for it.
"""

from __future__ import annotations

import torch

_REST_FLOOR = 1e-6  # q_rest is clamped here: log(0) where the draft puts all its mass on the top k


def soft_cross_entropy_rows(logq: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per row ``-(sum_j p_j logq_j + p_rest log q_rest)`` (``[...]`` float32); see
    :func:`soft_cross_entropy_sum` for the arguments."""
    logq, logp = logq.float(), teacher_logp.float()
    p = logp.exp()
    ce = -(p * logq).sum(dim=-1)  # [...]
    p_rest = (1.0 - p.sum(dim=-1)).clamp(min=0.0)
    q_top = logq.logsumexp(dim=-1).exp().clamp(max=1.0 - _REST_FLOOR)
    return ce - p_rest * torch.log1p(-q_top)


def soft_cross_entropy_sum(
    logq: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_rows -(sum_j p_j logq_j + p_rest log q_rest)`` over rows where ``mask``.

    Args:
        logq: ``[..., k]`` draft log-probs (normalised over the draft vocabulary) at the teacher's
            support (``[..., Vd]`` for a full teacher).
        teacher_logp: ``[..., k]`` teacher log-probs on the same support, normalised over the draft
            vocabulary (so ``sum_j exp <= 1``; the rest is ``p_rest``).
        mask: ``[...]`` bool rows to count.
    Returns:
        (loss sum, 0-d float32; number of rows counted, 0-d int64).
    """
    ce = soft_cross_entropy_rows(logq, teacher_logp)
    ce = torch.where(mask, ce, torch.zeros_like(ce))  # masked rows may hold garbage (padding)
    return ce.sum(), mask.sum()


def _target_and_draft(logq: torch.Tensor, teacher_logp: torch.Tensor,
                      log_mass: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, q)`` float32 on the teacher's entries: the target's own probabilities (the teacher scaled by
    ``exp(log_mass)`` when given) and the draft's."""
    p = teacher_logp.float().exp()
    if log_mass is not None:
        p = p * log_mass.float().exp().unsqueeze(-1)
    return p, logq.float().exp()


def acceptance_rows(logq: torch.Tensor, teacher_logp: torch.Tensor,
                    log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Per row ``sum_x min(p(x), q(x))`` (``[...]`` float32): the expected acceptance ``1 - TV(p, q)``
    of a token drawn from q and verified against p.

    Args and shapes as :func:`soft_cross_entropy_sum`. A top-k teacher adds
    ``min(p_rest, q_rest)``, an upper bound on the mass the two share outside the k entries (exact
    for a full teacher, where ``p_rest = 0``). Both distributions must be the ones the engine
    samples and verifies with (after temperature, top-k, top-p).

    ``log_mass`` (``[...]``, ``DraftCache.teacher_log_mass``): the teacher is renormalised over a reduced
    draft vocabulary; the target puts only ``exp(log_mass)`` of its mass there, and the engine verifies
    against the target's own distribution, so ``p`` is the teacher scaled by it (and ``p_rest`` what is
    left of that mass outside the k entries). None: the teacher is the target's distribution.
    """
    p, q = _target_and_draft(logq, teacher_logp, log_mass)
    mass = 1.0 if log_mass is None else log_mass.float().exp()
    p_rest = (mass - p.sum(dim=-1)).clamp(min=0.0)
    q_rest = (1.0 - q.sum(dim=-1)).clamp(min=0.0)
    return torch.minimum(p, q).sum(dim=-1) + torch.minimum(p_rest, q_rest)


def tv_loss_rows(logq: torch.Tensor, teacher_logp: torch.Tensor,
                 log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Per row ``1 - sum_j min(p_j, q_j)`` over the teacher's entries (``[...]`` float32): the
    total-variation training loss; arguments as :func:`acceptance_rows` (``p`` the target's own
    distribution: the teacher scaled by ``log_mass`` when given).

    The rest class of a top-k teacher is left out: ``min(p_rest, q_rest)`` only bounds the mass the two
    share outside the k entries from above, and a draft would raise it by moving mass off the teacher's
    entries onto any other token. Without it the sum is the exact shared mass on those entries, a lower
    bound on the acceptance (equal to it for a full teacher).
    """
    p, q = _target_and_draft(logq, teacher_logp, log_mass)
    return 1.0 - torch.minimum(p, q).sum(dim=-1)


def tv_loss_sum(logq: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`tv_loss_rows` summed over rows where ``mask`` (0-d float32)."""
    tv = tv_loss_rows(logq, teacher_logp, log_mass)
    return torch.where(mask, tv, torch.zeros_like(tv)).sum()


def acceptance_sum(
    logq: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`acceptance_rows` summed over rows where ``mask``: (sum, 0-d float32; rows, 0-d int64)."""
    a = acceptance_rows(logq, teacher_logp)
    return torch.where(mask, a, torch.zeros_like(a)).sum(), mask.sum()


def chain_acceptance_rows(alpha: torch.Tensor) -> torch.Tensor:
    """Expected tokens per verify step of the draft chain that starts at each row.

    ``alpha[s, b, q]`` is the expected acceptance at training-time-test step ``s`` of row ``q``,
    whose chain started at row ``q - s``. The chain that starts at row ``r`` (the last verified
    token) emits ``1 + sum_j prod_{s <= j} alpha[s, b, r + s]`` tokens on average: each draft is
    reached only if the previous ones were accepted, and the target's bonus token always counts.

    Args:
        alpha: ``[k, B, T]``.
    Returns:
        ``[B, T - k + 1]`` float64 (``[B, 0]`` when ``T < k``): chains starting at rows ``0..T-k``.
    """
    k, b, t = alpha.shape
    starts = max(0, t - k + 1)
    prod = torch.ones(b, starts, dtype=torch.float64, device=alpha.device)
    tau = torch.ones_like(prod)
    for s in range(k):
        prod = prod * alpha[s, :, s:s + starts].double()  # step s of the chain from r
        tau = tau + prod
    return tau


def hard_cross_entropy_sum(logq_label: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_rows -logq(label)`` over rows where ``mask``. ``logq_label``: ``[...]``."""
    ce = torch.where(mask, -logq_label.float(), torch.zeros_like(logq_label, dtype=torch.float32))
    return ce.sum(), mask.sum()


def top1_agreement_sum(
    draft_top1: torch.Tensor, teacher_top1: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Rows where ``mask`` and the draft's argmax equals the teacher's (0-d int64)."""
    return ((draft_top1 == teacher_top1) & mask).sum()


def ttt_step_weights(ttt_steps: int, decay: float) -> list[float]:
    """Loss weight of each training-time-test step: ``decay ** s``."""
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    return [decay**s for s in range(ttt_steps)]


def ttt_valid_rows(lengths: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """Rows of right-padded segments that carry a loss at TTT step ``step``: ``step <= q < length``.

    At step s row q's draft chain starts from the target features at row ``q - s``; rows
    ``q < s`` have no such row in their segment. ``lengths``: ``[B]``; returns ``[B, seq_len]`` bool
    on ``lengths``' device.
    """
    q = torch.arange(seq_len, device=lengths.device).unsqueeze(0)
    return (q >= step) & (q < lengths.unsqueeze(1))


__all__ = [
    "acceptance_rows",
    "acceptance_sum",
    "chain_acceptance_rows",
    "hard_cross_entropy_sum",
    "soft_cross_entropy_rows",
    "soft_cross_entropy_sum",
    "top1_agreement_sum",
    "ttt_step_weights",
    "ttt_valid_rows",
    "tv_loss_rows",
    "tv_loss_sum",
]
