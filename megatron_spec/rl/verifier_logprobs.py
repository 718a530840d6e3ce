"""The verifier's log-probs of packed rollouts, and the micro-batch record the logprob stage hands on.

:func:`verifier_logprobs` runs the Megatron policy (or its reference) on a packed micro-batch and
reads the targets' log-probs under the rollout sampler's processed distribution: temperature, then
top-k / top-p / min-p over the tensor-parallel vocabulary (``capture/support.py``), ``-inf`` outside
its support; optionally the entropy of that distribution and ``log Z``, the log-mass its support
keeps. :class:`MicroBatch` is one micro-batch as the logprob stage leaves it for the train stage.
It knows no optimizer, loss or engine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.support import vocab_parallel_entropy_and_log_mass, vocab_parallel_support_mask
from megatron_spec.config import RolloutConfig
from megatron_spec.rl.rollouts import PackedBatch


class MicroBatch(NamedTuple):
    """One micro-batch of the train stage, as the logprob stage leaves it."""

    batch: PackedBatch
    old_logprobs: torch.Tensor
    """``[B, L-1]`` under the policy version that generated the rollouts (0 outside the mask)."""
    ref_logprobs: torch.Tensor | None
    """``[B, L-1]`` under the reference (``--kl-coef`` > 0), else None."""


def verifier_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    sampling: RolloutConfig,
    *,
    vocab_size: int,
    tp_group: dist.ProcessGroup,
    grad: bool,
    extras: bool = False,
    log_mass: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``[B, L-1]`` log-probs of ``batch.targets`` under ``model``'s distribution processed as the
    rollouts were sampled (``sampling``: ``--rollout-temperature``, ``-top-k``, ``-top-p``, ``-min-p``;
    ``-inf`` outside its support). Without ``grad``, 0 outside ``batch.mask``. With ``extras``, also
    the entropy of that distribution and (``log_mass``) ``log Z``, the log-mass its support keeps
    (capture/support.py; else None), ``[B, L-1]``, detached."""
    r = sampling
    logits = model(batch.input_ids, batch.position_ids, attention_mask=None)[:, :-1]  # [B, L-1, V/tp]
    exclude = vocab_parallel_support_mask(
        logits.detach(),
        vocab_size=vocab_size,
        temperature=r.rollout_temperature,
        top_k=r.rollout_top_k,
        top_p=r.rollout_top_p,
        min_p=r.rollout_min_p,
        tp_group=tp_group,
    )
    lp = vocab_parallel_token_logprobs(
        logits,
        batch.targets,
        vocab_size=vocab_size,
        temperature=r.rollout_temperature,
        exclude_mask=exclude,
        tp_group=tp_group,
    )
    # -inf * 0 would be NaN
    lp = torch.where(batch.mask > 0, lp, torch.zeros_like(lp)) if not grad else lp
    if not extras:
        return lp
    entropy, log_mass = vocab_parallel_entropy_and_log_mass(
        logits.detach(),
        exclude,
        vocab_size=vocab_size,
        temperature=r.rollout_temperature,
        tp_group=tp_group,
        log_mass=log_mass,
    )
    return lp, entropy, log_mass
