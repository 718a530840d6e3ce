"""Live group index: drafts from the responses a prompt's sibling rows are writing *right now*.

GRPO generates the G samples of a prompt together, so in a step of fresh prompts the finished-response
history (``megatron_spec.speculative.history``) has little to offer while they run: the siblings finish
together. The siblings' text so far is already there, though: samples of one prompt share their
opening, their derivation steps and their answer format, and a response repeats itself (Seer,
arXiv 2511.14617, drafts from the in-progress responses of a group). ``LiveIndex`` holds, per group
(one prompt's rows), the text each running row has emitted so far, and proposes for a row the
continuation that a sibling (or the row itself, earlier) wrote after the longest n-gram that ends
the row's own text.

Structure: per group, a hash table from each n-gram (``min_match <= n <= max_match``) of every row's
text to its most recent occurrences ``(row, end position)`` (at most ``max_occurrences`` per n-gram,
the oldest dropped). A row's text starts with the last ``max_match`` tokens of the prompt, so a
row at its first response token already matches its siblings' openings.

* append: ``O(max_match)`` table updates per new token, whatever the group's size (the engine
  appends each verify step's emitted tokens, found by comparing the row's length with what was
  indexed: no rebuild);
* propose: at most ``max_match - min_match + 1`` lookups, longest n first; of the newest
  ``max_candidates`` occurrences with at least one token after it (not the row's own end), the
  continuation most of them wrote, token by token, up to k tokens, with each token's support (more
  tokens accepted a proposal than the newest occurrence's continuation alone, for twice its cost);
* memory: bounded per group (``max_tokens_per_group``; a group past it stops indexing, still
  proposes) and freed when the group's last row finishes (its responses then go to the history of
  finished responses, ``HistoryIndex``).

Why not the online suffix automaton the literature suggests (or the suffix array of the history):
the automaton's append is amortised ``O(1)`` but each state is a Python dict, a clone copies one, and
the state reached by a row's own text always has that row's end as an occurrence, so finding an
occurrence with a continuation needs per-state occurrence lists kept through clones; matches longer
than ~8 tokens almost never change which continuation is proposed (what follows a long match is
what follows its last 8 tokens, in the texts of one prompt). The bounded n-gram table has the same
append order, a fixed small constant, and plain tuple hashing in C. The suffix array of
``HistoryIndex`` is rebuilt per added response: right for finished responses, wrong for text that
grows every step. Appending and proposing cost microseconds a token, ~1 ms of a ~200 ms verify step of
SmolLM2-135M at batch 16 on 2 cores (docs/benchmark_log.md, "The live group index's costs").

Like ``HistoryIndex`` it knows no models or probabilities: a proposal is a point-mass draft that
the verifier accepts with the target's own probability, so the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from megatron_spec.speculative.history import proposal_stats

__all__ = ["LiveIndex"]


class _Group:
    __slots__ = ("texts", "table", "tokens", "live")

    def __init__(self) -> None:
        self.texts: dict[int, list[int]] = {}  # row id -> its text (prompt tail + response so far)
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.tokens = 0  # indexed tokens
        self.live = 0  # rows still running


class LiveIndex:
    """Per group, the text of its running rows, n-gram indexed (see the module docstring)."""

    def __init__(self, *, min_match: int = 2, max_match: int = 8, max_occurrences: int = 64,
                 max_tokens_per_group: int = 1 << 15, max_candidates: int = 16) -> None:
        for name, value, low in [
            ("min_match", min_match, 1),
            ("max_match", max_match, 1),
            ("max_occurrences", max_occurrences, 1),
            ("max_tokens_per_group", max_tokens_per_group, 1),
            ("max_candidates", max_candidates, 1),
        ]:
            if int(value) != value or value < low:
                raise ValueError(f"LiveIndex: {name} must be an integer >= {low}, got {value!r}")
        if max_match < min_match:
            raise ValueError(f"LiveIndex: max_match ({max_match}) < min_match ({min_match})")
        self.min_match, self.max_match = int(min_match), int(max_match)
        self.max_occurrences, self.max_tokens_per_group = int(max_occurrences), int(max_tokens_per_group)
        self.max_candidates = int(max_candidates)
        self.groups: dict[Hashable, _Group] = {}
        self._counts = dict.fromkeys(("proposals", "hits", "match_tokens", "proposed_tokens", "appended",
                                      "capped"), 0)

    # ---- rows ---------------------------------------------------------------------------------
    def start(self, group: Hashable, row: int, prompt: Sequence[int]) -> None:
        """A row of ``group`` starts (``row``: an id unique among the group's rows); its text begins
        with the prompt's last ``max_match`` tokens."""
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = _Group()
        if row in g.texts:
            raise ValueError(f"LiveIndex.start: row {row} of group {group!r} already started")
        g.texts[row] = []
        g.live += 1
        self.append(group, row, list(prompt[-self.max_match:]))

    def finish(self, group: Hashable, row: int) -> None:
        """The row is done; its text stays for the siblings until the group's last row finishes."""
        g = self.groups.get(group)
        if g is None or row not in g.texts:
            return
        g.live -= 1
        if g.live <= 0:
            del self.groups[group]

    def append(self, group: Hashable, row: int, tokens: Sequence[int]) -> None:
        """Index the row's new tokens: ``O(max_match)`` per token."""
        g = self.groups[group]
        text = g.texts[row]
        table, lo, hi, cap = g.table, self.min_match, self.max_match, self.max_occurrences
        for t in tokens:
            if g.tokens >= self.max_tokens_per_group:
                self._counts["capped"] += 1
                text.append(int(t))  # kept as text (a continuation source), no longer indexed
                continue
            text.append(int(t))
            p = len(text) - 1
            for n in range(lo, min(hi, p + 1) + 1):
                key = tuple(text[p - n + 1 : p + 1])
                occ = table.get(key)
                if occ is None:
                    table[key] = [(row, p)]
                else:
                    occ.append((row, p))
                    if len(occ) > cap:
                        del occ[0]
            g.tokens += 1
        self._counts["appended"] += len(tokens)

    def length(self, group: Hashable, row: int) -> int:
        """Tokens of the row's text (prompt tail included)."""
        return len(self.groups[group].texts[row])

    # ---- queries ------------------------------------------------------------------------------
    def propose(self, group: Hashable, row: int, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed, in the group's texts, the longest n-gram ending the row's
        text; with the match length (0: none). :meth:`propose_with_support` says how they are chosen."""
        out, n, _ = self.propose_with_support(group, row, k)
        return out, n

    def propose_with_support(self, group: Hashable, row: int, k: int
                             ) -> tuple[list[int], int, list[tuple[int, int]]]:
        """Up to ``k`` tokens continuing the row's text, the match length (0: none) and, per token, its
        support ``(agree, total)``.

        The candidates are the newest ``max_candidates`` occurrences of the longest n-gram ending the row's
        text that have a continuation (not the row's own end). Token j is the continuation most of the
        candidates still in the running wrote at offset j (ties: the newest occurrence's), ``total`` how
        many of them reach offset j and ``agree`` how many wrote that token; only those go on to j + 1.
        At T = 1 the siblings sampled from the policy after the same text, so the support is evidence of how
        likely the target is to write the proposed token (measured: ``benchmarks/bench_live_support.py``); the
        engine's controller learns what each support class is worth
        (``rollout.native.measures.SupportStats``)."""
        self._counts["proposals"] += 1
        g = self.groups.get(group)
        if g is None or k <= 0:
            return [], 0, []
        text = g.texts.get(row)
        if text is None:
            return [], 0, []
        end = len(text) - 1
        for n in range(min(self.max_match, len(text)), self.min_match - 1, -1):
            occ = g.table.get(tuple(text[-n:]))
            if not occ:
                continue
            # (source text, where its continuation starts), newest first
            cands: list[tuple[list[int], int]] = []
            for r, p in reversed(occ):
                src = g.texts[r]
                if p + 1 < len(src) and not (r == row and p == end):
                    cands.append((src, p + 1))
                    if len(cands) >= self.max_candidates:
                        break
            if not cands:
                continue
            out: list[int] = []
            support: list[tuple[int, int]] = []
            while len(out) < k and len(cands) > 1:
                j = len(out)
                counts: dict[int, int] = {}  # insertion order is recency: max() keeps the newest on a tie
                for src, s in cands:
                    if s + j < len(src):
                        counts[src[s + j]] = counts.get(src[s + j], 0) + 1
                if not counts:
                    break
                x = max(counts, key=counts.__getitem__)
                out.append(x)
                support.append((counts[x], sum(counts.values())))
                cands = [c for c in cands if c[1] + j < len(c[0]) and c[0][c[1] + j] == x]
            # one candidate left: the rest of its text, each token 1 of 1
            if len(out) < k and len(cands) == 1:
                src, s = cands[0]
                rest = src[s + len(out):s + k]
                out.extend(rest)
                support.extend([(1, 1)] * len(rest))
            if out:
                self._counts["hits"] += 1
                self._counts["match_tokens"] += n
                self._counts["proposed_tokens"] += len(out)
                return out, n, support
        return [], 0, []

    def stats(self) -> dict[str, float]:
        """``groups``, ``rows``, ``tokens`` (indexed), ``keys``, ``proposals``, ``hit_rate``,
        ``mean_match``, ``mean_proposal``, ``appended``, ``capped`` (tokens past a group's bound)."""
        c = self._counts
        return {
            "groups": float(len(self.groups)),
            "rows": float(sum(len(g.texts) for g in self.groups.values())),
            "tokens": float(sum(g.tokens for g in self.groups.values())),
            "keys": float(sum(len(g.table) for g in self.groups.values())),
            **proposal_stats(c),
            "appended": float(c["appended"]),
            "capped": float(c["capped"]),
        }
