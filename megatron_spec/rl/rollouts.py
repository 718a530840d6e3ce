"""Rollout records and the tensors the verifier's forward needs.

A :class:`Rollout` is one sample: prompt and response ids, the engine's log-probs (kept only
to measure train/rollout mismatch), reward, advantage, and the policy version that
generated it. :func:`pack` turns a list of them into right-padded ``[B, L]`` inputs with the
next-token targets and the response mask (1 where the target is a response token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """Split into ``parts`` contiguous chunks of equal size (the caller checked divisibility)."""
    size = len(items) // parts
    return [items[i * size:(i + 1) * size] for i in range(parts)]


def micro_batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
