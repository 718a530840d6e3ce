"""Rollout records and the tensors the verifier's forward needs.

A :class:`Rollout` is one sample: prompt and response ids, the engine's log-probs (kept only
to measure train/rollout mismatch), reward, advantage, and the policy version that
generated it. :func:`pack` turns a list of them into right-padded ``[B, L]`` inputs with the
next-token targets and the response mask (1 where the target is a response token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_spec.rollout.types import FINISH_LENGTH


@dataclass
class Rollout:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: str
    policy_version: int
    accepted_per_step: list[int] = field(default_factory=list)
    num_verify_steps: int = 0
    reward: float = 0.0
    advantage: float = 0.0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, L] right-padded
    position_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] next tokens
    mask: torch.Tensor  # [B, L-1] float, 1 on response targets
    advantages: torch.Tensor  # [B]
    engine_logprobs: torch.Tensor  # [B, L-1] aligned with targets (0 off the response)


def pack(rollouts: list[Rollout], pad_id: int = 0, device: torch.device | str = "cpu") -> PackedBatch:
    """Right-pad a micro-batch; position p of ``targets`` is the token at p+1.

    The batch is built in host memory and lands on ``device`` (the model's) in one copy per tensor.
    """
    b = len(rollouts)
    length = max(r.length for r in rollouts)
    host = torch.device("cpu")  # staged row by row in host memory, then one copy per tensor
    ids = torch.full((b, length), pad_id, dtype=torch.long, device=host)
    mask = torch.zeros(b, length - 1, device=host)
    eng = torch.zeros(b, length - 1, device=host)
    for i, r in enumerate(rollouts):
        seq = r.prompt_ids + r.response_ids
        ids[i, :len(seq)] = torch.tensor(seq, device=host)
        start = len(r.prompt_ids) - 1  # logits at the last prompt position predict response[0]
        n = len(r.response_ids)
        mask[i, start:start + n] = 1.0
        eng[i, start:start + n] = torch.tensor(r.engine_logprobs[:n], dtype=torch.float32, device=host)
    positions = torch.arange(length, device=host).expand(b, length)
    adv = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32, device=host)
    ids, positions, mask, adv, eng = (t.to(device) for t in (ids, positions, mask, adv, eng))
    return PackedBatch(ids, positions, ids[:, 1:], mask, adv, eng)


def split(items: list, parts: int) -> list[list]:
    """Split into ``parts`` contiguous chunks whose sizes differ by at most one; nothing is dropped.

    The first ``len % parts`` chunks hold one item more. A run whose rollouts divide evenly (what
    the launcher checks without dynamic sampling) gets equal chunks; a step that dynamic sampling
    or truncation filtering shortened gets near-equal ones (some possibly empty).
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def micro_batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def select_for_training(rollouts: list[Rollout], group_size: int, *, drop_equal_reward_groups: bool = False,
                        drop_truncated: bool = False) -> tuple[list[Rollout], int, int]:
    """The rollouts that enter the loss, and (groups dropped, truncated responses dropped).

    ``drop_equal_reward_groups`` (DAPO's dynamic sampling, Yu et al. 2025): a group whose G rewards
    are all equal has group-relative advantages of exactly 0 and no policy gradient; it is dropped
    instead of diluting the token mean. No replacement groups are generated: the step trains on
    fewer rollouts. ``rollouts`` must then be whole groups in order (G consecutive samples of one
    prompt, as the advantages were computed). ``drop_truncated``: responses cut at the length
    limit (finish reason ``length``) take no part in the loss; they have already served in their
    group's baseline.
    """
    kept, groups_dropped = list(rollouts), 0
    if drop_equal_reward_groups:
        if len(rollouts) % group_size:
            raise ValueError(
                f"--dynamic-sampling needs whole groups on every data-parallel rank: {len(rollouts)} "
                f"rollouts are not groups of {group_size} (make --prompts-per-step a multiple of the "
                f"data-parallel size)"
            )
        kept = []
        for i in range(0, len(rollouts), group_size):
            group = rollouts[i:i + group_size]
            if len({r.prompt_index for r in group}) != 1:
                raise ValueError(f"rollouts {i}..{i + group_size - 1} mix prompts "
                                 f"{sorted({r.prompt_index for r in group})}: not ordered group by group")
            if all(r.reward == group[0].reward for r in group):
                groups_dropped += 1
            else:
                kept.extend(group)
    truncated = 0
    if drop_truncated:
        truncated = sum(r.finish_reason == FINISH_LENGTH for r in kept)
        kept = [r for r in kept if r.finish_reason != FINISH_LENGTH]
    return kept, groups_dropped, truncated
