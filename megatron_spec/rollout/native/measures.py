"""What the adaptive draft length measures: seconds per step size, acceptance per draft position.

:class:`CostTable` (a verify's or a proposal's seconds per integer size: the median of the size's last
measurements, interpolated between sizes) and :class:`AcceptanceStats` (tried / accepted counts per
draft position, decayed, with a shrinking prior), used by :mod:`megatron_spec.rollout.native.adaptive`
(whose docstring says why each is built so), and what a live proposal's sibling support says of its acceptance
(:class:`SupportStats`, :func:`paying_prefix`). They know nothing about models, drafts or plans.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence


class CostTable:
    """Seconds per integer size, the median of its last ``window`` measurements (the fastest one
    while it has fewer than ``trust``), linear interpolation between sizes."""

    def __init__(self, window: int = 9, max_sizes: int = 512, trust: int = 3):
        if window < 1 or not 1 <= trust <= window:
            raise ValueError(f"need window >= 1 and 1 <= trust <= window, got window {window}, trust {trust}")
        self.window, self.trust = window, trust
        self.max_sizes = max_sizes
        self.sizes: list[int] = []
        self.seconds: dict[int, float] = {}
        """The current estimate per size (the median of its window; its fastest under ``trust``)."""
        self._samples: dict[int, deque[float]] = {}

    def update(self, size: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if size not in self._samples:
            if len(self.sizes) >= self.max_sizes:  # bounded: forget the size farthest from this one
                far = max(self.sizes, key=lambda s: abs(s - size))
                self.sizes.remove(far)
                del self.seconds[far], self._samples[far]
            bisect.insort(self.sizes, size)
            self._samples[size] = deque(maxlen=self.window)
        window = self._samples[size]
        window.append(seconds)
        # under ``trust`` measurements the fastest one: the first call of a new shape also pays for
        # building its kernels, and a median of it and one warm call would still price it as cold
        self.seconds[size] = min(window) if len(window) < self.trust else statistics.median(window)

    def __len__(self) -> int:
        return len(self.sizes)

    def estimate(self, size: int) -> float | None:
        """Seconds at ``size``: measured, interpolated, or extrapolated; None with no data.

        With one measured size s0 the cost is taken proportional to the size (``t0 * size / s0``):
        optimistic below s0, pessimistic above, so the controller's next choices measure a
        second size and the table becomes a line."""
        if not self.sizes:
            return None
        if size in self.seconds:
            return self.seconds[size]
        if len(self.sizes) == 1:
            s0 = self.sizes[0]
            return self.seconds[s0] * size / s0
        i = bisect.bisect_left(self.sizes, size)
        lo, hi = (i - 1, i) if 0 < i < len(self.sizes) else ((0, 1) if i == 0 else (-2, -1))
        s_lo, s_hi = self.sizes[lo], self.sizes[hi]
        t_lo, t_hi = self.seconds[s_lo], self.seconds[s_hi]
        slope = max(0.0, (t_hi - t_lo) / (s_hi - s_lo))
        return max(t_lo + slope * (size - s_lo), min(t_lo, t_hi) * 0.05)


def proposal_seconds(proposal: dict[int, CostTable], draft: CostTable, b: int, k: int) -> float | None:
    """Seconds of a drafter's proposal of k tokens over b rows: ``proposal[k]`` (whole proposals, keyed by
    rows) within the rows it was measured at; outside them, its nearest measurement scaled by how one draft
    pass (``draft``, keyed by rows) scales from those rows to b (a table measured at one row count alone
    would otherwise price b rows b times as high: a draft pass over 16 rows costs about what one over 1 row
    does on a CPU); a k never measured: k average passes."""
    table = proposal.get(k) or None  # (an empty table is falsy)
    if table is not None and table.sizes[0] <= b <= table.sizes[-1]:
        return table.estimate(b)
    d = draft.estimate(b)
    if table is None:
        return None if d is None else k * d
    near = min(table.sizes, key=lambda s: abs(s - b))
    d_near = draft.estimate(near)
    return table.seconds[near] * d / d_near if d is not None and d_near else table.estimate(b)


class Calibration(dict):
    """A factor per key (the adaptive controller's: per plan and batch-size class) learned from ratios of
    real over predicted, ``key -> (factor, weight seen)``: a running mean from the prior 1 worth ``unit`` of
    weight, then an EMA of ``ema`` per ``unit`` (a step weighs as its rows: at one row what a step gives
    scatters most)."""

    def __init__(self, unit: float = 16, ema: float = 0.1):
        super().__init__()
        self.unit, self.ema = unit, ema

    def factor(self, key) -> float:
        """The key's factor (1 until measured)."""
        return self.get(key, (1.0, 0))[0]

    def learn(self, key, ratio: float, weight: float) -> None:
        value, seen = self.get(key, (1.0, 0))
        w = weight / (weight + self.unit + min(seen, self.unit / self.ema))
        self[key] = (value + w * (ratio - value), seen + weight)


class AcceptanceStats:
    """Tried / accepted counts per draft position (1-based positions stored 0-based)."""

    def __init__(self, k_max: int, decay: float = 1.0):
        self.decay = decay
        self.tried = [0.0] * k_max
        self.accepted = [0.0] * k_max

    def record(self, k: int, num_accepted: int) -> None:
        """One verify step of one row drafted ``k`` tokens and ``num_accepted`` passed: positions
        ``1..min(k, a+1)`` were tried (position a+1 was the rejected one when a < k)."""
        for i in range(min(k, num_accepted + 1)):
            self.tried[i] += 1.0
            if i < num_accepted:
                self.accepted[i] += 1.0

    def decay_all(self, upto: int | None = None) -> None:
        """Decay the counts of positions ``1..upto`` (None: all): the adaptive controller decays only the
        positions a step tried, so a position tried rarely keeps its last tries instead of forgetting them."""
        if self.decay < 1.0:
            n = len(self.tried) if upto is None else upto
            self.tried[:n] = [t * self.decay for t in self.tried[:n]]
            self.accepted[:n] = [a * self.decay for a in self.accepted[:n]]

    def rates(self, prior: Sequence[float] | None = None, prior_weight: float = 1.0,
              first_prior: float = 0.5) -> list[float]:
        """Conditional acceptance per position, shrunk towards ``prior`` (or, without one, towards
        the previous position's rate; ``first_prior`` for position 1) by ``prior_weight`` steps."""
        out: list[float] = []
        for i, (t, a) in enumerate(zip(self.tried, self.accepted)):
            p = prior[i] if prior is not None else (out[-1] if out else first_prior)
            out.append((a + prior_weight * p) / (t + prior_weight))
        return out


SUPPORT_CLASSES = 10


def support_class(agree: int, total: int, position: int) -> int:
    """The class a live proposal's token is judged in (:class:`SupportStats`): unanimous among 1, 2 or
    >= 3 sibling texts, a majority (>= 2/3) or a minority of several; at the proposal's first position
    or later (given the earlier ones were accepted)."""
    kind = min(total, 3) - 1 if agree == total else (3 if 3 * agree >= 2 * total else 4)
    return 2 * kind + (position > 0)


class SupportStats(AcceptanceStats):
    """Acceptance of live proposals' tokens per :func:`support_class` (tried / accepted, decayed).

    ``LiveIndex.propose_with_support`` says per token how many of the sibling texts still in the running
    wrote it (``agree``) of how many reached it (``total``). What that is worth is learned, not assumed:
    on SmolLM2's T=1 answers a token two or more siblings all wrote was the target's 75-91% of the time,
    a minority's 18-21%, a lone sibling's 45% at the first position and 68% further on
    (``benchmarks/bench_live_support.py``: a lockstep replay of 256 answers, docs/benchmark_log.md)."""

    def __init__(self, decay: float = 1.0):
        super().__init__(SUPPORT_CLASSES, decay)  # tried / accepted per class instead of per position

    def record_proposal(
        self, support: Sequence[tuple[int, int]], num_drafted: int, num_accepted: int
    ) -> None:
        """A proposal with ``support`` per token: ``num_drafted`` of its tokens were verified (or compared
        with what the row emitted) and the first ``num_accepted`` passed."""
        for j in range(min(num_drafted, num_accepted + 1, len(support))):
            c = support_class(*support[j], j)
            self.tried[c] += 1.0
            if j < num_accepted:
                self.accepted[c] += 1.0

    def alpha(self, base: Sequence[float], support: Sequence[tuple[int, int]], weight: float) -> list[float]:
        """Acceptance per position of a proposal with ``support``: each token's class rate, shrunk towards the
        source's learned rate ``base[j]`` by ``weight`` pseudo-observations (positions past it keep
        ``base``)."""
        out = list(base)
        for j, (agree, total) in enumerate(support[:len(out)]):
            c = support_class(agree, total, j)
            out[j] = (self.accepted[c] + weight * out[j]) / (self.tried[c] + weight)
        return out


def paying_prefix(alpha: Sequence[float], threshold: float, limit: int) -> int:
    """How many of a proposal's first ``limit`` tokens are reached and accepted with probability at least
    ``threshold`` (``alpha``: conditional acceptance per position)."""
    p, n = 1.0, 0
    for a in alpha[:limit]:
        p *= a
        if p < threshold:
            break
        n += 1
    return n
