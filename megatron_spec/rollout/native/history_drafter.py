"""The history drafter: drafts a response from the responses the engine already generated for its prompt.

GRPO samples G responses per prompt and sees each prompt again in later steps; responses to one
prompt share long stretches (the same derivation, the same answer format). ``HistoryIndex``
(``megatron_spec.spec.history``: a suffix index per prompt, bounded, evicted by age) holds the
finished responses of each prompt, keyed by the prompt's token ids: the siblings finished earlier
in this ``generate`` call and the responses of earlier calls (one call = one index step). For a
running row the drafter proposes the continuation of the longest match of the row's response so
far (``HistoryIndex.propose``).

A proposal is deterministic: q is a point mass, verification accepts draft x with probability
p(x) and otherwise samples p without x (``megatron_spec.spec.verify``), so outputs follow the
target exactly. The drafter has no model and no cache; ``propose`` may return fewer than k tokens
per row (-1 padding ends the chain).

This module does not know about the engine's batch beyond slot numbers, nor about the other
drafter it may run beside (the engine chooses per row, ``engine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence


from megatron_spec.rollout.native.drafters import Drafter
from megatron_spec.rollout.native.rows import pad_rows


class HistoryDrafter(Drafter):
    kind = "history"

    def __init__(self, max_responses_per_prompt: int = 64, max_prompts: int = 4096, max_age_steps: int = 4,
                 min_match: int = 2):
        self._params = dict(max_responses_per_prompt=max_responses_per_prompt, max_prompts=max_prompts,
                            max_age_steps=max_age_steps, min_match=min_match)
        self.prompts: list[str | None] = []  # per slot: its prompt's key
        self.reset()

    def reset(self) -> None:
        """Forget every response (benchmarks: a workload whose prompts were seen exactly once)."""
        from megatron_spec.spec.history import HistoryIndex

        self.index = HistoryIndex(**self._params)
        self.step = 0

    def allocate(self, num_slots, max_len):
        self.prompts = [None] * num_slots

    def begin_call(self):
        self.step += 1
        self.index.advance_step(self.step)

    def move(self, src, dst):
        self.prompts[dst] = self.prompts[src]

    @staticmethod
    def key(prompt: Sequence[int]) -> str:
        """The index key of a prompt: its token ids (the same prompt in a later step finds its responses)."""
        return ",".join(map(str, prompt))

    def start(self, slot, prompt, first_token, last_aux):
        self.prompts[slot] = self.key(prompt)

    def finish(self, slot, prompt, output):
        self.index.add(self.key(prompt), list(output), step=self.step)

    def propose_lists(self, tokens: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to ``k`` drafts per row of slots ``0..B-1`` (possibly none)."""
        # the context is the whole sequence: its suffix is matched against the stored responses
        return [self.index.propose(self.prompts[b], seq, k)[:k] if k else [] for b, seq in enumerate(tokens)]

    def propose(self, tokens, k, sampling, generator):
        return pad_rows(self.propose_lists(tokens, k), k, -1, "cpu"), None  # on the host: the engine moves it once

    def stats(self) -> dict:
        return self.index.stats()
