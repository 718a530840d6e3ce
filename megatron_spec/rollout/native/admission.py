"""Which waiting requests join the batch, and a prompt with more samples than the batch has slots.

A request asks for ``n`` samples of one prompt; the engine prefills the prompt once and copies its cache
into the slots of the samples (``EngineCore.start``). A request joins when all its samples fit the free
slots. One with more samples than the batch has slots (a GRPO group of 64 on an engine of 16) joins with
as many as are free, and its prompt's prefill is *parked* (:class:`ParkedPrompt`: the cache in a slot of
its own beyond the batch's, the last position's logits and aux state) until slots free up for the others,
which start from it without a second prefill, as vLLM's and SGLang's prefix caches let the samples of one
prompt do. Every sample's first token is drawn from the prompt's own last-position distribution.

Splitting every request that does not fit (rather than leaving slots idle until it does) was measured on
the real model's GRPO workload (16 prompts x 8 samples, 16 slots, T=1, 6 paired rounds; docs/benchmark_log.md,
"Idle slots and the GRPO workload"): idle slot-steps while requests waited fell from 5-8% to under 1%, but
plain decoding ran 0.92x as fast (the samples of a wave no longer start and end together: more prefills
ride along a decode step, more rows pad their attention to a longer one) and adaptive speculation 1.035x.
So a request that fits the batch waits for its slots, as before.

:func:`plan_admission` is the policy, a function of the queue and the free slots; it knows nothing of
caches or models.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch

from megatron_spec.rollout.types import GenerateRequest


@dataclasses.dataclass
class ParkedPrompt:
    """A prompt some of whose samples are still to start: its prefill kept in the parking slot."""

    req: GenerateRequest
    next_sample: int
    """The first of its samples not started yet."""
    logits: torch.Tensor
    """``[V]`` the target's logits at the prompt's last position (every sample's first token is drawn from
    them)."""
    last_aux: torch.Tensor | None
    """``[A]`` the target's aux state at the prompt's last position (what the drafter starts a sample from),
    or None."""
    length: int
    """The prompt's length: the cache positions the samples copy."""

    @property
    def remaining(self) -> int:
        return self.req.n - self.next_sample


def plan_admission(waiting: deque, free: int, token_budget: int, may_split: bool, slots: int) -> tuple[
        list[GenerateRequest], list[int]]:
    """Take requests off the head of ``waiting`` for ``free`` of the batch's ``slots``, their prompts'
    tokens within ``token_budget`` (the first prompt always fits); returns them and the samples each starts
    now. A request all of whose samples fit starts them all; with ``may_split`` (the parking slot is free)
    one with more samples than ``slots`` takes the free slots and is the last taken (the rest of its samples
    park)."""
    batch: list[GenerateRequest] = []
    counts: list[int] = []
    tokens = 0
    while waiting and free > 0:
        nxt = waiting[0]
        if batch and tokens + len(nxt.input_ids) > token_budget:
            break
        if nxt.n > free and not (may_split and nxt.n > slots):
            break
        batch.append(waiting.popleft())
        counts.append(min(nxt.n, free))
        tokens += len(nxt.input_ids)
        free -= counts[-1]
        if counts[-1] < nxt.n:
            break
    return batch, counts
