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
* Top-1 agreement: the draft's argmax equals the teacher's argmax.
"""

from __future__ import annotations

import torch

_REST_FLOOR = 1e-6  # q_rest is clamped here: log(0) where the draft puts all its mass on the top k


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
    logq, logp = logq.float(), teacher_logp.float()
    p = logp.exp()
    ce = -(p * logq).sum(dim=-1)  # [...]
    p_rest = (1.0 - p.sum(dim=-1)).clamp(min=0.0)
    q_top = logq.logsumexp(dim=-1).exp().clamp(max=1.0 - _REST_FLOOR)
    ce = ce - p_rest * torch.log1p(-q_top)
    ce = torch.where(mask, ce, torch.zeros_like(ce))  # masked rows may hold garbage (padding)
    return ce.sum(), mask.sum()


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
    ``q < s`` have no such row in their segment. ``lengths``: ``[B]``; returns ``[B, seq_len]`` bool.
    """
    q = torch.arange(seq_len).unsqueeze(0)
    return (q >= step) & (q < lengths.unsqueeze(1))


__all__ = [
    "hard_cross_entropy_sum",
    "soft_cross_entropy_sum",
    "top1_agreement_sum",
    "ttt_step_weights",
    "ttt_valid_rows",
]
