"""The policy optimizer's schedule and gradient arithmetic in the GRPO train stage.

The learning rate at a step (:func:`policy_lr`), a minibatch's loss normaliser over the
data-parallel ranks (:func:`minibatch_normalizer`), the gradient norm over the tensor-parallel
shards (:func:`grad_norm`) and clipping to ``--clip-grad`` (:func:`clip_grads_`). It knows no
rollout, model or engine: the actor (``rl/actor.py``) runs the micro-batches and the AdamW step
(``train/optimizer.py``) and decides what a non-finite value means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_spec.config import GRPOConfig
from megatron_spec.parallel import ParallelInfo
from megatron_spec.train.optimizer import MixedPrecisionAdamW


def policy_lr(g: GRPOConfig, step: int) -> float:
    """The policy's learning rate at ``step``, a function of the step alone (a resumed run
    continues the schedule exactly): linear warm-up over ``--lr-warmup-steps`` W, then
    ``--lr-decay-style`` from ``--lr`` towards ``--lr-min`` over the remaining steps (T =
    ``--train-iters``): at step s >= W, t = (s - W) / (T - W), cosine
    ``lr_min + (lr - lr_min) (1 + cos(pi t)) / 2``, linear ``lr - (lr - lr_min) t``
    (megatron-core's OptimizerParamScheduler; the first step after the warm-up uses ``--lr``)."""
    if step < g.lr_warmup_steps:
        return g.lr * (step + 1) / g.lr_warmup_steps
    if g.lr_decay_style == "constant":
        return g.lr
    t = min(1.0, (step - g.lr_warmup_steps) / max(1, g.train_iters - g.lr_warmup_steps))
    if g.lr_decay_style == "cosine":
        return g.lr_min + (g.lr - g.lr_min) * 0.5 * (1.0 + math.cos(math.pi * t))
    return g.lr - (g.lr - g.lr_min) * t


def minibatch_normalizer(masks: Sequence[torch.Tensor], loss_agg: str, info: ParallelInfo) -> float | None:
    """The GRPO loss normaliser of a minibatch (``--loss-agg``: its response tokens, or its sequences
    with one, over every DP rank, per DP rank: Megatron DDP averages the ranks' gradients); None when
    no DP rank has a response token in it. ``masks``: each micro-batch's ``[B, L-1]`` loss mask."""
    # host syncs (float(), tolist()): the skip decision and the normaliser, once per minibatch
    counts = torch.tensor(
        [sum(float(m.sum()) for m in masks), sum(float((m.sum(dim=1) > 0).sum()) for m in masks)],
        dtype=torch.float64,
        device=info.device,
    )  # response tokens, sequences
    if info.dp_size > 1:
        dist.all_reduce(counts, group=info.dp_group)
    tokens, seqs = counts.tolist()
    if tokens == 0:  # the same decision on every rank: the counts are global
        return None
    return (tokens if loss_agg == "token" else seqs) / info.dp_size


def grad_norm(
    params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None], info: ParallelInfo
) -> float:
    """L2 norm of the fp32 ``grads`` of ``params`` over the model (TP shards summed over the TP group)."""
    sharded = torch.zeros((), device=info.device)
    replicated = torch.zeros((), device=info.device)
    for p, grad in zip(params, grads):
        if grad is None:
            continue
        sq = grad.pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):  # megatron-core's attribute, set on TP shards only
            sharded += sq
        else:
            replicated += sq
    if info.tp_size > 1:
        dist.all_reduce(sharded, group=info.tp_group)
    return float((sharded + replicated).sqrt())  # host sync: clipping and the divergence check need it


def clip_grads_(optimizer: MixedPrecisionAdamW, norm: float, clip_grad: float) -> None:
    """Scale the optimizer's fp32 gradients in place to norm ``clip_grad`` when ``norm`` (their
    :func:`grad_norm`) is above it (``clip_grad`` 0: no clipping)."""
    if clip_grad > 0 and norm > clip_grad:
        scale = clip_grad / (norm + 1e-6)
        for grad in optimizer.grads():
            if grad is not None:
                grad.mul_(scale)
