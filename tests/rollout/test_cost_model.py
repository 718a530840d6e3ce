"""The adaptive controller's cost model (``rollout/native/cost_model.py``) on hand-computed values."""

from __future__ import annotations

import pytest

from megatron_spec.rollout.native.cost_model import (
    DraftOption,
    all_rows_rates,
    expected_tokens,
    expected_tokens_upto,
    history_rows_rates,
    token_threshold,
    tree_expected_tokens,
    tree_rows_rates,
    tree_tokens,
)


def test_all_rows_take_the_better_source_at_each_k():
    # one row: the main drafter at 0.5 per position, a history proposal of 1 token at 1.0.
    # k=0: 1 token; k=1: max(1 + .5, 1 + 1) = 2; k=2: max(1 + .5 + .25, 2) = 2.
    # T(1, k) = 0.1 + 0.05 k: rates 10, 2 / .15, 2 / .2
    opts = [[DraftOption([0.5, 0.5]), DraftOption([1.0], 1)]]
    rates = all_rows_rates(opts, range(0, 3), lambda b, k: 0.1 + 0.05 * k)
    assert rates == pytest.approx({0: 10.0, 1: 2 / 0.15, 2: 10.0})


def test_a_k_without_a_cost_is_left_out():
    rates = all_rows_rates([[DraftOption([0.5])]], range(0, 2), lambda b, k: None if k else 0.1)
    assert rates == pytest.approx({0: 10.0})


def test_all_rows_rates_is_the_per_k_sum_bit_for_bit():
    """One pass per option (``expected_tokens_upto``) gives exactly the floats of the definition, k by k:
    ``sum_b max_o expected_tokens(o, k) / T(B, k)`` (random rows, proposals, limits, missing costs)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        depth = rng.randint(1, 8)
        options = [
            [DraftOption([rng.random() for _ in range(depth)])]
            + ([DraftOption([rng.random() for _ in range(depth)], rng.choice([None, rng.randint(1, depth)]))]
               if rng.random() < 0.5 else [])
            for _ in range(rng.randint(1, 16))
        ]
        lo = rng.randint(0, depth)
        ks = range(lo, rng.randint(lo, depth) + 1)
        costs = {k: None if rng.random() < 0.2 else 0.01 + 0.002 * k for k in ks}
        want = {k: sum(max(expected_tokens(o.alpha, k, o.limit) for o in opts) for opts in options) / t
                for k, t in costs.items() if t is not None}
        assert all_rows_rates(options, ks, lambda b, k, costs=costs: costs[k]) == want
        o = options[0][-1]
        assert expected_tokens_upto(o.alpha, depth, o.limit) == [expected_tokens(o.alpha, k, o.limit)
                                                                 for k in range(depth + 1)]


def test_history_rows_rates_pack_the_rows_without_a_proposal():
    # 2 rows, one with a 2-token proposal at 1.0. k=1: verify of 2 + 1 = 3 tokens, packed (the other row
    # runs its last token only): 3 ms x 2 (packed_ratio); emits 2 + 1. k=2: 2 + 2 = 4 tokens, 8 ms; 3 + 1.
    opts = [[DraftOption([0.5]), DraftOption([1.0, 1.0], 2)], [DraftOption([0.5])]]
    rates = history_rows_rates(opts, 2, lambda tokens: 1e-3 * tokens, packed_ratio=2.0)
    assert rates == pytest.approx({1: 3 / 6e-3, 2: 4 / 8e-3})


def test_history_rows_rates_unpacked_when_every_row_drafts_k():
    # both rows carry a 1-token proposal at 0.5: k=1 is unpacked (no packed_ratio): 4 tokens, 4 ms, 3 emitted
    opts = [[DraftOption([0.9]), DraftOption([0.5], 1)]] * 2
    assert history_rows_rates(opts, 1, lambda t: 1e-3 * t, packed_ratio=5.0) == pytest.approx({1: 3 / 4e-3})


def test_history_rows_rates_empty_without_a_proposal():
    assert history_rows_rates([[DraftOption([0.5])]], 3, lambda t: 1.0, 1.0) == {}


def test_tree_tokens_are_the_union_of_the_branches():
    # main 0.5 per position, history 0.5 with a 2-token proposal, k=1, m=2: position 1 is reached by either
    # branch, 1 - .5 x .5 = .75; position 2 by the history alone, .25. E = 1 + .75 + .25 = 2.
    row = [DraftOption([0.5, 0.5]), DraftOption([0.5, 0.5], 2)]
    tokens = tree_tokens([row], k_main=2, k_tree=2)
    assert tokens[0, 1] == pytest.approx(2.0)
    assert tokens[0, 1] == pytest.approx(tree_expected_tokens([0.5, 0.5], 1, [0.5, 0.5], 2, 2))
    # the calibration scales the drafted part only: 1 + 0.5 x 1
    assert tree_tokens([row], 2, 2, calibration=0.5)[0, 1] == pytest.approx(1.5)
    # a row without a proposal drafts its main branch alone: 1 + .5 at k=1, whatever m
    assert tree_tokens([row[:1]], 2, 2)[0].tolist() == pytest.approx([1.5, 1.5])


def test_tree_rows_rates_add_the_proposal_to_the_verify():
    row = [DraftOption([0.5]), DraftOption([0.5], 1)]
    # k=1, m=1: 1 + .75 tokens over V(1 x 3) = 3 ms plus P_1 = 1 ms
    rates = tree_rows_rates([row], 1, 1, 1.0, lambda t: 1e-3 * t, lambda b, k: 1e-3 * k)
    assert rates == pytest.approx({(1, 1): 1.75 / 4e-3})
    assert tree_rows_rates([row[:1]], 1, 1, 1.0, lambda t: 1.0, lambda b, k: 1.0) == {}  # no history row
    assert tree_rows_rates([row], 1, 0, 1.0, lambda t: 1.0, lambda b, k: 1.0) == {}  # no tree


def test_token_threshold():
    # twice the tokens cost 30% more: one more token per row pays above probability 0.3
    assert token_threshold(10.0, 13.0) == pytest.approx(0.3)
    assert token_threshold(10.0, 25.0) == 1.0  # compute-bound: clipped
    assert token_threshold(10.0, 9.0) == 0.0
    assert token_threshold(None, 1.0) is None and token_threshold(1.0, None) is None
