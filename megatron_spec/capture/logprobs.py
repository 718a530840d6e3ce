"""Token log-probs from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits for a contiguous slice of the (padded)
vocabulary, ``[vocab_start, vocab_start + V/tp)``. The log-prob of token t is

    log p(t) = x_t - logsumexp_j x_j,   x = logits / T, with masked entries at -inf,

computed with three small all-reduces over the TP group (max, sum of exp, the target's
logit) on ``[B, S]`` tensors, never on ``[B, S, V]``. Gradients flow to each rank's own
slice (Megatron's reduce-from-TP-region: forward all-reduce, backward identity), so the
GRPO loss can be taken straight from the result.

Processing applied: temperature (per row), padded-vocabulary entries masked, and an optional
boolean mask of excluded tokens (top-k / top-p / min-p supports are built by
:func:`megatron_spec.capture.support.vocab_parallel_support_mask`). Temperature 0 means
greedy sampling, which has no distribution to score: greedy rows are scored under the
unscaled (T=1) policy, and the rollout engine reports the same quantity.

This module does not know models or hooks; it takes logits and a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _reduce(x: torch.Tensor, group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    """All-reduce (sum) with identity backward: every TP rank holds the same loss."""
    if tp_size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def scale_by_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``logits / T`` in float32; T <= 0 (greedy) rows are left unscaled. logits [B, S, V]."""
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=x.device, dtype=torch.float32)
        t = torch.where(t > 0, t, torch.ones_like(t))
        return x / t.view(-1, *([1] * (x.dim() - 1)))  # per-row T, [B, 1, 1]
    return x / temperature if temperature > 0 else x


def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float | torch.Tensor = 1.0,
    exclude_mask: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Log-probs of ``tokens`` under the processed distribution.

    Args:
        logits: this rank's vocabulary slice, ``[B, S, V_local]`` (any float dtype).
        tokens: global token ids, ``[B, S]``.
        vocab_size: the true vocabulary size; padded entries beyond it are masked.
        temperature: scalar or per-row ``[B]``.
        exclude_mask: ``[B, S, V_local]`` bool, True where the processed distribution is 0.
        tp_group: the tensor-parallel group (None: no tensor parallelism).

    Returns:
        ``[B, S]`` float32 log-probs (``-inf`` for excluded tokens); differentiable w.r.t. logits.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits [B, S, V_local] and tokens [B, S] expected, got {tuple(logits.shape)} "
                         f"and {tuple(tokens.shape)}")
    tp_rank, tp_size = _tp_info(tp_group)
    v_local = logits.shape[-1]
    v_start = tp_rank * v_local
    x = scale_by_temperature(logits, temperature)  # [B, S, V_local] fp32
    global_ids = torch.arange(v_start, v_start + v_local, device=x.device)
    invalid = global_ids >= vocab_size  # padded vocabulary, [V_local]
    if exclude_mask is not None:
        invalid = invalid | exclude_mask
    if invalid.any():
        x = x.masked_fill(invalid, float("-inf"))

    with torch.no_grad():  # a stabiliser only: d/dm of (x - m) + m cancels
        m = x.amax(dim=-1)  # [B, S]
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    sum_exp = _reduce((x - m.unsqueeze(-1)).exp().sum(dim=-1), tp_group, tp_size)  # [B, S]

    local = (tokens >= v_start) & (tokens < v_start + v_local)
    local_idx = (tokens - v_start).clamp(0, v_local - 1)
    target = x.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)  # [B, S]
    # Off-slice targets contribute 0 (not -inf) to the sum; -inf stays -inf for excluded ones.
    target = torch.where(local, target - m, torch.zeros_like(target))
    target = _reduce(target, tp_group, tp_size)
    return target - sum_exp.log()
