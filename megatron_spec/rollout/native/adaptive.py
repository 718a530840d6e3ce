"""Adaptive draft length: the k of each verify step, chosen from what the engine measured.

Speculation pays ``E(k) / T(B, k)`` tokens per second for a batch of B rows drafting k tokens:

* ``E_b(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_b[j]`` expected tokens emitted by row b, with
  ``alpha_b[j]`` the probability that draft j is accepted given drafts 1..j-1 were (acceptance per
  position, Leviathan et al. 2023, sec. 3.1, generalised from one alpha to one per position);
* ``T(B, k) = V(B * (k+1)) + P_k(B)``: the step's time, V the target forward + verification +
  host work of ``B * (k+1)`` tokens, ``P_k`` the main drafter's proposal of k tokens over B rows
  (k = 0: a plain step, ``V(B)``). A proposal is not k equal passes (EAGLE-3's first pass also
  extends over the tokens accepted in the last step and fuses the target's hidden states), so it
  is measured per k; a k not measured yet is estimated as k times the average pass, ``k * D(B)``,
  and a k measured only at other row counts as its nearest measurement scaled by ``D``. A batch
  wider than any verify measured so far (``B (k_main+1)`` tokens) first runs one step at
  ``k_main``, so its costs are interpolated rather than extrapolated from smaller batches.

Both are measured online by the engine, nothing is tuned to one machine (the two tables live in
:mod:`megatron_spec.rollout.native.measures`):

* :class:`CostTable` keeps the median of the last ``window`` measurements per integer size (tokens
  of a verify step; rows of a draft pass; the fastest of them while a size has fewer than
  ``trust``, since the first call of a new shape also builds its kernels) and interpolates
  linearly between sizes it has seen (extrapolating with the slope of the two nearest, never
  below zero slope). A median shrugs off a slow outlier (interference from other processes, a
  cold first call) and a lucky fast one alike, and it weighs a size measured in few steps the
  same way as one measured in many (an average keeps the lucky lows of the sizes chosen rarely,
  and then chooses them). Steps that carried a prompt's prefill are not recorded (their
  time is not the step's).
* :class:`AcceptanceStats` counts, per draft position, how often it was tried and accepted:
  per batch with a slow decay (so it follows the draft and the policy as they train) and per
  request (a row's own history, shrunk towards the batch's rate with ``prior_weight`` pseudo-steps:
  a request with few steps gets the batch's rate, one with many its own). A source nobody has
  tried yet starts optimistic (rate 1 with one pseudo-step), so it is tried and then judged.

:class:`DraftLengthController` picks ``argmax_k sum_b E_b(k) / T(B, k)`` over ``k_min..k_main``
(the main drafter's longest proposal). With a second source beside it (the history drafter,
whose proposals cost no forward), it also weighs a step where only the rows with a history
proposal draft, up to ``k_max`` tokens, and the main drafter does not run: ``T = V(B + sum_b
min(k, n_b))`` (the verify forward runs packed: each row its last token and its own proposal of
n_b tokens, ``Segment.pack``), the other rows emit one token; and, with ``k_tree``, a *tree*
step: every row drafts k tokens from the main drafter and the rows with a history proposal also
carry up to m of it as a second branch of the same verify (``megatron_spec.speculative.verify_tree``),
``T = V(B * (1+k+m)) + P_k(B)``. A tree row emits ``1 + max(a, n)`` tokens, a the main branch's
accepted drafts and n the history's matching ones; the controller estimates
``E = 1 + sum_j P(a >= j or n >= j)`` as if the two were independent
(``1 - (1 - PA_j)(1 - PB_j)``), then scales the drafted part by what tree steps
really emitted over what it predicted for them (an online calibration: the two sources are
correlated, both right on easy text, and the independence estimate is optimistic). Every
``explore_every``-th step it tries a neighbour of the best k instead (alternately above and below),
so the cost table and the deeper positions' acceptance keep being measured, but only a neighbour
expected to give at least ``explore_margin`` of the best rate (or on every ``explore_every *
explore_rare``-th step), since where speculation loses badly (a large batch on a compute-bound CPU,
where a verify of B(k+1) tokens costs nearly k+1 plain steps) each try costs a step's worth of rate;
and a neighbour whose last such try gave less than the best plan's rate waits twice as long for the
next (up to the rare steps' period; a try that does better resets it). A packed verify (history rows
drafting, the others not) runs the Python layers, not the C++ stack: it is priced as an unpacked
forward of as many tokens times ``packed_ratio``, learned from the packed steps, and stays out of the
verify table.
The choice never changes any output distribution: verification is exact for every
k, m and mode.

What a plan really gave is checked against what the model predicted for it: each step's tokens
kept per second of the whole step (its proposal, verify and host work) over the rate predicted
when the plan was chosen, averaged per plan and batch-size class (``rate_calibration``; 1 until
measured, then a running mean that becomes an EMA), multiplies that plan's predicted rate from then
on. The model leaves things out that this catches: choosing the best of several noisy estimates
picks the ones that happen to be high (a plan chosen because its acceptance or cost looked good
this step gives less than predicted, on average); EAGLE-3's first pass after plain steps extends
over every token they emitted; a speculative step's host work grows with the rows' drafts. Where a
plan predicts within a few percent of plain decoding, this is what keeps the controller on plain
decoding. The measurements behind these choices: docs/benchmark_log.md, "The adaptive controller's
design, measured".

This module knows nothing about models, drafts or the engine's slots: it sees sizes, seconds and
accepted counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from megatron_spec.faults import test_hook
from megatron_spec.rollout.config import HISTORY_TREE_MODES
from megatron_spec.rollout.native.cost_model import expected_tokens, size_class
from megatron_spec.rollout.native.measures import AcceptanceStats, CostTable, SupportStats

Option = tuple[Sequence[float], "int | None"]
"""One draft source of one row: acceptance per position, and its proposal length (None: any k)."""


class StepPlan(NamedTuple):
    """What the next verify step drafts: ``k`` main-drafter tokens (or history tokens in ``history``
    mode), ``mode`` one of ``all`` (every row drafts from its better source), ``history`` (only rows
    with a history proposal draft; the main drafter sits out), ``tree`` (every row drafts k from the
    main drafter, rows with a history proposal add up to ``m`` of it as a second branch)."""

    k: int
    mode: str = "all"
    m: int = 0


class DraftLengthController:
    """Chooses k per verify step (see the module docstring)."""

    def __init__(self, k_max: int, k_min: int = 0, explore_every: int = 8, explore_margin: float = 0.85,
                 explore_rare: int = 8, row_prior_weight: float = 4.0, support_weight: float = 2.0,
                 batch_decay: float = 0.98, k_main: int | None = None, k_tree: int = 0, tree: str = "auto",
                 tree_calibration_ema: float = 0.05, rate_calibration_ema: float = 0.1):
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
        self.rate_calibration: dict[tuple[StepPlan, int], tuple[float, int]] = {}
        """Per (plan, :func:`size_class`): realised over predicted tokens per second and how many steps
        measured it (module docstring)."""
        self.rate_calibration_ema = rate_calibration_ema
        self._chosen: tuple[StepPlan, int, float] | None = None  # the last plan, its rows, its predicted rate
        # an exploring step: its plan, rows, the best rate
        self._explored: tuple[StepPlan, int, float] | None = None
        self._explore_wait: dict[tuple[StepPlan, int], tuple[int, int]] = {}
        """Per (plan, :func:`size_class`): steps between its tries on ``explore_margin``'s terms, and the
        first
        step it may be tried again (doubled each time a try gives less than the best plan's rate)."""
        self.explore_every = explore_every
        self.explore_margin, self.explore_rare = explore_margin, explore_rare
        self.row_prior_weight = row_prior_weight
        # SupportStats.alpha
        self.support, self.support_weight = SupportStats(decay=batch_decay), support_weight
        self.batch_decay = batch_decay
        self.batch: dict[str, AcceptanceStats] = {}  # per draft source (the drafter's kind, "history")
        self.verify = CostTable()  # keyed by tokens in the step's target forward, B * (k+1)
        self.packed_ratio = 1.0
        """A packed verify's seconds (rows drafting different lengths, ``Segment.pack``) over an unpacked
        one's
        of as many tokens (EMA; 1 until measured): packed forwards run the Python layers, not the C++
        stack."""
        self.packed_ratio_ema = 0.2
        self.draft = CostTable()  # one draft pass (a proposal over k), keyed by rows B
        self.proposal: dict[int, CostTable] = {}  # a whole proposal of k tokens, per k, keyed by rows B
        self._steps = 0
        self.last_plan: tuple[StepPlan, int] | None = None  # the last plan chosen and its rows
        self.last_draft_s = 0.0  # the main drafter's proposal time in the last step (0: it did not run)
        self.trace = None  # a callable given each step's outcome (decision_trace.DecisionTrace), or None
        self._explore_up = True
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
        p = self.proposal_seconds(b, k)
        return None if p is None else v + p

    def proposal_seconds(self, b: int, k: int) -> float | None:
        """Seconds of the main drafter's proposal of k tokens over b rows: its table for k, within the
        rows it was measured at; outside them, its nearest measurement scaled by how one draft pass
        scales from those rows to b (a table measured at one row count alone would otherwise price b
        rows b times as high: a draft pass over 16 rows costs about what one over 1 row does on a
        CPU); a k never measured: k average passes."""
        table = self.proposal.get(k) or None  # (an empty table is falsy)
        if table is not None and table.sizes[0] <= b <= table.sizes[-1]:
            return table.estimate(b)
        d = self.draft.estimate(b)
        if table is None:
            return None if d is None else k * d
        near = min(table.sizes, key=lambda s: abs(s - b))
        d_near = self.draft.estimate(near)
        return table.seconds[near] * d / d_near if d is not None and d_near else table.estimate(b)

    def token_threshold(self, b: int) -> float | None:
        """The probability of being reached and accepted above which one more drafted token of a row pays at
        ``b`` rows: what a verify of twice the tokens costs more, over a plain step (each extra token costs
        ``(T(2b) - T(b)) / b``, each row's plain token ``T(b) / b``). Compute-bound (a large batch on a CPU)
        it is near 1, memory-bound (few rows) near 0. None until the verify table has two sizes."""
        if len(self.verify) < 2:
            return None
        t, t2 = self.verify.estimate(b), self.verify.estimate(2 * b)
        if not t or t2 is None:
            return None
        return min(1.0, max(0.0, (t2 - t) / t))

    def expected_rates(self, options: Sequence[Sequence[Option]]) -> dict[int, float]:
        """Expected tokens per second for every k in ``k_min..k_main`` with a cost estimate, every row
        drafting: row b emits ``max over options[b]`` of ``expected_tokens`` (its best draft source
        at that k) and the step pays the main drafter's proposal of k tokens."""
        b = len(options)
        out = {}
        for k in range(self.k_min, self.k_main + 1):
            t = self.step_seconds(b, k)
            if t is not None:
                out[k] = sum(max(expected_tokens(a, k, m) for a, m in opts) for opts in options) / t
        return out

    def history_rates(self, options: Sequence[Sequence[Option]]) -> dict[int, float]:
        """Expected tokens per second for every k in ``1..k_max`` when only the rows with a second
        source (``options[b][1]``, the history's proposal) draft and the main drafter does not run:
        those rows emit ``expected_tokens`` of their proposal, the others one token, and the step
        costs the verify forward alone (a proposal from the history costs no forward). Empty when
        no row has a second source."""
        if not any(len(opts) > 1 for opts in options):
            return {}
        b = len(options)
        out = {}
        for k in range(1, self.k_max + 1):  # packed: the rows without a proposal run their last token only
            t = self.verify.estimate(b + sum(min(k, opts[1][1] or k) for opts in options if len(opts) > 1))
            if t is not None and not all(len(opts) > 1 and (opts[1][1] or k) >= k for opts in options):
                t *= self.packed_ratio
            if t is not None:
                out[k] = sum(expected_tokens(*opts[1], k) if len(opts) > 1 else 1.0 for opts in options) / t
        return out

    def tree_rates(self, options: Sequence[Sequence[Option]]) -> dict[tuple[int, int], float]:
        """Expected tokens per second of a tree step for every (k, m), k in ``1..k_main``, m in
        ``1..k_tree`` (vectorised: ``B x k x m x positions``). Empty without a tree or a history row."""
        if not self.k_tree or not any(len(opts) > 1 for opts in options):
            return {}
        b, kk, mm = len(options), self.k_main, self.k_tree
        depth = max(kk, mm)
        pa = np.zeros((b, depth))  # P(the main branch accepts >= j + 1 drafts)
        pb = np.zeros((b, depth))  # P(the history branch matches >= j + 1 tokens)
        lim = np.zeros(b, dtype=np.int64)
        for i, opts in enumerate(options):
            pa[i, :kk] = np.cumprod(np.asarray(opts[0][0][:kk], dtype=np.float64))
            if len(opts) > 1:
                n = min(opts[1][1] or mm, mm)
                pb[i, :n] = np.cumprod(np.asarray(opts[1][0][:n], dtype=np.float64))
                lim[i] = n
        j = np.arange(depth)
        ka = (j[None, :] < np.arange(1, kk + 1)[:, None]).astype(np.float64)  # [k, depth]
        mb = (j[None, :] < np.arange(1, mm + 1)[:, None]).astype(np.float64)  # [m, depth]
        a = pa[:, None, None, :] * ka[None, :, None, :]  # [B, k, 1, depth]
        h = pb[:, None, None, :] * mb[None, None, :, :]  # [B, 1, m, depth]
        union = (a + h - a * h).sum(-1)  # [B, k, m]
        main_only = (pa[:, None, :] * ka[None]).sum(-1)  # [B, k]
        has = lim > 0
        drafted = np.where(has[:, None, None], self.tree_calibration * union, main_only[:, :, None])
        tokens = (1.0 + drafted).sum(0)  # [k, m]
        out = {}
        for k in range(1, kk + 1):
            whole = self.proposal_seconds(b, k)
            if whole is None:
                continue
            for m in range(1, mm + 1):
                t = self.verify.estimate(b * (1 + k + m))
                if t is not None:
                    out[(k, m)] = float(tokens[k - 1, m - 1]) / (t + whole)
        return out

    def record_tree(self, predicted: float, emitted: float) -> None:
        """One tree step's rows with a second branch: tokens drafted and accepted, predicted (before the
        calibration) and emitted; moves the calibration towards their ratio."""
        if predicted > 0:
            ratio = min(2.0, emitted / predicted)
            self.tree_calibration += self.tree_calibration_ema * (ratio - self.tree_calibration)

    def choose_step(self, options: Sequence[Sequence[Option]]) -> StepPlan:
        """The next step's :class:`StepPlan` (:meth:`_choose`), kept with its rows for the trace."""
        plan = self._choose(options)
        self.last_plan = (plan, len(options))
        return plan

    def _choose(self, options: Sequence[Sequence[Option]]) -> StepPlan:
        """``options[b]``: row b's draft sources as (acceptance per
        position (``row_alpha``), proposal length or None for any k), the main drafter's first.

        A batch whose widest step (``k_main`` drafts per row) is larger than any verify the table has
        measured runs that step first, as the very first step does: every cost up to it is then
        interpolated between measurements, not extrapolated from small batches (where a verify's
        cost per token says little about a larger one's)."""
        b = len(options)
        wide = self.verify.sizes and b * (self.k_main + 1) > self.verify.sizes[-1]
        if wide and len(self.draft) and b not in self._measured_wide:
            self._measured_wide.add(b)  # once per batch size (its step may carry a prefill, not recorded)
            self._steps += 1
            self._chosen = self._explored = None
            return StepPlan(self.k_main)
        trees = self.tree_rates(options)
        if self.force_tree and trees:  # the test hook: a tree whenever a row can have one, the whole
            # history proposal its second branch (exercised past the drafter's tokens); only k is chosen
            m = max(min(o[1][1] or self.k_tree, self.k_tree) for o in options if len(o) > 1)
            return self._pick({}, {}, {km: r for km, r in trees.items() if km[1] == m}, b)
        return self._pick(self.expected_rates(options), self.history_rates(options), trees, b)

    def calibration(self, plan: StepPlan, b: int) -> float:
        """Realised over predicted tokens per second of ``plan`` at ``b`` rows (1 until measured)."""
        return self.rate_calibration.get((plan, size_class(b)), (1.0, 0))[0]

    def _pick(self, rates: dict[int, float], hist_rates: dict[int, float],
              tree_rates: dict[tuple[int, int], float], b: int = 1) -> StepPlan:
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
        plan = self._explore(best, rate, cands, b)
        self._chosen = (plan, b, model[plan]) if plan in model else None
        self._explored = (plan, b, rate) if plan != best else None
        return plan

    def _explore(
        self, best: StepPlan, rate: float, cands: list[tuple[float, StepPlan]], b: int = 1
    ) -> StepPlan:
        """``best``, or on an exploring step a neighbour of its k (module docstring). A neighbour whose last
        try
        on ``explore_margin``'s terms gave less than the best plan's rate waits twice as long for the next one
        (up to the rare steps' period); one that did better is tried every ``explore_every``-th step again."""
        lo, hi = {"all": (self.k_min, self.k_main), "history": (1, self.k_max), "tree": (1, self.k_main)}[
            best.mode
        ]
        if self.explore_every and self._steps % self.explore_every == 0:
            step = 1 if self._explore_up else -1
            self._explore_up = not self._explore_up
            rare = self._steps % (self.explore_every * max(1, self.explore_rare)) == 0
            same_mode = {p: r for r, p in cands}
            for cand in (best.k + step, best.k - step):
                plan = best._replace(k=cand)
                if lo <= cand <= hi and (
                    rare
                    or (
                        same_mode.get(plan, 0.0) >= self.explore_margin * rate
                        and self._steps >= self._explore_wait.get((plan, size_class(b)), (0, 0))[1]
                    )
                ):
                    return plan
        return best

    def record_outcome(self, tokens: int, seconds: float, prefill: bool) -> None:
        """What the last chosen step gave: ``tokens`` its rows kept in ``seconds`` (the whole step:
        proposal, verify, host work). Moves the calibration of its plan and batch-size class towards
        realised over predicted. A step that carried a prefill is not representative and is skipped."""
        chosen, self._chosen = self._chosen, None
        explored, self._explored = self._explored, None
        if self.trace is not None and self.last_plan is not None:
            self.trace(self, tokens, seconds, prefill, chosen, explored)
        if explored is not None and not prefill and seconds > 0:
            plan, b, best_rate = explored
            key = (plan, size_class(b))
            wait = self._explore_wait.get(key, (self.explore_every, 0))[0]
            longest = self.explore_every * max(1, self.explore_rare)
            wait = min(2 * wait, longest) if tokens / seconds < best_rate else self.explore_every
            self._explore_wait[key] = (wait, self._steps + wait)
        if chosen is None or prefill or seconds <= 0 or tokens <= 0:
            return
        plan, b, predicted = chosen
        if predicted <= 0:
            return
        ratio = min(2.0, max(0.25, tokens / seconds / predicted))
        key = (plan, size_class(b))
        value, n = self.rate_calibration.get(key, (1.0, 0))
        # a running mean with the prior 1 as one step, then an EMA
        w = max(self.rate_calibration_ema, 1.0 / (n + 2))
        self.rate_calibration[key] = (value + w * (ratio - value), n + 1)

    def record_step(self, b: int, k: int, step_s: float, draft_s: float, prefill: bool, m: int = 0,
                    tokens: int | None = None) -> None:
        """Time of one step (everything but the draft's proposal) and of the main drafter's proposal
        of k tokens (0: it did not run); ``m``: a tree step's second branch (its verify forward is
        ``B * (1+k+m)`` tokens wide); ``tokens``: what a packed verify forward really ran (rows
        drafting fewer than k). A step that carried a prefill has no representative time and is not
        recorded."""
        for stats in (*self.batch.values(), self.support):
            stats.decay_all()
        self.last_draft_s = draft_s  # for the trace (record_outcome follows)
        if prefill:
            return
        if tokens is None:
            self.verify.update(b * (k + 1 + m), step_s)
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
