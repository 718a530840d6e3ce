"""The history drafter: drafts a response from the responses the engine already generated for its prompt.

GRPO samples G responses per prompt and sees each prompt again in later steps; responses to one
prompt share long stretches (the same derivation, the same answer format). ``HistoryIndex``
(``megatron_spec.speculative.history``: a suffix index per prompt, bounded, evicted by age) holds the
finished responses of each prompt, keyed by the prompt's token ids: the siblings finished earlier
in this ``generate`` call and the responses of earlier calls (one call = one index step). For a
running row the drafter proposes the continuation of the longest match of the row's response so
far (``HistoryIndex.propose``).

A proposal is deterministic: q is a point mass, verification accepts draft x with probability
p(x) and otherwise samples p without x (``megatron_spec.speculative.verify``), so outputs follow the
target exactly. The drafter has no model and no cache; ``propose`` may return fewer than k tokens
per row (-1 padding ends the chain).

Beside the finished responses, the *live group index* (``megatron_spec.speculative.live``, on by default)
holds what the running rows of each prompt have emitted so far: every call to ``propose_rows``
first appends each row's newly emitted tokens to its group's index (``O(new tokens)``; those of the steps
between calls too, and a finishing row's last ones), then a row
gets the proposal of whichever of the two matched the longer suffix of its text (the live one on a
tie: it is this step's own text). Each row's :class:`HistoryProposal` says which (``"live"`` or
``"history"``; ``None``: no proposal) and, for a live one, its sibling support per token; ``sources[b]``
keeps the last one's source, for the engine's per-source statistics.

This module does not know about the engine's batch beyond slot numbers, nor about the other
drafter it may run beside (the engine chooses per row, ``engine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from megatron_spec.rollout.native.drafters import Drafter
from megatron_spec.rollout.native.rows import pad_rows


class HistoryProposal(NamedTuple):
    """One row's proposal from the history."""

    tokens: list[int]
    """Up to k drafts (possibly none)."""
    source: str | None
    """``"live"`` (the running siblings' text), ``"history"`` (the finished responses), None: no proposal."""
    support: list[tuple[int, int]] | None
    """A live proposal's sibling support per token (``LiveIndex.propose_with_support``), else None."""


class HistoryDrafter(Drafter):
    kind = "history"

    def __init__(self, max_responses_per_prompt: int = 64, max_prompts: int = 4096, max_age_steps: int = 4,
                 min_match: int = 2, live: bool = True):
        self._params = dict(max_responses_per_prompt=max_responses_per_prompt, max_prompts=max_prompts,
                            max_age_steps=max_age_steps, min_match=min_match)
        self.use_live = bool(live)
        self.prompts: list[str | None] = []  # per slot: its prompt's key
        self.rows: list[int | None] = []  # per slot: its row's id in the live index
        self.indexed: list[int] = []  # per slot: tokens of its sequence already in the live index
        self.sources: list[str | None] = []  # per slot: what drafted its last proposal
        self._next_row = 0
        self.reset()

    def reset(self) -> None:
        """Forget every response (benchmarks: a workload whose prompts were seen exactly once)."""
        from megatron_spec.speculative.history import HistoryIndex
        from megatron_spec.speculative.live import LiveIndex

        self.index = HistoryIndex(**self._params)
        self.live = LiveIndex(min_match=self._params["min_match"]) if self.use_live else None
        self.step = 0

    def allocate(self, num_slots, max_len):
        self.prompts = [None] * num_slots
        self.rows = [None] * num_slots
        self.indexed = [0] * num_slots
        self.sources = [None] * num_slots

    def begin_call(self):
        self.step += 1
        self.index.advance_step(self.step)
        if self.live is not None:  # no row of an earlier call runs on (one that failed never finished)
            self.live.groups.clear()

    def move(self, src, dst):
        self.prompts[dst] = self.prompts[src]
        self.rows[dst], self.indexed[dst], self.sources[dst] = (
            self.rows[src],
            self.indexed[src],
            self.sources[src],
        )

    @staticmethod
    def key(prompt: Sequence[int]) -> str:
        """The index key of a prompt: its token ids (the same prompt in a later step finds its responses)."""
        return ",".join(map(str, prompt))

    def start(self, slot, prompt, first_token, last_aux):
        key = self.prompts[slot] = self.key(prompt)
        if self.live is not None:
            self.rows[slot], self._next_row = self._next_row, self._next_row + 1
            self.live.start(key, self.rows[slot], prompt)
            self.indexed[slot] = len(prompt)  # the first token and what follows arrive with the proposals

    def finish(self, slot, prompt, output):
        key = self.key(prompt)
        self.index.add(key, list(output), step=self.step)
        if self.live is not None and slot < len(self.rows) and self.rows[slot] is not None \
                and self.prompts[slot] == key:
            # what the row emitted since the last proposals (steps that asked for none) stays for its siblings
            self.live.append(key, self.rows[slot], list(output)[max(0, self.indexed[slot] - len(prompt)):])
            self.live.finish(key, self.rows[slot])
            self.rows[slot] = None

    def propose_rows(self, tokens: Sequence[Sequence[int]], k: int) -> list[HistoryProposal]:
        """Per row of slots ``0..B-1``: up to ``k`` drafts (possibly none), whence, and a live proposal's
        support. Every row's tokens since the last call enter the live index first (a step the engine asked
        for no proposals did not call), so each row's proposal reads its siblings' text up to this step."""
        live_rows = self.live is not None
        if live_rows:
            for b, seq in enumerate(tokens):
                if self.rows[b] is not None:
                    self.live.append(self.prompts[b], self.rows[b], seq[self.indexed[b]:])
                    self.indexed[b] = len(seq)
        out = []
        for b, seq in enumerate(tokens):
            # the context is the whole sequence: its suffix is matched against the stored responses
            hist, matched = self.index.propose_match(self.prompts[b], seq, k) if k else ([], 0)
            hist = hist[:k]
            src = "history" if hist else None
            support = None
            if live_rows and k and self.rows[b] is not None:
                live, n, sup = self.live.propose_with_support(self.prompts[b], self.rows[b], k)
                if live and (not hist or n >= matched):
                    hist, src, support = live, "live", sup
            self.sources[b] = src
            out.append(HistoryProposal(hist, src, support))
        return out

    def propose(self, tokens, k, sampling, generator):
        # on the host: the engine moves it once
        return pad_rows([p.tokens for p in self.propose_rows(tokens, k)], k, -1, "cpu"), None

    def stats(self) -> dict:
        out = self.index.stats()
        if self.live is not None:
            out.update({f"live_{k}": v for k, v in self.live.stats().items()})
        return out
