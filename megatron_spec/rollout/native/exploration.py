"""When the adaptive controller tries a plan other than its best, and when it does not choose at all.

:class:`Exploration`: every ``every``-th step the controller tries a neighbour of the best plan's k
(alternately above and below), so the costs and the deeper positions' acceptance keep being measured, but
only a neighbour expected to give at least ``margin`` of the best rate (or on every ``every * rare``-th
step). A neighbour whose last try gave less than the best plan's rate waits twice as long for the next (up
to the rare steps' period; where it gave less than ``margin`` of it, up to ``rare_longest`` rare periods,
and the rare steps wait too: a k = 1 step at 16 rows on 2 cores costs ~2 plain steps, and tried every 64th
step it cost ~2%).

:class:`Hold`: where plain decoding leads every other plan by more than the exploring margin (a large
batch on a compute-bound CPU), the steps up to the next exploring step keep it without a new choice, and
without the history's proposals (the live index still reads each row's new tokens): the choice and the
proposals cost ~2 ms of a 50 ms plain step at 16 rows (docs/benchmark_log.md, "Plain decoding held").

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
        ``best_rate``: its wait doubles where it gave less (module docstring), and is ``every`` again where
        it did better."""
        key = (plan, size_class(b))
        wait = self.wait.get(key, (self.every, 0))[0]
        period = self.every * max(1, self.rare)
        longest = period * (self.rare_longest if rate < self.margin * best_rate else 1)
        wait = min(2 * wait, longest) if rate < best_rate else self.every
        self.wait[key] = (wait, step + wait)


class Hold:
    """Plain decoding held between full choices (module docstring). ``every``: a full choice at least every
    ``every``-th step (0: every step chooses), and on every step ``exploration`` explores; a plan leads by its
    ``margin``."""

    def __init__(self, every: int, exploration: Exploration):
        self.every, self.exploration = every, exploration
        self._held: tuple[int, tuple] | None = None  # rows, and what the full choice recorded

    def set(self, b: int, best: StepPlan, rate: float, cands: list[tuple[float, StepPlan]],
            chosen: tuple | None) -> None:
        """After a full choice of ``best`` (calibrated ``rate``) at ``b`` rows: hold it if it is plain
        decoding and every other plan's rate is below the margin of its; ``chosen``: what held steps record
        for the calibration."""
        plain = best.k == 0 and best.mode == "all"
        lead = plain and all(r < self.exploration.margin * rate for r, p in cands if p != best)
        self._held = (b, chosen) if self.every and lead else None

    def clear(self) -> None:
        self._held = None

    def holds(self, b: int, step: int) -> bool:
        """Whether ``step`` at ``b`` rows keeps the held plan: the rows unchanged, and neither a full choice's
        step nor an exploring one."""
        return (self._held is not None and self._held[0] == b and step % self.every != 0
                and not self.exploration.is_exploring(step))

    @property
    def chosen(self) -> tuple | None:
        return None if self._held is None else self._held[1]
