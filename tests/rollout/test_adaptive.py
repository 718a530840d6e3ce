"""The adaptive draft-length controller (rollout/native/adaptive.py) and its flags.

Hand-computed cases: with a verify cost flat in the step's tokens (memory-bound) and every draft
accepted, the longest k wins; with no draft ever accepted, k = 0; a cost linear in the tokens
(compute-bound) at alpha = 0.5 makes k = 0 best (E(k) = 2 - 2^-k < k + 1 for k >= 1).
"""

from __future__ import annotations

import pytest

from megatron_spec.config import ConfigError, RunConfig
from megatron_spec.rollout.native.adaptive import (
    AcceptanceStats,
    CostTable,
    DraftLengthController,
    StepPlan,
)
from megatron_spec.rollout.native.cost_model import DraftOption as O
from megatron_spec.rollout.native.cost_model import expected_tokens, size_class
from megatron_spec.rollout.native.measures import SupportStats, paying_prefix, support_class
from megatron_spec.rollout.native.spec_worker import plan_step


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable()
    assert t.estimate(4) is None
    t.update(4, 2.0)
    assert t.estimate(2) == pytest.approx(1.0)  # one point: proportional to the size
    t.update(8, 3.0)
    assert t.estimate(6) == pytest.approx(2.5)  # between the two
    assert t.estimate(12) == pytest.approx(4.0)  # slope of the two nearest
    t.update(8, 4.0)  # under `trust` (3) measurements: the fastest
    assert t.estimate(8) == pytest.approx(3.0)
    t.update(8, 2.2)  # from 3 on, the median of the window
    assert t.estimate(8) == pytest.approx(3.0)
    t.update(8, 30.0)  # one slow outlier (interference) moves the median by one rank only
    t.update(8, 0.1)  # and so does one lucky fast step
    assert t.estimate(8) == pytest.approx(3.0)


def test_cost_table_window_follows_a_lasting_change():
    t = CostTable(window=3)
    for s in (1.0, 1.0, 1.0):
        t.update(4, s)
    for s in (2.0, 2.0):  # the machine got slower: two of the three kept measurements say so
        t.update(4, s)
    assert t.estimate(4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="window"):
        CostTable(window=0)
    cold = CostTable()
    cold.update(64, 0.200)  # the first call of a new shape builds its kernels
    cold.update(64, 0.050)
    assert cold.estimate(64) == pytest.approx(0.050)  # one warm call is enough to price it


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 1.0, 1.0], 3, limit=1) == pytest.approx(2.0)  # a proposal of one token


def test_acceptance_counts_positions_tried():
    s = AcceptanceStats(4)
    s.record(4, 1)  # position 1 accepted, position 2 rejected, 3 and 4 never checked
    assert s.tried == [1, 1, 0, 0] and s.accepted == [1, 0, 0, 0]
    s.record(2, 2)
    assert s.tried == [2, 2, 0, 0] and s.accepted == [2, 1, 0, 0]


def _choose_k(ctl: DraftLengthController, options) -> int:
    """k for the next step with every row drafting from the main drafter (the controller's choice among
    fixed-k steps alone, without the history and tree modes)."""
    return ctl._pick(ctl.expected_rates(options), {}, {}).k


def _train(ctl: DraftLengthController, b: int, cost, accept: float, steps: int = 200) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = _choose_k(ctl, [[O(ctl.row_alpha("d", None))]] * b)
        chosen.append(k)
        for _ in range(b):  # acceptance deterministic in expectation: accept `accept` of the positions
            ctl.record_accept("d", None, k, round(accept * k))
        ctl.record_step(b, k, cost(b * (k + 1)), 0.01 * b * k, prefill=False)
    return chosen


def test_controller_picks_k_max_when_cheap_and_accepted():
    ctl = DraftLengthController(5)
    chosen = _train(ctl, 2, lambda n: 1.0, accept=1.0)
    assert max(set(chosen[-50:]), key=chosen[-50:].count) == 5


def test_controller_picks_zero_when_nothing_accepted():
    ctl = DraftLengthController(5)
    chosen = _train(ctl, 2, lambda n: 1.0 + 0.01 * n, accept=0.0)
    assert max(set(chosen[-50:]), key=chosen[-50:].count) == 0


def test_controller_picks_zero_when_compute_bound():
    ctl = DraftLengthController(4)
    chosen = _train(ctl, 16, lambda n: 0.01 * n, accept=0.5)
    assert max(set(chosen[-50:]), key=chosen[-50:].count) == 0


def test_exploration_skips_a_neighbour_that_loses_badly():
    # compute-bound: k = 1 costs ~2 plain steps for 1.5 tokens per row; it is tried only on the rare
    # exploration steps (every 64th), not on every 8th
    ctl = DraftLengthController(4)
    chosen = _train(ctl, 16, lambda n: 0.01 * n, accept=0.5, steps=400)
    late = chosen[-256:]
    assert late.count(0) >= 250 and 1 <= sum(1 for k in late if k) <= 5, late
    # where a neighbour is nearly as good it is still tried every 8th step
    ctl = DraftLengthController(3)
    ctl.record_step(1, 1, 1.0, 0.1, prefill=False)  # (past the first, measuring step)
    picks = [ctl._pick({0: 1.0, 1: 0.9, 2: 0.5}, {}, {}).k for _ in range(64)]
    assert picks.count(1) == 8 and picks.count(2) == 0


def _price(ctl: DraftLengthController, b: int, seconds: dict[int, float], draft_s: float = 0.1) -> None:
    """Measured step times at ``b`` rows: ``seconds[k]`` a whole step drafting k tokens, proposal included."""
    for k, t in sorted(seconds.items()):
        ctl.record_step(b, k, t - (draft_s if k else 0.0), draft_s if k else 0.0, prefill=False)


def _k1_tries(ctl: DraftLengthController, rate: float, steps: int) -> tuple[list[int], list[int]]:
    """``steps`` steps at 16 rows where k = 1 is predicted and realised at ``rate`` of plain decoding's rate
    (1: 16 tokens in 16 s): the steps that tried k = 1, and the gaps between them."""
    _price(ctl, 16, {0: 16.0, 1: 16 / rate})  # (and past the first, measuring step)
    tries = []
    for step in range(steps):
        k = ctl._pick({0: 1.0, 1: rate}, {}, {}, 16).k
        if k == 1:
            tries.append(step)
        ctl.record_outcome(16, 16 / (rate if k == 1 else 1.0), prefill=False)
    return tries, [b - a for a, b in zip(tries, tries[1:])]


def test_a_neighbour_that_keeps_losing_is_explored_less_often():
    # k = 1 is predicted at 0.9 of plain decoding (inside explore_margin) and realises that (its calibration
    # stays 1), below plain's rate: the wait between its tries doubles up to the rare steps' period (64),
    # where every 8th step tried it before; each try that beats the best plan halves it
    ctl = DraftLengthController(3)
    tries, gaps = _k1_tries(ctl, 0.9, 400)
    assert gaps[:2] == [16, 32] and max(gaps) == 64, gaps
    assert sum(1 for t in tries if t >= 144) == 4, tries  # steps 144..399: the rare steps' 4 (was 32)
    wait, _ = ctl.exploration.wait[(StepPlan(1), size_class(16))]
    assert wait == 64
    waits = []
    for _ in range(200):  # now every try does better than plain decoding: each halves the wait, until the
        k = ctl._pick({0: 1.0, 1: 0.9}, {}, {}, 16).k  # calibration makes k = 1 the best plan
        ctl.record_outcome(16, 16 / (2.0 if k == 1 else 1.0), prefill=False)
        if k == 1:
            waits.append(ctl.exploration.wait[(StepPlan(1), size_class(16))][0])
    assert waits[:2] == [32, 16] and len(waits) > 100, waits
    # the rare steps still try it whatever its record, and a batch-size class keeps its own
    assert ctl.exploration.wait.get((StepPlan(1), size_class(2))) is None


def test_a_packed_verify_is_priced_apart_from_unpacked_ones():
    # packed verifies (history rows drafting, the others not) run the Python layers: 1.5x an unpacked forward
    # of as many tokens. They teach packed_ratio, not the verify table, and history steps are priced with it
    ctl = DraftLengthController(3)
    for n in (16, 32, 64):
        ctl.record_step(16, n // 16 - 1, 0.001 * n, 0.0, prefill=False)
    for _ in range(20):
        ctl.record_step(16, 2, 0.0015 * 24, 0.0, prefill=False, tokens=24)
    assert ctl.verify.estimate(24) == pytest.approx(0.024) and ctl.packed_ratio == pytest.approx(
        1.5, rel=0.02
    )
    options = [[O([1.0] * 3), O([1.0] * 3, 2)]] * 4 + [[O([1.0] * 3)]] * 12
    rates = ctl.history_rates(options)  # 4 rows draft 2 tokens at k >= 2: 24 tokens, packed
    assert rates[2] == pytest.approx((4 * 3 + 12) / (0.024 * ctl.packed_ratio))
    full = [[O([1.0] * 3), O([1.0] * 3, 3)]] * 16  # every row drafts k <= 3: unpacked, the table's price
    assert ctl.history_rates(full)[3] == pytest.approx(16 * 4 / 0.064)


def test_a_plan_slower_than_its_price_is_calibrated_down():
    # the model predicts k = 1 5% above plain decoding, but k = 1 steps take 1.25x the seconds their cost
    # tables priced (what the tables leave out: the draft's first pass over the tokens plain steps emitted,
    # host work); plain steps take theirs. After a few k = 1 steps the controller keeps plain decoding, and a
    # calibration is kept per batch-size class: the same plan at 2 rows is still taken at its prediction
    ctl = DraftLengthController(3, explore_every=0)
    _price(ctl, 16, {0: 1.0, 1: 2.0})
    rates = {0: 1.0, 1: 1.05}
    picks = []
    for _ in range(20):
        plan = ctl._pick(rates, {}, {}, 16)
        picks.append(plan.k)
        ctl.record_outcome(16, 2.5 if plan.k else 1.0, prefill=False)
    assert picks[0] == 1 and set(picks[-10:]) == {0}, picks
    assert picks.count(1) <= 4, picks
    assert ctl.calibration(StepPlan(1), 16) <= 0.9 and abs(ctl.calibration(StepPlan(0), 16) - 1.0) < 0.05
    assert ctl.calibration(StepPlan(1), 2) == 1.0 and ctl._pick(rates, {}, {}, 2).k == 1
    # a step that carried a prefill, or one the controller did not plan from its rates, teaches nothing
    before = dict(ctl.rate_calibration)
    ctl._pick(rates, {}, {}, 16)
    ctl.record_outcome(1, 100.0, prefill=True)
    ctl.record_outcome(1, 100.0, prefill=False)  # (no plan pending any more)
    assert ctl.rate_calibration == before


def test_the_tokens_a_step_keeps_move_only_a_calibration_of_rows_choosing_between_sources():
    """At one row a step keeps 1 to k+1 tokens: with every row drafting from the main drafter they do not move
    a plan's calibration (its tokens come from the acceptance per position), however unlucky; its seconds do,
    600 steps at 1.25x the price bring it to 0.8 (a step weighs as its rows: a few steps do at 16 rows). Where
    rows choose between sources (a history proposal beside the drafter's), the best of their noisy estimates
    is an optimistic one: there the realised rate over the predicted one calibrates the plan."""
    ctl = DraftLengthController(3, explore_every=0)
    _price(ctl, 1, {1: 0.1, 3: 0.2})
    rates = {1: 0.9 * 2.5 / 0.2, 3: 2.5 / 0.2}  # k = 1 predicted 10% below k = 3
    for _ in range(50):
        assert ctl._pick(rates, {}, {}, 1).k == 3
        ctl.record_outcome(1, 0.2, prefill=False)  # nothing accepted, at the price
    assert ctl.calibration(StepPlan(3), 1) == 1.0
    for _ in range(600):
        ctl._pick({3: 12.5}, {}, {}, 1)
        ctl.record_outcome(4, 0.25, prefill=False)
    assert ctl.calibration(StepPlan(3), 1) == pytest.approx(0.8, abs=0.02)
    _price(ctl, 16, {3: 0.4})
    for _ in range(8):
        ctl._pick({3: 1.0}, {}, {}, 16)
        ctl.record_outcome(64, 0.5, prefill=False)
    assert ctl.calibration(StepPlan(3), 16) < 0.85
    mixed = DraftLengthController(3, explore_every=0)
    _price(mixed, 16, {3: 0.4})
    for _ in range(8):  # at the price, but half the tokens the rows' best sources promised
        mixed._pick({3: 100.0}, {}, {}, 16, mixed=True)
        mixed.record_outcome(20, 0.4, prefill=False)
    assert mixed.calibration(StepPlan(3), 16) < 0.7


def test_acceptance_decays_only_at_the_positions_a_step_tried():
    """A position the controller's plans reach rarely (k = 3 tried on an exploring step among k = 1 steps)
    keeps its last tries instead of decaying towards the optimistic prior of an untried one."""
    from megatron_spec.rollout.native.adaptive import AcceptObservation, StepOutcome

    ctl = DraftLengthController(3, batch_decay=0.9)

    def step(k, accepted):
        ctl.observe(StepOutcome(rows=1, k=k, m=0, seconds=0.01, verify_s=0.01, draft_s=0.0, kept=1 + accepted,
                                prefill=False, packed_tokens=None,
                                accepts=[AcceptObservation("eagle3", None, k, accepted)]))

    step(3, 1)  # positions 1 and 2 tried, 2 rejected
    step(3, 3)
    before = list(ctl.batch["eagle3"].tried)
    for _ in range(100):
        step(1, 0)
    stats = ctl.batch["eagle3"]
    assert stats.tried[1:] == before[1:] and stats.accepted[1:] == pytest.approx([0.9, 0.9])
    assert stats.tried[0] == pytest.approx(0.9 / (1 - 0.9), rel=1e-3)  # position 1: a decayed window
    assert ctl.batch_alpha("eagle3")[2] == pytest.approx((0.9 + ctl.batch_alpha("eagle3")[1]) / (0.9 + 1))


def test_row_history_outweighs_the_batch():
    ctl = DraftLengthController(3)
    row = AcceptanceStats(3)
    for _ in range(50):
        ctl.record_accept("d", None, 3, 0)  # the other requests reject everything
        ctl.record_accept("d", row, 3, 3)  # this one accepts everything (its steps count in the batch too)
    assert ctl.row_alpha("d", row)[0] > 0.9 and abs(ctl.row_alpha("d", None)[0] - 0.5) < 0.02


def test_flags(tmp_path):
    def cfg(**spec):
        c = RunConfig()
        c.model.hf_checkpoint, c.data.prompt_data = str(tmp_path), "synthetic:sum"
        for k, v in spec.items():
            setattr(c.draft if hasattr(c.draft, k) else c.spec, k, v)
        return c

    c = cfg(spec_draft_kind="eagle3", spec_draft_path=str(tmp_path), spec_num_draft_tokens="auto").validate()
    assert c.spec.spec_k_max == 5
    assert cfg(spec_draft_kind="ngram", spec_num_draft_tokens="4").validate().spec.spec_num_draft_tokens == 4
    with pytest.raises(ConfigError, match="spec-num-draft-tokens"):
        cfg(spec_draft_kind="ngram", spec_num_draft_tokens="often").validate()
    with pytest.raises(ConfigError, match="--spec-history needs --spec-num-draft-tokens auto"):
        cfg(spec_draft_kind="ngram", spec_history=True).validate()
    with pytest.raises(ConfigError, match="--spec-history-max-draft-tokens must be >= 1"):
        cfg(spec_draft_kind="ngram", spec_num_draft_tokens="auto", spec_history=True,
            spec_history_max_draft_tokens=0).validate()
    bad = cfg(spec_draft_kind="ngram", spec_num_draft_tokens="auto")
    bad.rollout.rollout_backend = "sglang"
    with pytest.raises(ConfigError, match="rollout-backend native"):
        bad.validate()


def test_thread_chooser_measures_both_then_keeps_the_faster():
    import torch

    from megatron_spec.rollout.native.thread_chooser import ThreadChooser

    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ch = ThreadChooser(retry_every=4)
        assert ch.choose(3) == 1  # untried: 1 thread first
        ch.seconds[(3, 1)] = 0.5
        assert ch.choose(3) == 2  # then the engine's threads
        ch.seconds[(3, 2)] = 0.1
        picks = [ch.choose(3) for _ in range(8)]  # calls 3..10: the faster (2), the other at calls 4 and 8
        assert picks == [2, 1, 2, 2, 2, 1, 2, 2]
        with ch.run(3):
            pass
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(n)


def _train_two(ctl: DraftLengthController, b: int, main_accept: float, hist_accept: float, hist_len: int,
               draft_s: float, steps: int = 200) -> list[tuple[int, bool]]:
    """Rows with both sources; verify costs 1 + 0.01 per token, a main-drafter pass ``draft_s``."""
    chosen = []
    for _ in range(steps):
        opts = [[O(ctl.row_alpha("d", None)), O(ctl.row_alpha("history", None), hist_len)]] * b
        plan = ctl.choose_step(opts)
        k, hist_only = plan.k, plan.mode == "history"
        chosen.append((k, hist_only))
        for _ in range(b):
            if hist_only:
                n = min(k, hist_len)
                ctl.record_accept("history", None, n, round(hist_accept * n))
            else:
                ctl.record_accept("d", None, k, round(main_accept * k))
                n = min(k, hist_len)  # the engine also judges the unused history proposal
                ctl.record_accept("history", None, n, round(hist_accept * n))
        ctl.record_step(b, k, 1.0 + 0.01 * b * (k + 1), 0.0 if hist_only else draft_s * k, prefill=False)
    return chosen


def test_history_only_steps_draft_past_the_main_drafters_k():
    # the history's proposals are long and always right, the main drafter's often wrong and costly:
    # the controller lets the history draft alone, longer than the main drafter ever may
    ctl = DraftLengthController(8, k_main=3)
    chosen = _train_two(ctl, 2, main_accept=0.3, hist_accept=1.0, hist_len=8, draft_s=0.3)
    late = chosen[-50:]
    assert sum(h for _, h in late) > 40 and max(set(late), key=late.count) == (8, True)


def test_sibling_support_classes_learn_their_acceptance():
    st = SupportStats()
    assert [
        support_class(a, t, j)
        for a, t, j in [(1, 1, 0), (2, 2, 0), (5, 5, 3), (2, 3, 0), (1, 2, 1), (1, 3, 0)]
    ] == [0, 2, 5, 6, 9, 8]  # unanimous of 1 / 2 / 3+, majority, minority; first position or later
    sup = [(2, 2), (1, 1), (1, 2)]
    for _ in range(8):
        st.record_proposal(sup, 3, 3)  # drafted 3, all accepted: each token's class tried and accepted
    st.record_proposal(sup, 3, 0)  # the first rejected: only its class tried
    # one token verified (a proposal cut short, or fewer emitted): the first alone
    st.record_proposal(sup, 1, 1)
    assert st.tried[support_class(2, 2, 0)] == 10 and st.accepted[support_class(2, 2, 0)] == 9
    assert st.tried[support_class(1, 1, 1)] == 8 and st.tried[support_class(1, 2, 2)] == 8
    a = st.alpha([0.5] * 4, sup, 2.0)  # each class's rate, shrunk towards the source's 0.5 by 2 observations
    assert a == pytest.approx([(9 + 1) / 12, (8 + 1) / 10, (8 + 1) / 10, 0.5])


def test_a_live_proposal_drafts_only_its_paying_prefix():
    assert paying_prefix([0.9, 0.9, 0.5], 0.5, 3) == 2  # reached and accepted: 0.9, 0.81, 0.405
    assert paying_prefix([0.9, 0.9, 0.5], 0.5, 1) == 1 and paying_prefix([0.4], 0.5, 1) == 0
    ctl = DraftLengthController(4, k_main=2)
    assert ctl.token_threshold(16) is None  # no verify sizes measured yet
    for n, t in ((16, 0.040), (32, 0.067), (64, 0.120)):  # compute-bound: 16 more tokens cost 0.68 of a step
        ctl.record_step(16, n // 16 - 1, t, 0.0, prefill=False)
    assert ctl.token_threshold(16) == pytest.approx(0.675)
    assert ctl.token_threshold(1) < 0.2  # a few rows: a wider verify costs little more
    for a in (0, 1) * 10:
        ctl.record_accept("live", None, 4, a)  # the live proposals' learned rate at position 1: ~0.52
    # what the support classes were worth: unanimous pairs 0.9, a lone sibling 0.5, a split 0.1
    for i in range(40):
        ctl.support.record_proposal([(2, 2), (2, 2)], 2, 2 if i % 10 else 1)
        ctl.support.record_proposal([(1, 1)], 1, i % 2)
        ctl.support.record_proposal([(1, 2)], 1, int(i % 10 == 0))
    accs = [{} for _ in range(16)]
    hist = [[1, 2, 3, 4]] * 3 + [[]] * 13
    support = [
        [(2, 2), (2, 2), (1, 2), (2, 2)],
        [(1, 1), (1, 1), (1, 1), (1, 1)],
        [(1, 2), (1, 1), (1, 1), (1, 1)],
    ]
    plan, use, options = plan_step(
        ctl, "eagle3", accs, hist, ["live"] * 3 + [None] * 13, support + [None] * 13
    )
    assert len(options[0]) == 2 and options[0][1][1] == 2  # two unanimous pairs pay; then a split does not
    assert len(options[1]) == 1 and len(options[2]) == 1  # a lone sibling or a split: not at this batch
    # the same proposals with no support (the finished responses' index): whole, at the learned rate
    _, _, plain = plan_step(ctl, "eagle3", accs, hist, ["live"] * 3 + [None] * 13)
    assert [o[1][1] for o in plain[:3]] == [4, 4, 4]


def test_a_good_main_drafter_keeps_the_mixed_step():
    ctl = DraftLengthController(8, k_main=3)
    chosen = _train_two(ctl, 2, main_accept=1.0, hist_accept=0.0, hist_len=8, draft_s=0.01)
    late = chosen[-50:]
    assert sum(h for _, h in late) < 10 and max(set(late), key=late.count) == (3, False)


def test_k_main_bounds():
    with pytest.raises(ValueError, match="k_main"):
        DraftLengthController(4, k_main=5)
    ctl = DraftLengthController(8, k_main=3)
    assert _choose_k(ctl, [[O([1.0] * 8)]]) == 3  # no history source: never past k_main


def test_a_proposal_is_timed_per_k_not_as_k_equal_passes():
    # EAGLE-3's first pass also extends over the last step's accepted tokens: a proposal costs a + b k
    ctl = DraftLengthController(5)
    ctl.record_step(1, 1, 1.0, 0.50, prefill=False)
    ctl.record_step(1, 3, 1.0, 0.60, prefill=False)
    assert ctl.step_seconds(1, 3) == pytest.approx(1.0 + 0.60)  # measured, not 3 x the average pass
    assert ctl.step_seconds(1, 1) == pytest.approx(1.0 + 0.50)
    avg = ctl.draft.estimate(1)
    assert ctl.step_seconds(1, 5) == pytest.approx(ctl.verify.estimate(6) + 5 * avg)  # unmeasured k


def _train_tree(ctl: DraftLengthController, b: int, per_token_s: float, realized_frac: float,
                steps: int = 300) -> list:
    """Rows with both sources, independent (main drafter accepts each position with 0.6, the history
    with 0.5, proposals of 8); verify costs 1 + ``per_token_s`` per token, a main-drafter pass 0.05;
    tree rows emit ``realized_frac`` of the drafted tokens the controller predicted."""
    import random

    from megatron_spec.rollout.native.cost_model import tree_expected_tokens

    rng = random.Random(0)

    def run(n, rate):
        a = 0
        while a < n and rng.random() < rate:
            a += 1
        return a

    plans = []
    for _ in range(steps):
        opts = [[O(ctl.row_alpha("d", None)), O(ctl.row_alpha("history", None), 8)]] * b
        plan = ctl.choose_step(opts)
        plans.append(plan)
        k = plan.k
        for _ in range(b):
            if plan.mode != "history" and k:
                ctl.record_accept("d", None, k, run(k, 0.6))
            n = min(max(k, plan.m), 8)
            ctl.record_accept("history", None, n, run(n, 0.5))
        if plan.mode == "tree":
            pred = b * (tree_expected_tokens(opts[0][0][0], k, opts[0][1][0], 8, plan.m) - 1)
            ctl.record_tree(pred, realized_frac * pred)
        width = k + 1 + plan.m
        ctl.record_step(b, k, 1.0 + per_token_s * b * width, 0.0 if plan.mode == "history" else 0.05 * k,
                        prefill=False, m=plan.m)
    return plans


def test_tree_steps_chosen_when_the_wider_verify_is_cheap():
    ctl = DraftLengthController(8, k_main=3, k_tree=8)
    late = _train_tree(ctl, 1, per_token_s=0.001, realized_frac=1.0)[-60:]
    assert sum(p.mode == "tree" for p in late) > 45, late


def test_no_tree_steps_when_the_verify_is_compute_bound_or_trees_underdeliver():
    ctl = DraftLengthController(8, k_main=3, k_tree=8)
    late = _train_tree(ctl, 16, per_token_s=0.05, realized_frac=1.0)[-60:]
    assert sum(p.mode == "tree" for p in late) < 10, late
    ctl = DraftLengthController(8, k_main=3, k_tree=8)
    plans = _train_tree(ctl, 1, per_token_s=0.001, realized_frac=0.2, steps=400)
    # trees gave a fifth of what independence predicts: the calibration falls until they stop paying
    assert ctl.tree_calibration < 0.8
    assert sum(p.mode == "tree" for p in plans[:60]) >= 5 and sum(p.mode == "tree" for p in plans[-100:]) == 0


def test_tree_modes(monkeypatch):
    for bad in ("sometimes", "always"):  # always: the test hook's, not a mode users can set
        with pytest.raises(ValueError, match="tree must be one of"):
            DraftLengthController(8, k_main=3, k_tree=8, tree=bad)
    off = DraftLengthController(8, k_main=3, k_tree=8, tree="off")
    assert off.k_tree == 0 and not any(p.mode == "tree" for p in _train_tree(off, 1, 0.001, 1.0, steps=50))
    assert not DraftLengthController(8, k_main=3, k_tree=8).force_tree
    monkeypatch.setenv("MEGATRON_SPEC_TEST_HOOKS", "history_tree_always")
    always = DraftLengthController(8, k_main=3, k_tree=8)
    plans = _train_tree(always, 16, 0.05, 0.2, steps=50)
    assert all(p.mode == "tree" for p in plans[1:])  # (the first step measures the drafter)
    # the whole history proposal is the second branch, whatever it costs
    assert all(p.m == 8 for p in plans[1:])


def test_history_rows_hook_makes_rows_with_a_proposal_draft_from_it(monkeypatch):
    # compute-bound, the history never right: the cost model plans k = 0 and no row uses the history;
    # under the test hook every row with a proposal drafts from it (k >= 1), the others from the main drafter
    def plan(ctl):
        for _ in range(40):
            ctl.record_accept("d", None, 1, 0)
            ctl.record_accept("history", None, 1, 0)
            ctl.record_step(16, 0, 0.16, 0.0, prefill=False)
            ctl.record_step(16, 1, 0.32, 0.01, prefill=False)
        return plan_step(ctl, "d", [{}] * 4, [[5, 6], [], [7], []])[:2]

    assert plan(DraftLengthController(3)) == (StepPlan(0), [False] * 4)
    monkeypatch.setenv("MEGATRON_SPEC_TEST_HOOKS", "history_rows_always")
    assert plan(DraftLengthController(3)) == (StepPlan(1), [True, False, True, False])


def _bench_rollout():
    """benchmarks/bench_rollout.py as a module."""
    from tests.benchmark_modules import load_benchmark

    return load_benchmark("bench_rollout")


def test_length_policy_ceiling_is_the_oracle_over_fixed_k():
    """benchmarks/bench_rollout.py's ceiling of any draft-length choice: an oracle verifying exactly
    each row's accepted drafts, at its best longest chain K, over fixed k=3, under the controller's
    measured costs (a line through the verify table). Checked against the rates computed by hand."""
    bench = _bench_rollout()
    c = DraftLengthController(5)
    for n in range(16, 97, 8):
        c.verify.update(n, 0.010 + 0.0005 * n)
    for k in range(1, 6):
        c.proposal.setdefault(k, CostTable()).update(16, 0.003 * k)
    at_least = [0.9, 0.8, 0.7, 0.3, 0.2]

    def rate(k, tokens):
        return 16 * (1 + sum(at_least[:k])) / (0.010 + 0.0005 * tokens + 0.003 * k)

    ref = rate(3, 64)
    oracle = max(rate(k, 16 * (1 + sum(at_least[:k]))) for k in range(1, 6))
    got = bench.length_policy_ceiling(at_least, c, 16)
    assert got == pytest.approx(oracle / ref, rel=1e-9)
    assert got > 1.0  # the oracle can always verify fewer tokens than fixed k=3 does
    assert bench.length_policy_ceiling(at_least, DraftLengthController(5), 16) is None  # no costs yet


def test_paired_ratio_interval_brackets_the_median_and_narrows_with_rounds():
    """benchmarks/bench_rollout.py's bootstrap interval of the paired median: equal ratios give a point,
    the interval holds the median, more rounds of the same spread give a narrower one, under 3 rounds none."""
    from types import SimpleNamespace as NS

    bench = _bench_rollout()

    def runs(ratios):
        return [NS(tokens_per_s=100.0 * r) for r in ratios], [NS(tokens_per_s=100.0)] * len(ratios)

    assert bench.paired_ratio_interval(*runs([0.95] * 5)) == [0.95, 0.95]
    assert bench.paired_ratio_interval(*runs([0.9, 1.0])) is None
    few = [0.85, 0.9, 0.95, 1.0, 1.05]
    lo, hi = bench.paired_ratio_interval(*runs(few))
    assert bench.paired_ratio(*runs(few)) == pytest.approx(0.95) and lo < 0.95 < hi
    lo4, hi4 = bench.paired_ratio_interval(*runs(few * 4))
    assert lo <= lo4 <= 0.95 <= hi4 <= hi and hi4 - lo4 < hi - lo


def test_the_benchmarks_calls_run_step_by_step_one_engine_at_a_time():
    """benchmarks/bench_rollout.py's rounds: calls on different engines run one step each in turn, the
    order turned by the round; two calls on one engine (a config at two temperatures) go in successive
    waves, never at once, every engine's first config in the first whatever the round (the pairs a ratio
    compares stay together); ``--interleave calls`` runs each call whole; each result comes back by name."""
    from megatron_spec.rollout.types import GenerateStats

    bench = _bench_rollout()
    log = []

    def call(name):
        def start(done):
            def steps():
                for _ in range(2):
                    log.append(name)
                    yield
                return name, GenerateStats()
            return steps()
        return start

    a, b = object(), object()
    calls = {n: call(n) for n in ("ar", "k3", "ar_t1", "k3_t1")}
    engines = {"ar": a, "k3": b, "ar_t1": a, "k3_t1": b}
    out = bench.run_calls(calls, 0, engines)
    assert log == ["ar", "k3"] * 2 + ["ar_t1", "k3_t1"] * 2
    assert list(out) == list(calls) and all(out[n][0] == n for n in calls)
    log.clear()
    bench.run_calls(calls, 1, engines)
    assert log == ["k3", "ar"] * 2 + ["k3_t1", "ar_t1"] * 2
    log.clear()
    try:
        bench.INTERLEAVE = "calls"
        bench.run_calls(calls, 0, engines)
    finally:
        bench.INTERLEAVE = "steps"
    assert log == ["ar", "ar", "k3", "k3", "ar_t1", "ar_t1", "k3_t1", "k3_t1"]
    # grouped by temperature, a config on an engine of its own (the adaptive T=1 engine) runs with its
    # temperature's configs, not in the first wave its engine is free in; listed pair by pair, the same waves
    temps = {"ar": 0.0, "k3": 0.0, "auto": 0.0, "ar_t1": 1.0, "k3_t1": 1.0, "auto_t1": 1.0}
    engines = {"ar": a, "k3": b, "auto": object(), "ar_t1": a, "k3_t1": b, "auto_t1": object()}
    for order in (list(temps), ["ar", "ar_t1", "k3", "k3_t1", "auto", "auto_t1"]):
        log.clear()
        bench.run_calls({n: call(n) for n in order}, 0, engines, temps)
        assert log == ["ar", "k3", "auto"] * 2 + ["ar_t1", "k3_t1", "auto_t1"] * 2, order


def test_the_benchmarks_rounds_sample_with_a_seed_each_and_adaptive_keys_at_each_temperature():
    """``run_interleaved``: every config of a round samples with that round's seed (at T=1 a config repeating
    one seed would time one draw of its texts every round); ``adaptive_keys``: the adaptive engine against
    the fastest fixed config at one temperature, each key with that temperature's suffix."""
    from types import SimpleNamespace as NS

    from megatron_spec.rollout.types import GenerateStats

    bench = _bench_rollout()
    seeds = []

    class Core:
        def generate_steps(self, reqs, done, seed=None):
            seeds.append((reqs[0].sampling.temperature, seed))
            yield
            return [], GenerateStats(num_tokens=10 + seed, wall_s=1.0)

    class Server:
        def __init__(self):
            self.core = Core()

        def generate(self, reqs):  # the warm-up
            return [], GenerateStats()

    ar, auto = Server(), Server()
    runs = bench.run_interleaved({"ar": (ar, 0.0), "eagle3_auto": (auto, 0.0), "ar_t1": (ar, 1.0),
                                  "eagle3_auto_t1": (Server(), 1.0)}, [[1, 2]], 4, repeats=3)
    assert sorted(seeds) == sorted((t, r) for r in range(3) for t in (0.0, 0.0, 1.0, 1.0))
    assert [st.num_tokens for st in runs["ar_t1"]] == [10, 11, 12]  # round r: seed r
    row: dict = {}
    fast = [NS(tokens_per_s=20.0, k_mean=1.0)] * 3
    auto = [NS(tokens_per_s=19.0, k_mean=1.5)] * 3
    lucky = [NS(tokens_per_s=t) for t in (30.0, 5.0, 5.0)]  # the fastest round, not the fastest median
    runs = {"ar": [NS(tokens_per_s=10.0)] * 3, "k1": fast, "k3": lucky, "eagle3_auto_t1": auto}
    assert bench.adaptive_keys(row, runs, ["ar", "k1", "k3"], "_t1") == "k1"
    assert row == {"adaptive_over_best_fixed_t1": 0.95, "adaptive_round_ratios_t1": [0.95] * 3,
                   "adaptive_over_best_fixed_interval_t1": [0.95, 0.95], "k_mean_auto_t1": 1.5}


def test_a_wider_batch_first_measures_k_max_then_chooses():
    """Measured at one row only, a batch of 16 would be priced by extrapolation (a verify's cost per
    token at 1 row says little about 16 rows): its first step runs k_max, after that the choice is
    the controller's again."""
    c = DraftLengthController(5, explore_every=0)
    for k in range(6):
        c.record_step(1, k, 0.010 + 0.0002 * k, 0.003 * k, prefill=False)
    one = [[O([0.3] * 5)]]
    sixteen = one * 16

    def best(options):
        rates = c.expected_rates(options)
        return StepPlan(max(rates, key=rates.get))

    assert c.choose_step(one) == best(one) != StepPlan(5)  # within the measured sizes: the best k
    assert c.choose_step(sixteen) == StepPlan(5)  # 16 x 6 tokens: wider than any verify measured
    c.record_step(16, 5, 0.060, 0.020, prefill=False)
    assert c.choose_step(sixteen) == best(sixteen) != StepPlan(5)  # measured: chosen by rate again
    c.record_step(16, 3, 0.050, 0.012, prefill=True)  # a step carrying a prefill is not recorded ...
    twenty = one * 20
    assert c.choose_step(twenty) == StepPlan(5)
    c.record_step(20, 5, 0.070, 0.022, prefill=True)
    # ... and the wider batch is not forced a second time
    assert c.choose_step(twenty) == best(twenty) != StepPlan(5)


def test_proposal_cost_outside_its_rows_scales_with_one_draft_pass():
    c = DraftLengthController(3)
    c.record_step(1, 3, 0.010, 0.009, prefill=False)  # a 3-token proposal over 1 row: 9 ms (3 ms a pass)
    c.record_step(16, 1, 0.030, 0.004, prefill=False)  # one pass over 16 rows: 4 ms
    # k=3 at 16 rows: never measured there; 9 ms scaled by the pass's 4/3, not by 16 rows / 1
    assert c.proposal_seconds(16, 3) == pytest.approx(0.009 * 0.004 / 0.003)
    assert c.proposal_seconds(1, 3) == pytest.approx(0.009)  # measured
    assert c.proposal_seconds(16, 2) == pytest.approx(2 * 0.004)  # never measured at any row count: 2 passes


def test_observe_is_the_step_s_records_in_order():
    """One ``StepOutcome`` teaches what the separate records taught: acceptance per source (and a live
    proposal's support), the tree's calibration, the step's and the proposal's time, the plan's rate."""
    from megatron_spec.rollout.native.adaptive import AcceptObservation, StepOutcome

    a, b = DraftLengthController(4, k_tree=2), DraftLengthController(4, k_tree=2)
    rows_a = [AcceptanceStats(4), AcceptanceStats(4)]
    rows_b = [AcceptanceStats(4), AcceptanceStats(4)]
    for ctl in (a, b):
        ctl.choose_step([[O([0.5] * 4)]] * 2)
    a.record_accept("eagle3", rows_a[0], 3, 2)
    a.record_accept("live", rows_a[1], 2, 1)
    a.support.record_proposal([(2, 2), (1, 2)], 2, 1)
    a.batch["eagle3"].decay_all(3)  # the positions each source's drafts were tried at
    a.batch["live"].decay_all(2)
    a.support.decay_all()
    a.record_tree(1.5, 1.0)
    a.record_step(2, 3, 0.02, 0.005, False, m=0, tokens=None)
    a.record_outcome(5, 0.025, False)
    b.observe(StepOutcome(
        rows=2, k=3, m=0, seconds=0.025, verify_s=0.02, draft_s=0.005, kept=5, prefill=False,
        packed_tokens=None, tree=(1.5, 1.0),
        accepts=[AcceptObservation("eagle3", rows_b[0], 3, 2),
                 AcceptObservation("live", rows_b[1], 2, 1, [(2, 2), (1, 2)])]))
    for src in ("eagle3", "live"):
        assert a.batch_alpha(src) == b.batch_alpha(src)
    assert [r.rates(prior=[0.5] * 4) for r in rows_a] == [r.rates(prior=[0.5] * 4) for r in rows_b]
    live = ([0.5, 0.5], [(2, 2), (1, 2)], 2.0)
    assert a.support.alpha(*live) == b.support.alpha(*live)
    assert a.tree_calibration == b.tree_calibration != 1.0
    assert a.verify.sizes == b.verify.sizes and a.proposal_seconds(2, 3) == b.proposal_seconds(2, 3)
    assert a.rate_calibration == b.rate_calibration


def test_the_rare_steps_try_a_neighbour_that_loses_badly_less_and_less_often():
    # k = 1 predicted and realised at half plain decoding's rate (a compute-bound batch): only the rare steps
    # try it, and each try that gives less than explore_margin of the best rate doubles its wait past the rare
    # steps' period, up to explore_rare_longest periods (512 steps), where every 64th step tried it before; a
    # try that gives the best rate again halves the wait (one noisy step does not bring back every 8th)
    ctl = DraftLengthController(3)
    _, gaps = _k1_tries(ctl, 0.5, 3000)
    assert gaps[:6] == [64, 64, 64, 128, 256, 512] and set(gaps[6:]) == {512}, gaps
    assert ctl.exploration.wait[(StepPlan(1), size_class(16))][0] == 512
    while ctl._pick({0: 1.0, 1: 0.5}, {}, {}, 16).k != 1:  # the next try does as well as plain decoding
        ctl.record_outcome(16, 16, prefill=False)
    ctl.record_outcome(16, 16, prefill=False)
    assert ctl.exploration.wait[(StepPlan(1), size_class(16))][0] == 256  # one good try halves the wait
    # a batch-size class keeps its own record
    assert ctl.exploration.wait.get((StepPlan(1), size_class(2))) is None


def test_a_drafting_steps_price_follows_the_plain_step_measured_beside_it():
    # a k = 1 step at 16 rows cost 2x the plain step measured just before it; then plain steps slow down by
    # half again (longer caches, a slower minute) while k = 1 is not tried: once its own measurement is over
    # a rare period (64 steps) older than the plain step's, its price moves with them, in units of the
    # current plain step, not its stale absolute time; a k measured as recently is priced as measured
    ctl = DraftLengthController(3)

    def steps(n, k, seconds, draft_s=0.0):
        for _ in range(n):
            ctl._pick({0: 1.0}, {}, {}, 16)
            ctl.record_step(16, k, seconds, draft_s, prefill=False)

    steps(9, 0, 0.040)
    steps(1, 1, 0.080, 0.004)
    assert ctl.step_seconds(16, 1) == pytest.approx(0.080 + 0.004)
    steps(9, 0, 0.060)
    assert ctl.step_seconds(16, 1) == pytest.approx(0.080 + 0.004)  # measured 9 steps ago: as measured
    steps(60, 0, 0.060)
    assert ctl.verify.estimate(32) == pytest.approx(0.080)  # the absolute table still says 0.08
    assert ctl.step_seconds(16, 1) == pytest.approx(2 * 0.060 + 0.004)
    # a k not measured at this batch-size class is priced from the table, as before
    assert ctl.step_seconds(16, 2) == pytest.approx(ctl.verify.estimate(48) + ctl.proposal_seconds(16, 2))
    assert 2 not in ctl.verify_over_plain[size_class(16)].seconds


def _held_steps(ctl: DraftLengthController, opts, steps: int, seconds: float = 1.0) -> list[tuple[int, bool]]:
    """``steps`` steps of ``opts`` through ``choose_step``: per step its k and whether it was held."""
    plans = []
    for _ in range(steps):
        held = ctl.holds(len(opts))
        plan = ctl.choose_step(opts)
        assert held == ctl.last_held
        plans.append((plan.k, held))
        ctl.record_outcome(len(opts), seconds, prefill=False)
    return plans


def test_plain_decoding_leading_by_the_exploring_margin_is_held_until_the_next_full_choice(monkeypatch):
    # at 16 rows a k = 1 step costs 2.5 plain steps and emits 1.5 tokens a row: 0.6 of plain decoding's rate,
    # below explore_margin (0.85). After the first (widest) step and a full choice, the steps up to the next
    # multiple of 8 keep plain decoding without pricing any plan; the held steps still teach the calibration
    ctl = DraftLengthController(3)
    _price(ctl, 16, {0: 1.0, 1: 2.5})
    opts = [[O([0.5] * 3)]] * 16
    priced = []
    real = ctl.expected_rates
    monkeypatch.setattr(ctl, "expected_rates", lambda o: priced.append(ctl.steps + 1) or real(o))
    plans = _held_steps(ctl, opts, 24, seconds=1.25)  # every plain step takes 1.25 times its price
    assert plans[0] == (3, False) and all(k == 0 for k, _ in plans[1:])
    assert [i + 1 for i, (_, held) in enumerate(plans) if not held] == [1, 2, 8, 16, 24]
    assert priced == [2, 8, 16, 24]
    assert ctl.calibration(StepPlan(0), 16) < 0.9  # 19 held steps at 0.8 of their price
    assert ctl.holds(8) and not ctl.holds(7)  # under half the rows: a full choice


def test_a_main_drafter_plan_near_plain_decoding_is_held_a_history_plan_within_the_margin_is_not():
    # a main-drafter plan's rate moves only with what the controller learns: k = 1 at 24 tokens / 1.65 s,
    # 0.91 of plain decoding's 16 / s, is held like a far one (and explored on the exploring steps); a plan
    # drafting from the history moves with the rows' proposals step by step: within the margin (0.9), a full
    # choice every step; below it (0.8), held
    opts = [[O([0.5] * 3)]] * 16
    near = DraftLengthController(3)
    _price(near, 16, {0: 1.0, 1: 1.65})
    plans = _held_steps(near, opts, 8)
    assert [i + 1 for i, (_, held) in enumerate(plans) if not held] == [1, 2, 8] and plans[7] == (1, False)
    for history_rate, held in [(0.9, False), (0.8, True)]:
        ctl = DraftLengthController(3)
        _price(ctl, 16, {0: 1.0, 3: 3.0})  # past the first (measuring) step
        assert ctl._pick({0: 1.0, 1: 0.91}, {1: history_rate}, {}, 16) == StepPlan(0)
        assert ctl.holds(16) is held
    off = DraftLengthController(3, hold_every=0)
    _price(off, 16, {0: 1.0, 1: 2.0})
    assert [k for k, held in _held_steps(off, opts, 12) if held] == []


def test_a_hold_goes_on_within_twice_or_half_its_rows_and_teaches_only_at_its_rows():
    # held at 12 rows: 6 to 24 rows keep it, 5 and 25 choose anew; a wider batch whose widest step is not
    # measured yet runs it first (test_a_wider_batch_first_measures_k_max_then_chooses).
    # A held step at other rows than the choice's teaches the calibration nothing (the price is for 12 rows)
    ctl = DraftLengthController(3)
    ctl.draft.update(12, 0.1)
    assert ctl._pick({0: 1.0, 1: 0.5}, {}, {}, 12) == StepPlan(0) and ctl.steps == 1
    assert [b for b in (5, 6, 12, 16, 24, 25) if ctl.holds(b)] == [6, 12, 16, 24]
    assert ctl.choose_step([[O([0.5] * 3)]] * 9) == StepPlan(0) and ctl.last_held
    ctl.record_outcome(9, 4.0, prefill=False)  # 9 tokens in 4 s where 12 in 12 s were priced: not learned
    assert ctl.calibration(StepPlan(0), 9) == 1.0
    assert ctl.choose_step([[O([0.5] * 3)]] * 12) == StepPlan(0) and ctl.last_held
    ctl.record_outcome(12, 24.0, prefill=False)  # 12 tokens in 24 s where the choice priced 12 in 12 s
    assert ctl.calibration(StepPlan(0), 12) < 1.0


def test_plain_decoding_is_calibrated_against_its_table_after_the_step_not_its_price_at_the_choice():
    """The first plain step at 32 rows is priced from a table that measured only the first (widest) step:
    by extrapolation, at 0.79 of its real seconds. It, and the held steps after it (priced at that full
    choice), must not teach plain decoding a calibration of 0.8: once the table holds plain steps' own times,
    plain decoding at 533 tokens/s beats k = 1 at 512 (1.6 tokens a row in 0.1 s). On the real model's GRPO
    loop the old rule (the price at the choice) made k = 1 win full choices it lost."""
    from megatron_spec.rollout.native.adaptive import StepOutcome

    ctl = DraftLengthController(1, explore_every=0)
    opts = [[O([0.6])]] * 32

    def step(k: int) -> None:
        seconds, verify_s, draft_s = (0.1, 0.095, 0.005) if k else (0.06, 0.0588, 0.0)
        ctl.observe(StepOutcome(rows=32, k=k, m=0, seconds=seconds, verify_s=verify_s, draft_s=draft_s,
                                kept=round(32 * (1.6 if k else 1.0)), prefill=False, packed_tokens=None,
                                accepts=[]))

    assert ctl.choose_step(opts) == StepPlan(1)  # the first step: a draft pass and the widest verify measured
    step(1)
    assert ctl.step_seconds(32, 0) == pytest.approx(0.0475)  # 64 tokens' 0.095 s, scaled to 32
    plans = []
    for _ in range(16):
        plans.append(ctl.choose_step(opts).k)
        step(plans[-1])
    assert plans == [0] * 16, plans
    assert ctl.calibration(StepPlan(0), 32) == pytest.approx(0.0588 / 0.06, abs=0.01)
