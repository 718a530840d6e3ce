"""The GRPO policy loss: clipped importance ratio, optional k3 KL, token or sequence aggregation.

Per response token t of sample i (PPO-clip with decoupled bounds, DAPO's clip-higher):

    rho_t   = exp(logp_t - logp_old_t)
    l_t     = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
    l_t    += beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)      # k3 estimator (Schulman 2020)
    l_t    *= w_t                                                      # optional truncated IS weight

Aggregation: ``token`` sums l_t over every response token and divides by ``normalizer``
(the number of tokens in the global minibatch divided by the DP size, so that Megatron DDP's
average over ranks gives the global token mean); ``sequence`` averages within each sample,
then sums over samples and divides by ``normalizer`` (sequences per DP rank).

All log-prob inputs are the *verifier's* (Megatron's); the engine's log-probs enter only
through the optional truncated importance-sampling weights w_t = min(C, exp(logp_old - logp_engine)),
detached. Pure: tensors in, loss and detached statistics out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GRPOLossStats:
    """Sums over this micro-batch's response tokens (divide by ``tokens`` for means)."""

    tokens: float
    clipped: float
    ratio_sum: float
    ratio_max: float
    kl_sum: float
    pg_loss_sum: float


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    agg: str = "token",
    normalizer: float = 1.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, GRPOLossStats]:
    """Args:
        logprobs: ``[B, T]`` current policy log-probs of the response tokens (requires grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that generated the samples.
        advantages: ``[B]`` one per sample.
        mask: ``[B, T]`` 1 on response tokens, 0 on prompt/padding.
        ref_logprobs: ``[B, T]`` frozen reference, required when ``kl_coef > 0``.
        normalizer: see module docstring.
        is_weights: ``[B, T]`` truncated importance weights (detached) or None.
    Returns:
        (scalar loss, :class:`GRPOLossStats`).
    """
    if agg not in ("token", "sequence"):
        raise ValueError(f"agg must be 'token' or 'sequence', got {agg!r}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    m = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).masked_fill(m == 0, 0.0)  # [B, T]
    ratio = log_ratio.exp()
    a = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    unclipped = ratio * a
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * a
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    kl = torch.zeros_like(per_token)
    if kl_coef > 0:
        d = (ref_logprobs - logprobs).masked_fill(m == 0, 0.0)
        kl = d.exp() - d - 1.0
        per_token = per_token + kl_coef * kl
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    per_token = per_token * m
    if agg == "token":
        loss = per_token.sum() / normalizer
    else:
        lengths = m.sum(dim=1).clamp(min=1.0)
        loss = (per_token.sum(dim=1) / lengths).sum() / normalizer
    with torch.no_grad():
        active = m > 0
        stats = GRPOLossStats(
            tokens=float(m.sum()),
            clipped=float(((clipped < unclipped) & active).sum()),  # the clip binds in the min
            ratio_sum=float((ratio * m).sum()),
            ratio_max=float(ratio[active].max()) if bool(active.any()) else 1.0,
            kl_sum=float((kl * m).sum()),
            pg_loss_sum=float(per_token.sum()),
        )
    return loss, stats
