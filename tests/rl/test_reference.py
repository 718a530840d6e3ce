"""The reference check's comparison (``megatron_spec.rl.reference``): equal greedy tokens pass, the first
difference is named with both engines' log-probs, and every rank raises on any owner's difference."""

from __future__ import annotations

import pytest

from megatron_spec.rl.reference import Comparison, ReferenceMismatch, compare_greedy, reference_metrics
from megatron_spec.rollout.types import SampleOutput


def sample(rid: str, ids: list[int], lps: list[float] | None = None) -> SampleOutput:
    return SampleOutput(rid, 0, ids, lps if lps is not None else [-0.5] * len(ids), "length", len(ids))


def test_equal_tokens_compare_equal_whatever_the_order():
    a = [sample("p0", [1, 2, 3]), sample("p1", [4, 5])]
    c = compare_greedy(a, list(reversed(a)))
    assert (c.equal, c.prompts, c.tokens, c.first_difference) == (2, 2, 5, None)


def test_the_first_difference_is_named_with_both_log_probs():
    mine = [sample("p0", [1, 2, 3]), sample("p1", [4, 5, 6], [-0.1, -0.2, -0.3])]
    ref = [sample("p0", [1, 2, 3]), sample("p1", [4, 9, 6], [-0.1, -0.25, -0.3])]
    c = compare_greedy(mine, ref, decode=lambda ids: " ".join(map(str, ids)))
    assert (c.equal, c.prompts, c.tokens) == (1, 2, 6)
    assert c.first_difference == (
        "request p1: position 1 after '4': the engine wrote token 5 (log-prob -0.2000), "
        "the reference 9 (log-prob -0.2500)"
    )


def test_a_response_that_ends_early_differs_where_it_ends():
    c = compare_greedy([sample("p0", [1, 2])], [sample("p0", [1, 2, 7])])
    assert (
        c.equal == 0
        and "position 2: the engine wrote token end (log-prob -), the reference 7" in c.first_difference
    )


def test_a_missing_reference_sample_is_an_error():
    with pytest.raises(ValueError, match="no sample for p1"):
        compare_greedy([sample("p1", [1])], [sample("p0", [1])])


def test_metrics_over_owners_and_a_difference_anywhere_stops_every_rank():
    ok = Comparison(equal=2, prompts=2, tokens=40, first_difference=None)
    assert reference_metrics([(ok, 1.5), None, (ok, 2.5)]) == {
        "health/reference_equal": 1.0, "health/reference_tokens": 80, "health/reference_s": 2.5}
    assert reference_metrics([None, None]) == {}
    bad = Comparison(equal=1, prompts=2, tokens=40, first_difference="request p1: position 3: ...")
    with pytest.raises(
        ReferenceMismatch, match=r"1 of 4 greedy probe prompts differ .* first: request p1: position 3"
    ):
        reference_metrics([(ok, 1.0), (bad, 1.0)])
