"""History drafter index: propose continuations from responses already generated for the same prompt.

In GRPO a prompt is sampled ``n`` times per step and seen again in later steps, so a response in
progress often repeats stretches of its siblings (the other samples of this step) and of earlier
steps' responses to the prompt (Seer; SPEC-RL; DAS). ``HistoryIndex`` keeps those responses per
prompt and proposes the continuation of the longest suffix of the current context (prompt + response
so far) that occurs in one of them. The proposal is a deterministic draft: the verifier checks it
with a point-mass draft distribution (accept ``x`` with probability ``p(x)``, else sample ``p`` with
``x`` removed and renormalised: ``megatron_spec.speculative.verify_chain`` with ``draft_probs=None``), so
the emitted tokens follow the target exactly whatever this index proposes.

Structure: per prompt, one *segment* per step (split when it would pass ``_SEGMENT_TOKENS``
tokens). A segment stores its responses reversed and concatenated, separated by -1, as an int32
``array``, and a suffix array over that text, sorted by each suffix's first ``_MATCH_DEPTH`` tokens
(numpy prefix doubling, ``log2(_MATCH_DEPTH)`` rounds). The longest suffix of the context that occurs
in a response is the longest prefix of the reversed context that starts some suffix of the reversed
text: one binary search (``bisect`` comparing int32 slices in C) and the common-prefix lengths with
the two neighbours of the insertion point. The continuation is read backwards from the match start,
up to the separator (the end of that response).

Why a suffix array (and not a suffix automaton or a trie):
* memory: 8 bytes per stored token (text + suffix array, int32), the bound that matters with
  thousands of prompts x tens of responses; a suffix automaton or trie in Python objects costs
  hundreds of bytes per token (a dict per state);
* eviction: responses leave by age, a whole step at a time, which drops whole segments; the size
  bound rebuilds one segment. A suffix automaton cannot delete (eviction would rebuild it anyway);
* query: ``O(log n)`` slice comparisons in C plus two common-prefix scans, a few microseconds per
  segment (benchmarks in ``tests/speculative/test_spec_history.py``); an automaton walk is ``O(match)``
  Python steps, no faster in practice.
Matches are compared over at most ``_MATCH_DEPTH`` tokens: a longer common suffix is reported as
``_MATCH_DEPTH`` long (the continuation is that of one occurrence either way).

This module knows nothing about models, tokenizers, engines or verification; it never sees
probabilities. Token ids are non-negative ints below 2**31.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["HistoryIndex"]

_MATCH_DEPTH = 64  # tokens compared per match (suffix array order and binary search)
_SEGMENT_TOKENS = 16384  # a step's responses to one prompt are split into segments of about this many tokens
_SEP = -1  # between reversed responses: never equal to a token id, and below all of them


def _suffix_array(text: np.ndarray, depth: int) -> array:
    """Start positions of the suffixes of ``text [n]``, sorted by their first ``depth`` tokens.

    Lexicographic as Python compares ``array`` slices (a proper prefix sorts first), by prefix
    doubling: after the round with span ``h`` the ranks order the suffixes by their first ``2h``
    tokens. Ties beyond ``depth`` are in no particular order.
    """
    n = int(text.size)
    if n == 0:
        return array("i")
    rank = text.astype(np.int64) + 1  # separator -> 0, tokens -> >= 1; past the end -> -1 below
    sa = np.argsort(rank, kind="stable")
    h = 1
    while h < depth:
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[: n - h] = rank[h:]
        sa = np.lexsort((nxt, rank))  # primary rank, then the rank h tokens on
        r, s = rank[sa], nxt[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate(([0], np.cumsum((r[1:] != r[:-1]) | (s[1:] != s[:-1]))))
        rank = new
        h *= 2
        if int(rank[sa[-1]]) == n - 1:  # all distinct: the order is final
            break
    return array("i", sa.astype(np.int32).tobytes())


def _common_prefix(a: array, a0: int, b: array, limit: int) -> int:
    """Length of the common prefix of ``a[a0:]`` and ``b`` over at most ``limit`` tokens.

    Binary search on the length with slice equality (compared in C): ``log2(limit)`` comparisons
    instead of a Python loop over the tokens.
    """
    lo, hi = 0, min(limit, len(a) - a0, len(b))  # invariant: the first lo tokens agree
    if a[a0: a0 + hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # and the first hi do not
        mid = (lo + hi) // 2
        if a[a0: a0 + mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Segment:
    """Reversed responses of one prompt and step, and their suffix array."""

    __slots__ = ("step", "lengths", "text", "sa")

    def __init__(self, step: int) -> None:
        self.step = step
        self.lengths: list[int] = []  # response lengths, oldest first
        self.text = array("i")  # rev(r0) -1 rev(r1) -1 ...
        self.sa = array("i")

    @property
    def num_tokens(self) -> int:
        return len(self.text) - len(self.lengths)

    def add(self, token_ids: Sequence[int]) -> None:
        self.text.extend(reversed(token_ids))
        self.text.append(_SEP)
        self.lengths.append(len(token_ids))
        self._index()

    def drop_oldest(self) -> None:
        n = self.lengths.pop(0)
        del self.text[: n + 1]
        self._index()

    def _index(self) -> None:
        self.sa = _suffix_array(np.frombuffer(self.text, dtype=np.int32), _MATCH_DEPTH)

    def longest(self, pattern: array) -> tuple[int, int]:
        """``(length, start)`` of the longest prefix of ``pattern`` that starts a suffix of the text."""
        text, sa, L = self.text, self.sa, len(pattern)
        i = bisect.bisect_left(sa, pattern, key=lambda s: text[s: s + L])
        best, start = 0, -1
        # The longest common prefix is with a neighbour of the insertion point. sa[i - 1] sorts
        # strictly below the pattern, so only sa[i] can match all of it: then it alone is the answer.
        for j in (i, i - 1):
            if 0 <= j < len(sa):
                s = sa[j]
                m = _common_prefix(text, s, pattern, L)
                if m > best or (m == best and m > 0 and s > start):  # of the two, the later response
                    best, start = m, s
                if best == L:
                    break
        return best, start

    def continuation(self, start: int, k: int) -> list[int]:
        """The ``k`` tokens after a match starting at ``start`` (reversed text: read backwards)."""
        out = []
        t = start - 1
        while len(out) < k and t >= 0 and self.text[t] != _SEP:
            out.append(self.text[t])
            t -= 1
        return out


class HistoryIndex:
    """Suffix index over the responses to each prompt: this step's siblings and recent steps' responses.

    Bounded: at most ``max_prompts`` prompts (the one added to least recently leaves first), at most
    ``max_responses_per_prompt`` responses per prompt (the oldest leave first), and responses older
    than ``max_age_steps`` steps leave at ``advance_step``. Memory is 8 bytes per stored token
    (``stats()["bytes"]``): at most ``max_prompts * max_responses_per_prompt`` responses (2 GiB of
    1000-token responses at the defaults), in GRPO the prompts of the last ``max_age_steps + 1``
    steps times their samples.
    """

    def __init__(self, *, max_responses_per_prompt: int = 64, max_prompts: int = 4096, max_age_steps: int = 4,
                 min_match: int = 2) -> None:
        for name, value, low in [("max_responses_per_prompt", max_responses_per_prompt, 1),
                                 ("max_prompts", max_prompts, 1), ("max_age_steps", max_age_steps, 0),
                                 ("min_match", min_match, 1)]:
            if int(value) != value or value < low:
                raise ValueError(f"HistoryIndex: {name} must be an integer >= {low}, got {value!r}")
        self.max_responses_per_prompt = int(max_responses_per_prompt)
        self.max_prompts = int(max_prompts)
        self.max_age_steps = int(max_age_steps)
        self.min_match = int(min_match)
        self._prompts: OrderedDict[str, list[_Segment]] = OrderedDict()
        self._step = 0
        self._counts = dict.fromkeys(("proposals", "hits", "match_tokens", "proposed_tokens", "added",
                                      "evicted_age", "evicted_size", "evicted_prompt", "dropped_stale"), 0)

    # ---- updates ------------------------------------------------------------------------------
    def add(self, prompt_key: str, token_ids: Sequence[int], *, step: int) -> None:
        """Store a finished response to ``prompt_key`` generated at ``step``."""
        if step < self._step - self.max_age_steps:
            self._counts["dropped_stale"] += 1  # already older than the age bound
            return
        if len(token_ids) == 0:
            return
        if min(token_ids) < 0 or max(token_ids) >= 2**31:
            raise ValueError(f"HistoryIndex.add: token ids must lie in [0, 2**31), got min {min(token_ids)} "
                             f"max {max(token_ids)} for prompt {prompt_key!r}")
        segments = self._prompts.get(prompt_key)
        if segments is None:
            if len(self._prompts) >= self.max_prompts:
                _, old = self._prompts.popitem(last=False)
                self._counts["evicted_prompt"] += sum(len(s.lengths) for s in old)
            segments = self._prompts[prompt_key] = []
        else:
            self._prompts.move_to_end(prompt_key)
        seg = segments[-1] if segments else None
        if seg is None or seg.step != step or seg.num_tokens + len(token_ids) > _SEGMENT_TOKENS:
            seg = _Segment(step)
            segments.append(seg)
        seg.add(token_ids)
        self._counts["added"] += 1
        n = sum(len(s.lengths) for s in segments)
        while n > self.max_responses_per_prompt:
            oldest = min(segments, key=lambda s: s.step)  # stable: the first of the oldest step
            if len(oldest.lengths) == 1:
                segments.remove(oldest)
            else:
                oldest.drop_oldest()
            n -= 1
            self._counts["evicted_size"] += 1

    def advance_step(self, step: int) -> None:
        """Start ``step``: responses from steps before ``step - max_age_steps`` leave."""
        self._step = step
        oldest_kept = step - self.max_age_steps
        for key in list(self._prompts):
            segments = self._prompts[key]
            keep = [s for s in segments if s.step >= oldest_kept]
            if len(keep) != len(segments):
                self._counts["evicted_age"] += sum(len(s.lengths) for s in segments if s.step < oldest_kept)
                if keep:
                    self._prompts[key] = keep
                else:
                    del self._prompts[key]

    # ---- queries ------------------------------------------------------------------------------
    def propose(self, prompt_key: str, context_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing the longest suffix of ``context_ids`` found in the prompt's
        stored responses; ``[]`` when no suffix of at least ``min_match`` tokens occurs."""
        return self.propose_match(prompt_key, context_ids, k)[0]

    def propose_match(self, prompt_key: str, context_ids: Sequence[int], k: int) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the length of the suffix they continue (0 with no tokens)."""
        self._counts["proposals"] += 1
        segments = self._prompts.get(prompt_key)
        if not segments or k <= 0 or len(context_ids) < self.min_match:
            return [], 0
        tail = context_ids[-_MATCH_DEPTH:]
        pattern = array("i", reversed(tail))
        if min(pattern) < 0:  # not a token (padding): match only what follows it, never a separator
            pattern = pattern[: next(i for i, t in enumerate(pattern) if t < 0)]
            if len(pattern) < self.min_match:
                return [], 0
        best, best_seg, best_start = 0, None, -1
        for seg in reversed(segments):  # newest first: ties keep the newer segment
            m, s = seg.longest(pattern)
            if m > best:
                best, best_seg, best_start = m, seg, s
                if best == len(pattern):  # an older segment could only tie
                    break
        if best < self.min_match:
            return [], 0
        out = best_seg.continuation(best_start, k)
        if out:
            self._counts["hits"] += 1
            self._counts["match_tokens"] += best
            self._counts["proposed_tokens"] += len(out)
        return out, best if out else 0

    def stats(self) -> dict[str, float]:
        """Sizes and counters: ``prompts``, ``responses``, ``tokens``, ``segments``, ``proposals``,
        ``hit_rate`` (proposals that returned tokens), ``mean_match`` and ``mean_proposal`` (tokens, over
        hits), ``added``, ``evicted_age`` / ``evicted_size`` / ``evicted_prompt`` (responses),
        ``dropped_stale`` (responses added already past the age bound), ``bytes`` (text + suffix arrays)."""
        segs = [s for segments in self._prompts.values() for s in segments]
        c = self._counts
        return {
            "prompts": float(len(self._prompts)),
            "responses": float(sum(len(s.lengths) for s in segs)),
            "tokens": float(sum(s.num_tokens for s in segs)),
            "segments": float(len(segs)),
            "bytes": float(sum(len(s.text) * s.text.itemsize + len(s.sa) * s.sa.itemsize for s in segs)),
            **proposal_stats(c),
            "added": float(c["added"]),
            "evicted_age": float(c["evicted_age"]),
            "evicted_size": float(c["evicted_size"]),
            "evicted_prompt": float(c["evicted_prompt"]),
            "dropped_stale": float(c["dropped_stale"]),
        }


def proposal_stats(counts: dict[str, int]) -> dict[str, float]:
    """``proposals``, ``hit_rate``, ``mean_match``, ``mean_proposal`` from an index's counters ``proposals``,
    ``hits``, ``match_tokens``, ``proposed_tokens`` (the history and the live index count alike)."""
    hits, n = counts["hits"], counts["proposals"]
    return {"proposals": float(n), "hit_rate": hits / n if n else 0.0,
            "mean_match": counts["match_tokens"] / hits if hits else 0.0,
            "mean_proposal": counts["proposed_tokens"] / hits if hits else 0.0}
