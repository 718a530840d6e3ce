"""LiveIndex (``megatron_spec.speculative.live``): drafts from the in-progress responses of a prompt's rows.

What it must answer (siblings' continuations, the row's own earlier text, the prompt's tail at the
first token, never the row's own end), its bounds (occurrences per n-gram, tokens per group, a group
freed with its last row), its cost per appended token independent of the group's size, and the
history drafter that runs it beside the finished-response index (slots moved, sources reported).
Exactness of what the engine does with its drafts is tested through ``generate``
(tests/rollout/test_generate_distribution.py, tests/rollout/test_engine_exactness.py).
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from megatron_spec.speculative.live import LiveIndex

PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]


def test_a_row_drafts_what_a_sibling_wrote_after_the_same_text():
    ix = LiveIndex(max_match=4)
    ix.start("g", 0, PROMPT)
    ix.start("g", 1, PROMPT)
    ix.append("g", 0, [1, 2, 3, 4, 5, 6, 7])
    ix.append("g", 1, [9, 2, 3])
    assert ix.propose("g", 1, 3) == ([4, 5, 6], 2)  # "2 3" matched: what row 0 wrote next
    ix.append("g", 1, [4])
    assert ix.propose("g", 1, 10) == ([5, 6, 7], 3)  # a longer match, the sibling's text up to its end
    assert ix.propose("g", 0, 3) == ([], 0)  # row 0's own end has no continuation; nothing else matches


def test_the_prompt_tail_matches_the_siblings_openings():
    ix = LiveIndex(max_match=4)
    ix.start("g", 0, PROMPT)
    ix.append("g", 0, [7, 8, 9])
    ix.start("g", 1, PROMPT)  # a row at its first token: its text is the prompt's tail
    assert ix.length("g", 1) == 4
    assert ix.propose("g", 1, 2) == ([7, 8], 4)


def test_own_earlier_text_and_newest_occurrence_first():
    ix = LiveIndex(max_match=3)
    ix.start("g", 0, [])
    ix.append("g", 0, [5, 6, 1, 5, 6, 2, 5, 6])
    assert ix.propose("g", 0, 1) == ([2], 2)  # "5 6" last seen before "2"
    ix.start("g", 1, [])
    ix.append("g", 1, [5, 6, 3])
    ix.append("g", 0, [])
    assert ix.propose("g", 0, 1) == ([3], 2)  # the sibling's occurrence is newer


def test_the_continuation_most_siblings_wrote_is_proposed_with_its_support():
    # four siblings wrote on after "5 6": three of them "7 8 ...", the newest "9": the majority wins (the
    # newest occurrence alone would say 9), and each token says how many of the texts still agreeing wrote it
    ix = LiveIndex(max_match=2)
    for r, tail in enumerate([[7, 8, 1], [7, 8, 2], [7, 3], [9, 9]]):
        ix.start("g", r, [])
        ix.append("g", r, [5, 6] + tail)
    ix.start("g", 4, [])
    ix.append("g", 4, [5, 6])
    out, n, support = ix.propose_with_support("g", 4, 3)
    assert (out, n) == ([7, 8, 2], 2)  # the 2 texts wrote 1 and 2 after "7 8": a tie, the newest (2) wins
    assert support == [(3, 4), (2, 3), (1, 2)]
    assert ix.propose("g", 4, 3) == ([7, 8, 2], 2)
    # one candidate left: the rest of its text, each token supported by that one text
    ix.start("g", 5, [])
    ix.append("g", 5, [9])  # "9" is no n-gram of length 2: the row's own "x 9"... matches nothing yet
    assert ix.propose_with_support("g", 5, 2) == ([], 0, [])
    ix.append("g", 5, [9])  # "9 9": row 3 wrote it, at its end (no continuation); row 5's own end excluded
    assert ix.propose_with_support("g", 5, 2) == ([], 0, [])
    ix.append("g", 3, [4, 4])
    assert ix.propose_with_support("g", 5, 3) == ([4, 4], 2, [(1, 1), (1, 1)])
    with pytest.raises(ValueError, match="max_candidates"):
        LiveIndex(max_candidates=0)


def test_groups_are_isolated_and_freed_with_their_last_row():
    ix = LiveIndex()
    ix.start("a", 0, PROMPT)
    ix.start("b", 1, PROMPT)
    ix.append("a", 0, [1, 2, 3, 4])
    ix.append("b", 1, [1, 2])
    assert ix.propose("b", 1, 2) == ([], 0)  # only its own end matches "1 2" in its group
    ix.start("a", 2, PROMPT)
    ix.finish("a", 0)
    ix.append("a", 2, [1, 2])
    assert ix.propose("a", 2, 2) == ([3, 4], 8)  # a finished sibling's text stays for the running ones
    ix.finish("a", 2)
    assert "a" not in ix.groups and "b" in ix.groups
    assert ix.propose("a", 2, 2) == ([], 0)
    with pytest.raises(ValueError, match="already started"):
        ix.start("b", 1, PROMPT)


def test_bounds_and_bad_arguments():
    ix = LiveIndex(max_match=3, max_occurrences=2, max_tokens_per_group=20)
    ix.start("g", 0, [])
    ix.append("g", 0, [1, 2] * 20)
    g = ix.groups["g"]
    assert g.tokens == 20 and ix.stats()["capped"] == 20
    assert all(len(v) <= 2 for v in g.table.values())
    assert len(g.texts[0]) == 40  # past the bound the text is kept, not indexed
    for bad in [dict(min_match=0), dict(max_match=1, min_match=2), dict(max_occurrences=0),
                dict(max_tokens_per_group=0), dict(max_match=2.5)]:
        with pytest.raises(ValueError):
            LiveIndex(**bad)
    st = ix.stats()
    assert st["groups"] == 1 and st["rows"] == 1 and st["appended"] == 40


def test_append_cost_does_not_grow_with_the_group():
    """A GRPO group: 8 rows writing 4000 tokens each (similar texts), each row 40 tokens behind the
    one before (rows start and accept at different rates; a sibling helps only where it is ahead).
    The per-token append cost late in the group (32k tokens indexed) stays within a small factor of
    the cost early on; propose takes microseconds. The measured costs are printed (docs/benchmark_log.md
    quotes them)."""
    rng = random.Random(0)
    base = [rng.randrange(49152) for _ in range(4000)]
    texts = [[t if rng.random() > 0.15 else rng.randrange(49152) for t in base] for _ in range(8)]
    ix = LiveIndex()
    for r in range(8):
        ix.start("g", r, PROMPT)
    per_token: list[float] = []
    propose: list[float] = []
    hits = 0
    for step in range(0, 4000 + 8 * 40, 4):  # a verify step emits ~4 tokens per row
        for r in range(8):
            pos = step - 40 * r
            if not 0 <= pos < 4000:
                continue
            t0 = time.perf_counter()
            ix.append("g", r, texts[r][pos : pos + 4])
            per_token.append((time.perf_counter() - t0) / 4)
            t0 = time.perf_counter()
            out, _ = ix.propose("g", r, 4)
            propose.append(time.perf_counter() - t0)
            hits += bool(out) and r > 0
    early = statistics.median(per_token[: len(per_token) // 10])
    late = statistics.median(per_token[-len(per_token) // 10 :])
    st = ix.stats()
    print(
        f"live index: append {early * 1e6:.1f} us/token early, {late * 1e6:.1f} us/token at "
        f"{st['tokens']:.0f} "
        f"tokens; propose median {statistics.median(propose) * 1e6:.1f} us; hit rate {st['hit_rate']:.2f}, "
        f"mean match {st['mean_match']:.1f}"
    )
    assert late < 3 * early + 5e-6, (early, late)
    assert statistics.median(propose) < 1e-3
    assert hits > 0.5 * 7 * 1000  # the rows behind the first find what their siblings wrote (85% shared)


def _two_rows(prompt: list[int], **kw):
    """A history drafter (``kw``: its settings) in a call, two rows of ``prompt`` started in slots 0 and 1."""
    from megatron_spec.rollout.native.history_drafter import HistoryDrafter

    d = HistoryDrafter(**kw)
    d.allocate(4, 64)
    d.begin_call()
    d.start(0, prompt, 1, None)
    d.start(1, prompt, 1, None)
    return d


def test_history_drafter_runs_the_live_index_beside_the_finished_responses():
    prompt = [5, 6, 7]
    d = _two_rows(prompt)
    seqs = [prompt + [1, 2, 3, 4, 8, 9], prompt + [1, 2, 3]]
    assert [p.tokens for p in d.propose_rows(seqs, 2)] == [[], [4, 8]]  # row 1 follows row 0's text
    assert d.sources[:2] == [None, "live"]
    d.finish(0, prompt, [1, 2, 3, 4, 8, 9])  # slot 0 retires, slot 1 moves into it
    d.move(1, 0)
    assert d.propose_rows([prompt + [1, 2, 3, 4]], 2)[0][:2] == ([8, 9], "live") and d.sources[0] == "live"
    d.finish(0, prompt, [1, 2, 3, 4])
    assert d.live.groups == {}  # the prompt's last row is done
    # the finished response is in the history; a later row of the prompt draws from it
    d.begin_call()
    d.start(0, prompt, 1, None)
    assert d.propose_rows([prompt + [1, 2]], 3) == [([3, 4, 8], "history", None)]  # no support: finished text
    assert d.sources[0] == "history"
    off = _two_rows(prompt, live=False)
    assert [p.tokens for p in off.propose_rows(seqs, 2)] == [[], []] and off.live is None


def test_the_support_benchmark_replays_sibling_answers():
    """benchmarks/bench_live_support.py's lockstep replay, on answers made up so that the step that matters is
    known: three siblings write "5 6 7 0" twice, the fourth "5 6 8 0" then "5 6 7 0". At the second "5 6" (all
    rows next write 7) the newest earlier occurrence is the fourth row's (8: rejected by every row), the
    majority's is 7 (3 of 4 texts: accepted by every row)."""
    from tests.benchmark_modules import load_benchmark

    bench = load_benchmark("bench_live_support")
    rows = [[5, 6, 7, 0, 5, 6, 7, 0]] * 3 + [[5, 6, 8, 0, 5, 6, 7, 0]]
    res = bench.replay([[PROMPT] + rows], k=3, candidates=16)
    assert res["proposals"]["majority"] == res["proposals"]["newest"] > 0
    assert res["first_token_accepted"]["majority"] > res["first_token_accepted"]["newest"]
    first_majority = res["support_classes"]["majority, first"]
    # 7, written by 3 of the 4 texts
    assert first_majority["tried"] == 4 and first_majority["accepted"] == 1.0


def test_history_drafter_catches_up_the_steps_that_asked_for_no_proposals():
    """Steps the adaptive controller held at plain decoding ask the history drafter for nothing: the next call
    first indexes every row's tokens since its last one (so a row reads a sibling's text of this step), and
    a row finishing in between leaves its last tokens to its siblings."""
    prompt = [5, 6, 7]
    d = _two_rows(prompt)
    d.propose_rows([prompt + [1], prompt + [1]], 2)
    # three steps without a call; row 0 (behind) reads what row 1 wrote in them, indexed in this very call
    assert d.propose_rows([prompt + [1, 2], prompt + [1, 2, 3, 4]], 2)[0][:2] == ([3, 4], "live")
    d.finish(1, prompt, [1, 2, 3, 4, 8, 9])  # two more tokens, and row 1 is done without another call
    assert d.propose_rows([prompt + [1, 2, 3, 4]], 2)[0][:2] == ([8, 9], "live")
