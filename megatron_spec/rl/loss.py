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

The truncated-IS weight multiplies the whole per-token loss, KL term included: both are
estimated on samples the engine drew, so both get the same off-policy correction.

Tokens outside a support (top-k / top-p / min-p). A log-prob of ``-inf`` means the token is
outside that policy's processed distribution. The caller removes tokens outside the *old*
policy's support from ``mask`` before the step (it counts them, ``mismatch/out_of_support_frac``).
Inside this function, a masked token whose current (or old) log-prob is not finite is read as
ratio 0, which the clipped surrogate turns into a constant: it adds nothing to the loss or the
gradient but still counts in ``normalizer`` (``out_of_support`` in the stats); a token whose
reference log-prob is not finite adds no KL term (the k3 estimate is +inf there). Non-finite
values never reach ``exp`` or the backward pass: no NaN, whatever the supports.

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
    out_of_support: float = 0.0


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
    on = m > 0
    valid = on & torch.isfinite(logprobs) & torch.isfinite(old_logprobs)  # [B, T]
    v = valid.to(logprobs.dtype)
    # where() before any exp: -inf never reaches a backward that multiplies by it
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    ratio = log_ratio.exp() * v  # 0 where the current or old policy excludes the token
    a = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    unclipped = ratio * a
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * a
    pg = -torch.minimum(unclipped, clipped) * v  # [B, T]
    kl = torch.zeros_like(pg)
    if kl_coef > 0:
        valid_kl = valid & torch.isfinite(ref_logprobs)
        d = torch.where(valid_kl, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = (d.exp() - d - 1.0) * valid_kl.to(logprobs.dtype)
    per_token = pg + kl_coef * kl
    w = None
    if is_weights is not None:
        w = torch.where(valid, is_weights.detach(), torch.zeros_like(is_weights))
        per_token = per_token * w
    per_token = per_token * m
    if agg == "token":
        loss = per_token.sum() / normalizer
    else:
        lengths = m.sum(dim=1).clamp(min=1.0)
        loss = (per_token.sum(dim=1) / lengths).sum() / normalizer
    with torch.no_grad():
        binds = (clipped < unclipped) & valid  # the clip binds in the min
        ratio_max = torch.where(valid, ratio, torch.full_like(ratio, float("-inf"))).max()
        ratio_max = torch.where(valid.any(), ratio_max, torch.ones_like(ratio_max))  # no valid token: 1
        parts = (m.sum(), binds.sum(), (ratio * m).sum(), ratio_max, (kl * m).sum(),
                 (pg * m * (w if w is not None else 1.0)).sum(), (on & ~valid).sum())
        # one host sync per call: the statistics are host floats (each exactly its tensor's value)
        values = torch.stack([x.to(torch.float64) for x in parts]).tolist()
        stats = GRPOLossStats(
            tokens=values[0],
            clipped=values[1],
            ratio_sum=values[2],
            ratio_max=values[3],
            kl_sum=values[4],
            pg_loss_sum=values[5],
            out_of_support=values[6],
        )
    return loss, stats
