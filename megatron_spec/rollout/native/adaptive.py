"""Adaptive draft length: the plan of each verify step, chosen from what the engine measured.

:class:`DraftLengthController` picks the plan with the highest expected tokens per second
(:mod:`megatron_spec.rollout.native.cost_model`: every row drafting k tokens, k in ``k_min..k_main``
(the main drafter's longest proposal); with a history drafter beside it (its proposals cost no forward),
only the rows with a history proposal drafting up to ``k_max`` tokens; with ``k_tree``, a two-branch
tree). The costs are measured online, nothing is tuned to one machine
(:mod:`megatron_spec.rollout.native.measures`): :class:`CostTable` per verify size and per proposal,
:class:`AcceptanceStats` per source, per batch (slow decay) and per request (shrunk towards the batch's
rate with ``row_prior_weight`` pseudo-steps). A proposal is not k equal passes (EAGLE-3's first pass
also extends over the tokens accepted in the last step), so it is measured per k; a k not measured yet is
k average passes, one measured only at other row counts its nearest measurement scaled by how a pass
scales. A batch wider than any verify measured (``B (k_main+1)`` tokens) first runs one step at
``k_main``, so its costs are interpolated rather than extrapolated from smaller batches.

Exploration and holding (:mod:`megatron_spec.rollout.native.exploration`): every ``explore_every``-th step
the controller may try a neighbour of the best k (one expected to give ``explore_margin`` of the best rate,
or on the rare steps any); a neighbour that keeps losing waits longer between tries. Where plain decoding
is the best plan and leads every plan drafting from the history by more than that margin, the steps up to the
next full choice (every ``hold_every``-th step, and every exploring one) keep it without choosing, and without
the history's proposals.

Calibration: a factor per plan and batch-size class (``rate_calibration``: a running mean, then an EMA; a
step weighs as many rows as it has) multiplies the plan's predicted rate. Where every row drafts from the main
drafter alone it is the predicted over the real seconds of the step: what the cost tables leave out (EAGLE-3's
first pass after plain steps extends over every token they emitted; a speculative step's host work grows with
the drafts); plain decoding's predicted seconds are its table's once it holds the step's own time, not an
earlier price (an extrapolated one, a held step's: :meth:`DraftLengthController.record_outcome`). The tokens
come from the acceptance per position alone: at one row a step keeps 1 to k+1 of them, and a factor learned
from them is noise that punishes the plans chosen when their estimate was high (the k explored least most).
Where rows choose between sources (history), it is the real over the predicted rate: the best of several
noisy estimates is on average an optimistic one. Tree steps' drafted tokens are calibrated on their own
(``tree_calibration``): the two sources are correlated and the independence estimate optimistic. Acceptance
counts decay only at the positions a step tried. The measurements: docs/benchmark_log.md, "The adaptive
controller's design, measured", "Calibrated on seconds" and "Plain decoding judged against its own table".

The choice never changes any output distribution: verification is exact for every plan. This module
knows nothing about models, drafts or the engine's slots: it sees sizes, seconds and accepted counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from megatron_spec.faults import test_hook
from megatron_spec.rollout.native import cost_model, measures
from megatron_spec.rollout.native.cost_model import DraftOption, size_class
from megatron_spec.rollout.native.exploration import Exploration, Hold
from megatron_spec.rollout.native.measures import AcceptanceStats, Calibration, CostTable, SupportStats
from megatron_spec.rollout.settings import HISTORY_TREE_MODES


class StepPlan(NamedTuple):
    """What the next verify step drafts: ``k`` main-drafter tokens (or history tokens in ``history``
    mode), ``mode`` one of ``all`` (every row drafts from its better source), ``history`` (only rows
    with a history proposal draft; the main drafter sits out), ``tree`` (every row drafts k from the
    main drafter, rows with a history proposal add up to ``m`` of it as a second branch)."""

    k: int
    mode: str = "all"
    m: int = 0


@dataclasses.dataclass(frozen=True)
class AcceptObservation:
    """One row's drafts from one source, verified (or, for a history proposal the row did not use,
    compared with what it emitted): what that source's acceptance per position learns."""

    source: str
    """The draft source judged: the main drafter's kind, ``history``, ``live``."""
    row: AcceptanceStats | None
    """The request's own counts for that source (None: the batch's only)."""
    drafted: int
    accepted: int
    support: list[tuple[int, int]] | None = None
    """A live proposal's sibling support per token: what its support classes are worth learns too."""


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one verify step gave, handed to :meth:`DraftLengthController.observe` once per step."""

    rows: int
    k: int
    m: int
    """A tree step's second branch (its verify forward is ``B * (1+k+m)`` tokens wide); 0 otherwise."""
    seconds: float
    """The whole step: proposals, verify, host work."""
    verify_s: float
    """Everything but the drafters' proposals."""
    draft_s: float
    """The main drafter's proposal of k tokens (0: it did not run)."""
    kept: int
    """Tokens the rows kept."""
    prefill: bool
    """The step carried a prompt's prefill: its times are not the step's and are not learned."""
    packed_tokens: int | None
    """What a packed verify forward really ran (rows drafting fewer than k); None: unpacked."""
    accepts: list[AcceptObservation]
    tree: tuple[float, float] | None = None
    """A tree step's rows with a second branch: drafted tokens accepted, predicted and emitted."""


class DraftLengthController:
    """Chooses k per verify step (see the module docstring)."""

    def __init__(self, k_max: int, k_min: int = 0, explore_every: int = 8, explore_margin: float = 0.85,
                 explore_rare: int = 8, explore_rare_longest: int = 8, row_prior_weight: float = 4.0,
                 support_weight: float = 2.0, batch_decay: float = 0.98, k_main: int | None = None,
                 k_tree: int = 0, tree: str = "auto", tree_calibration_ema: float = 0.05,
                 rate_calibration_ema: float = 0.1, rate_calibration_rows: int = 16, hold_every: int = 8):
        if not 0 <= k_min <= k_max or k_max < 1:
            raise ValueError(
                f"adaptive draft length needs 0 <= k_min <= k_max and k_max >= 1, got {k_min}, {k_max}"
            )
        k_main = k_max if k_main is None else k_main
        if not max(1, k_min) <= k_main <= k_max:
            raise ValueError(
                f"k_main (the main drafter's longest proposal) must be in {max(1, k_min)}..{k_max}, "
                f"got {k_main}"
            )
        if tree not in HISTORY_TREE_MODES:
            raise ValueError(f"tree must be one of {HISTORY_TREE_MODES}, got {tree!r}")
        if k_tree < 0:
            raise ValueError(f"k_tree must be >= 0, got {k_tree}")
        self.k_max, self.k_min, self.k_main = k_max, k_min, k_main
        self.k_tree = 0 if tree == "off" else k_tree
        """The longest second (history) branch of a tree step; 0: no tree steps."""
        self.force_tree = tree == "auto" and test_hook("history_tree_always")
        """Tests only (``megatron_spec.faults.test_hook``): a tree step wherever a row can have one."""
        self.force_history_rows = test_hook("history_rows_always")
        """Tests only: in a step where every row drafts, each row with a history proposal drafts from it
        (at least one token), whatever the cost model prefers."""
        self.tree_calibration = 1.0
        """Tree rows' drafted tokens emitted over predicted (EMA over tree steps): starts at 1, so tree
        steps get tried, and falls to what they really give."""
        self.tree_calibration_ema = tree_calibration_ema
        self.rate_calibration = Calibration(rate_calibration_rows, rate_calibration_ema)
        """Per (plan, :func:`size_class`): the factor on its predicted rate (module docstring)."""
        self._chosen: tuple[StepPlan, int, float, float | None] | None = None
        """The last plan, its rows, its predicted rate and seconds (None: calibrated on its rate)."""
        self._explored: tuple[StepPlan, int, float] | None = None  # an exploring step's plan, rows, best rate
        self.exploration = Exploration(explore_every, explore_margin, explore_rare, explore_rare_longest)
        # the test hooks choose every step (their plans are what a test runs, whatever the costs)
        self.hold = Hold(0 if self.force_tree or self.force_history_rows else hold_every, self.exploration)
        self.last_held = False  # whether the last step kept a held plan (the trace's)
        self.row_prior_weight = row_prior_weight
        # SupportStats.alpha
        self.support, self.support_weight = SupportStats(decay=batch_decay), support_weight
        self.batch_decay = batch_decay
        self.batch: dict[str, AcceptanceStats] = {}  # per draft source (the drafter's kind, "history")
        self.verify = CostTable()  # keyed by tokens in the step's target forward, B * (k+1)
        self.verify_over_plain: dict[int, CostTable] = {}
        """Per :func:`size_class`: a drafting step's verify over the plain step's at its rows, keyed by k: the
        price of a k whose own measurement is over a rare period older than the plain step's, in units of
        the current plain step (which the caches' length and the machine's drift move alike)."""
        self._measured_at: dict[int, int] = {}  # the verify table's sizes: the step of their last measurement
        self.packed_ratio = 1.0
        """A packed verify's seconds (rows drafting different lengths, ``Segment.pack``) over an unpacked
        one's of as many tokens (EMA; 1 until measured): packed forwards run the Python layers, not the C++
        stack."""
        self.packed_ratio_ema = 0.2
        self.draft = CostTable()  # one draft pass (a proposal over k), keyed by rows B
        self.proposal: dict[int, CostTable] = {}  # a whole proposal of k tokens, per k, keyed by rows B
        self._steps = 0
        self.last_plan: tuple[StepPlan, int] | None = None  # the last plan chosen and its rows
        self.last_draft_s = 0.0  # the main drafter's proposal time in the last step (0: it did not run)
        self.trace = None  # a callable given each step's outcome (decision_trace.DecisionTrace), or None
        self._measured_wide: set[int] = set()

    @property
    def steps(self) -> int:
        return self._steps

    def source(self, name: str) -> AcceptanceStats:
        if name not in self.batch:
            self.batch[name] = AcceptanceStats(self.k_max, decay=self.batch_decay)
        return self.batch[name]

    def row_alpha(
        self, source: str, row: AcceptanceStats | None, base: list[float] | None = None
    ) -> list[float]:
        """Acceptance per position of one row's drafts from ``source``: the row's own counts
        shrunk towards the batch's (``row_prior_weight`` pseudo-steps); ``base``: the batch's rates
        (:meth:`batch_alpha`) when the caller has them for every row."""
        base = self.batch_alpha(source) if base is None else base
        return base if row is None else row.rates(prior=base, prior_weight=self.row_prior_weight)

    def batch_alpha(self, source: str) -> list[float]:
        """The batch's acceptance per position for ``source``; optimistic for an untried one (rate 1 with
        one pseudo-step), so it gets tried."""
        return self.source(source).rates(first_prior=1.0)

    def record_accept(self, source: str, row: AcceptanceStats | None, k: int, num_accepted: int) -> None:
        self.source(source).record(k, num_accepted)
        if row is not None:
            row.record(k, num_accepted)

    def step_seconds(self, b: int, k: int) -> float | None:
        v = self.verify.estimate(b * (k + 1))
        if v is None:
            return None
        if k == 0:
            return v
        ratios, plain = self.verify_over_plain.get(size_class(b)), self.verify.seconds.get(b)
        age = self._measured_at.get(b, 0) - self._measured_at.get(b * (k + 1), 0)  # k's price's, in steps
        if ratios and plain and k in ratios.seconds and age > self.exploration.every * self.exploration.rare:
            v = plain * ratios.seconds[k]
        p = self.proposal_seconds(b, k)
        return None if p is None else v + p

    def proposal_seconds(self, b: int, k: int) -> float | None:
        """The main drafter's proposal of k tokens over b rows, seconds (``measures.proposal_seconds``)."""
        return measures.proposal_seconds(self.proposal, self.draft, b, k)

    def token_threshold(self, b: int) -> float | None:
        """:func:`~megatron_spec.rollout.native.cost_model.token_threshold` at ``b`` rows; None until the
        verify table has two sizes."""
        if len(self.verify) < 2:
            return None
        return cost_model.token_threshold(self.verify.estimate(b), self.verify.estimate(2 * b))

    def expected_rates(self, options: Sequence[Sequence[DraftOption]]) -> dict[int, float]:
        """Tokens per second of every k in ``k_min..k_main``, every row drafting
        (:func:`~megatron_spec.rollout.native.cost_model.all_rows_rates`)."""
        return cost_model.all_rows_rates(options, range(self.k_min, self.k_main + 1), self.step_seconds)

    def history_rates(self, options: Sequence[Sequence[DraftOption]]) -> dict[int, float]:
        """Tokens per second of every k in ``1..k_max``, only the rows with a history proposal drafting
        (:func:`~megatron_spec.rollout.native.cost_model.history_rows_rates`)."""
        return cost_model.history_rows_rates(options, self.k_max, self.verify.estimate, self.packed_ratio)

    def tree_rates(self, options: Sequence[Sequence[DraftOption]]) -> dict[tuple[int, int], float]:
        """Tokens per second of a tree step for every (k, m)
        (:func:`~megatron_spec.rollout.native.cost_model.tree_rows_rates`)."""
        return cost_model.tree_rows_rates(options, self.k_main, self.k_tree, self.tree_calibration,
                                          self.verify.estimate, self.proposal_seconds)

    def record_tree(self, predicted: float, emitted: float) -> None:
        """One tree step's rows with a second branch: tokens drafted and accepted, predicted (before the
        calibration) and emitted; moves the calibration towards their ratio."""
        if predicted > 0:
            ratio = min(2.0, emitted / predicted)
            self.tree_calibration += self.tree_calibration_ema * (ratio - self.tree_calibration)

    def choose_step(self, options: Sequence[Sequence[DraftOption]]) -> StepPlan:
        """The next step's :class:`StepPlan` (:meth:`_choose`), kept with its rows for the trace."""
        plan = self._choose(options)
        self.last_plan = (plan, len(options))
        return plan

    def _choose(self, options: Sequence[Sequence[DraftOption]]) -> StepPlan:
        """``options[b]``: row b's draft sources as (acceptance per
        position (``row_alpha``), proposal length or None for any k), the main drafter's first.

        A batch whose widest step (``k_main`` drafts per row) is larger than any verify the table has
        measured runs that step first, as the very first step does: every cost up to it is then
        interpolated between measurements, not extrapolated from small batches (where a verify's
        cost per token says little about a larger one's)."""
        b = len(options)
        if self.holds(b):
            return self.keep_held(b)
        self.last_held = False
        self.hold.clear()
        if self._unmeasured_wide(b):
            self._measured_wide.add(b)  # once per batch size (its step may carry a prefill, not recorded)
            self._steps += 1
            self._chosen = self._explored = None
            return StepPlan(self.k_main)
        trees = self.tree_rates(options)
        if self.force_tree and trees:  # the test hook: a tree whenever a row can have one, the whole
            # history proposal its second branch (exercised past the drafter's tokens); only k is chosen
            m = max(min(o[1].limit or self.k_tree, self.k_tree) for o in options if len(o) > 1)
            return self._pick({}, {}, {km: r for km, r in trees.items() if km[1] == m}, b)
        mixed = any(len(o) > 1 for o in options)  # rows choose between sources: calibrated on the rate
        return self._pick(self.expected_rates(options), self.history_rates(options), trees, b, mixed)

    def calibration(self, plan: StepPlan, b: int) -> float:
        """The factor on ``plan``'s predicted rate at ``b`` rows (module docstring; 1 until measured)."""
        return self.rate_calibration.factor((plan, size_class(b)))

    def _pick(self, rates: dict[int, float], hist_rates: dict[int, float],
              tree_rates: dict[tuple[int, int], float], b: int = 1, mixed: bool = False) -> StepPlan:
        self._steps += 1
        self._chosen = self._explored = None
        if not len(self.draft) and self.k_main >= 1:
            return StepPlan(self.k_main)  # first: measure a draft pass and every position's acceptance
        model = {StepPlan(k): r for k, r in rates.items()}
        model.update({StepPlan(k, "history"): r for k, r in hist_rates.items()})
        model.update({StepPlan(k, "tree", m): r for (k, m), r in tree_rates.items()})
        if not model:
            return StepPlan(self.k_main)
        cands = [(r * self.calibration(p, b), p) for p, r in model.items()]
        rate, best = max(cands, key=lambda c: c[0])
        lo, hi = {"all": (self.k_min, self.k_main), "history": (1, self.k_max), "tree": (1, self.k_main)}[
            best.mode
        ]
        plan = self.exploration.choose(best, rate, cands, b, self._steps, lo, hi)
        seconds = None if mixed or plan.mode != "all" else self.step_seconds(b, plan.k)
        self._chosen = (plan, b, model[plan], seconds) if plan in model else None
        self._explored = (plan, b, rate) if plan != best else None
        self.hold.set(b, plan, rate, cands, self._chosen)
        return plan

    def holds(self, b: int) -> bool:
        """Whether the next step at ``b`` rows keeps plain decoding without a choice (module docstring): the
        engine then asks the history for no proposals and prices nothing (:meth:`keep_held`)."""
        return self.hold.holds(b, self._steps + 1) and not self._unmeasured_wide(b)

    def _unmeasured_wide(self, b: int) -> bool:
        """Whether a batch of ``b`` rows first runs its widest step (:meth:`_choose`)."""
        wide = bool(self.verify.sizes) and b * (self.k_main + 1) > self.verify.sizes[-1]
        return wide and bool(len(self.draft)) and b not in self._measured_wide

    def keep_held(self, b: int) -> StepPlan:
        """The next step's plan where :meth:`holds` says so: plain decoding, its calibration learning as the
        full choice that set the hold recorded (at its rows; ``Hold.chosen``)."""
        self._steps += 1
        self._chosen, self._explored, self.last_held = self.hold.chosen(b), None, True
        self.last_plan = (StepPlan(0), b)
        return StepPlan(0)

    def observe(self, out: StepOutcome) -> None:
        """Everything one verify step teaches: each row's acceptance per source, the tree's calibration,
        the step's and the proposal's time, and what the plan gave against its prediction."""
        reach: dict[str, int] = {}  # per source, the deepest position a row's drafts were tried at
        for a in out.accepts:
            self.record_accept(a.source, a.row, a.drafted, a.accepted)
            reach[a.source] = max(reach.get(a.source, 0), min(a.drafted, a.accepted + 1))
            if a.support:
                self.support.record_proposal(a.support, a.drafted, a.accepted)
        for name, stats in self.batch.items():
            stats.decay_all(reach.get(name, 0))
        self.support.decay_all()
        if out.tree is not None:
            self.record_tree(*out.tree)
        self.record_step(out.rows, out.k, out.verify_s, out.draft_s, out.prefill, m=out.m,
                         tokens=out.packed_tokens)
        self.record_outcome(out.kept, out.seconds, out.prefill)

    def record_outcome(self, tokens: int, seconds: float, prefill: bool) -> None:
        """What the last chosen step gave: ``tokens`` its rows kept in ``seconds`` (the whole step: proposal,
        verify, host work); moves its plan's calibration (module docstring). A prefill's step is skipped.

        Plain decoding (one token a row) is judged on seconds against its table as it stands after the step
        (:meth:`observe` records its time first), not at its price at the choice: it learns what the table
        leaves out, not how far an earlier price was off. On the real model's GRPO loop (32 rows, fp32, Zen 4)
        the first plain step's price, extrapolated from the widest step alone, was 0.81 of its seconds; it and
        the held steps after it (priced at that choice) took plain decoding's calibration to 0.83, and k = 1
        won the next call's full choices (16.5% of its row-steps; generation 0.90 of plain decoding's). A
        drafting plan is judged against its price at the choice: the optimism of the estimate it was chosen
        for is what its calibration corrects (judged after the step instead, 0.99 of that at one row)."""
        chosen, self._chosen = self._chosen, None
        explored, self._explored = self._explored, None
        if self.trace is not None and self.last_plan is not None:
            self.trace(self, tokens, seconds, prefill, chosen, explored)
        if explored is not None and not prefill and seconds > 0:
            plan, b, best_rate = explored
            self.exploration.record(plan, b, best_rate, tokens / seconds, self._steps)
        if chosen is None or prefill or seconds <= 0 or tokens <= 0:
            return
        plan, b, predicted, predicted_s = chosen
        if predicted <= 0:
            return
        if plan == StepPlan(0):
            predicted_s = self.step_seconds(b, 0)
        ratio = min(2.0, max(0.25, predicted_s / seconds if predicted_s else tokens / seconds / predicted))
        self.rate_calibration.learn((plan, size_class(b)), ratio, b)

    def record_step(self, b: int, k: int, step_s: float, draft_s: float, prefill: bool, m: int = 0,
                    tokens: int | None = None) -> None:
        """Time of one step (everything but the draft's proposal) and of the main drafter's proposal
        of k tokens (0: it did not run); ``m``: a tree step's second branch (its verify forward is
        ``B * (1+k+m)`` tokens wide); ``tokens``: what a packed verify forward really ran (rows
        drafting fewer than k). A step that carried a prefill has no representative time and is not
        recorded."""
        self.last_draft_s = draft_s  # for the trace (record_outcome follows)
        if prefill:
            return
        if tokens is None:
            plain = self.verify.seconds.get(b)
            if k > 0 and m == 0 and plain:
                self.verify_over_plain.setdefault(size_class(b), CostTable()).update(k, step_s / plain)
            self.verify.update(b * (k + 1 + m), step_s)
            self._measured_at[b * (k + 1 + m)] = self._steps
        else:  # priced as an unpacked forward of as many tokens times packed_ratio; not in the table once it
            # has an unpacked measurement to compare with (before: its first)
            v = self.verify.estimate(tokens)
            if v:
                ratio = min(4.0, max(0.5, step_s / v))
                self.packed_ratio += self.packed_ratio_ema * (ratio - self.packed_ratio)
            else:
                self.verify.update(tokens, step_s)
        if k > 0 and draft_s > 0:
            self.draft.update(b, draft_s / k)
            self.proposal.setdefault(k, CostTable()).update(b, draft_s)
