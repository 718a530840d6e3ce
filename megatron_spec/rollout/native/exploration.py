"""When the adaptive controller tries a plan other than its best, and when it does not choose at all.

:class:`Exploration`: every ``every``-th step the controller tries a neighbour of the best plan's k
(alternately above and below), so the costs and the deeper positions' acceptance keep being measured, but
only a neighbour expected to give at least ``margin`` of the best rate (or on every ``every * rare``-th
step). A neighbour whose last try gave less than the best plan's rate waits twice as long for the next (up
to the rare steps' period; where it gave less than ``margin`` of it, up to ``rare_longest`` rare periods,
and the rare steps wait too: a k = 1 step at 16 rows on 2 cores costs ~2 plain steps, and tried every 64th
step it cost ~2%); one whose try gave more waits half as long (down to ``every``).

:class:`Hold`: where plain decoding is the best plan (a large batch on a compute-bound CPU), the steps up to
the next exploring step keep it without a new choice, and without the history's proposals (the live index
still reads each row's new tokens): a full choice costs ~2.5 ms of a ~48 ms plain step at 16 rows, the
history's proposals half of it (docs/benchmark_log.md, "Plain decoding held"). A plan drafting from the
history must trail it by more than the exploring margin: its rate moves step by step with the rows' proposals
(siblings write new text). The main drafter's plans move only with what the controller learns, slowly, and the
next exploring step prices them again. The hold goes on while the rows stay within a factor of two of those it
was set at (rows finishing, rows admitted: at 16 rows they cross between 15 and 16 every few steps); its steps
teach the calibration only at the rows it was priced for.

Both see plans, rows, rates and step numbers only (:mod:`megatron_spec.rollout.native.adaptive`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_spec.rollout.native.cost_model import size_class

if TYPE_CHECKING:
    from megatron_spec.rollout.native.adaptive import StepPlan


class Exploration:
    """The exploring steps (module docstring) and each neighbour's wait between its tries."""

    def __init__(self, every: int = 8, margin: float = 0.85, rare: int = 8, rare_longest: int = 8):
        self.every, self.margin, self.rare, self.rare_longest = every, margin, rare, rare_longest
        self.wait: dict[tuple[StepPlan, int], tuple[int, int]] = {}
        """Per (plan, :func:`size_class`): steps between its tries on ``margin``'s terms, and the first
        step it may be tried again (:meth:`choose`, :meth:`record`)."""
        self._up = True

    def is_exploring(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def choose(self, best: StepPlan, rate: float, cands: list[tuple[float, StepPlan]], b: int, step: int,
               lo: int, hi: int) -> StepPlan:
        """``best``, or on an exploring ``step`` a neighbour of its k in ``lo..hi`` (module docstring)."""
        if not self.is_exploring(step):
            return best
        sign = 1 if self._up else -1
        self._up = not self._up
        period = self.every * max(1, self.rare)
        rare = step % period == 0
        same_mode = {p: r for r, p in cands}
        for cand in (best.k + sign, best.k - sign):
            plan = best._replace(k=cand)
            wait, after = self.wait.get((plan, size_class(b)), (0, 0))
            if lo <= cand <= hi and (
                (rare and (wait <= period or step >= after))
                or (same_mode.get(plan, 0.0) >= self.margin * rate and step >= after)
            ):
                return plan
        return best

    def record(self, plan: StepPlan, b: int, best_rate: float, rate: float, step: int) -> None:
        """An exploring step's ``plan`` at ``b`` rows gave ``rate`` where the best plan was expected to give
        ``best_rate``: its wait doubles where it gave less (module docstring), and halves (down to ``every``)
        where it did better: one step's rate is noisy (at 16 rows a k = 1 step's accepted tokens alone vary
        by a fifth), and a neighbour that won and lost in turn, put back to every ``every``-th step by each
        win, cost the adaptive engine 3-5% of plain decoding at 16 bf16 rows (docs/benchmark_log.md, "Huge
        pages")."""
        key = (plan, size_class(b))
        wait = self.wait.get(key, (self.every, 0))[0]
        period = self.every * max(1, self.rare)
        longest = period * (self.rare_longest if rate < self.margin * best_rate else 1)
        wait = min(2 * wait, longest) if rate < best_rate else max(self.every, wait // 2)
        self.wait[key] = (wait, step + wait)


class Hold:
    """Plain decoding held between full choices (module docstring). ``every``: a full choice at least every
    ``every``-th step (0: every step chooses), and on every step ``exploration`` explores; a history or tree
    plan must trail plain decoding by its ``margin``."""

    def __init__(self, every: int, exploration: Exploration):
        self.every, self.exploration = every, exploration
        self._held: tuple[int, tuple] | None = None  # rows, and what the full choice recorded

    def set(self, b: int, best: StepPlan, rate: float, cands: list[tuple[float, StepPlan]],
            chosen: tuple | None) -> None:
        """After a full choice of ``best`` (calibrated ``rate``) at ``b`` rows: hold it if it is plain
        decoding and every plan drafting from the history is below the margin of its rate (module
        docstring); ``chosen``: what held steps at ``b`` rows record for the calibration."""
        plain = best.k == 0 and best.mode == "all"
        margin = self.exploration.margin
        lead = plain and all(r < margin * rate for r, p in cands if p.mode != "all")
        self._held = (b, chosen) if self.every and lead else None

    def clear(self) -> None:
        self._held = None

    def holds(self, b: int, step: int) -> bool:
        """Whether ``step`` at ``b`` rows keeps the held plan: the rows within a factor of two of the held
        rows, and neither a full choice's step nor an exploring one."""
        if self._held is None or step % self.every == 0 or self.exploration.is_exploring(step):
            return False
        rows = self._held[0]
        return rows <= 2 * b and b <= 2 * rows

    def chosen(self, b: int) -> tuple | None:
        """What a held step at ``b`` rows records for the calibration: the full choice's plan and prediction
        at its own rows; None at other rows (its prediction is not theirs)."""
        return None if self._held is None or self._held[0] != b else self._held[1]
