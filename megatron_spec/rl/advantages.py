"""Group-relative advantages (GRPO, Shao et al. 2024, eq. 3 with outcome rewards).

For G samples of one prompt with rewards r_1..r_G: A_i = (r_i - mean(r)) / (std(r) + eps),
the same value at every token of sample i. ``baseline="batch"`` uses the mean/std over the
whole batch instead (useful when all samples of a group coincide, e.g. greedy rollouts).
Pure function of tensors.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, baseline: str = "group",
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Args: rewards ``[P * G]`` ordered group by group. Returns ``[P * G]`` float32."""
    r = rewards.float()
    if r.dim() != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be [P*G] with G={group_size}, got shape {tuple(r.shape)}")
    if baseline == "group":
        g = r.view(-1, group_size)  # [P, G]
        centred = g - g.mean(dim=1, keepdim=True)
        scale = (
            g.std(dim=1, unbiased=False, keepdim=True) if normalize_std else torch.ones_like(centred[:, :1])
        )
        return (centred / (scale + eps)).reshape(-1)
    if baseline == "batch":
        centred = r - r.mean()
        return centred / (r.std(unbiased=False) + eps) if normalize_std else centred
    raise ValueError(f"baseline must be 'group' or 'batch', got {baseline!r}")
