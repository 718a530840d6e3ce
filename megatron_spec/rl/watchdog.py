"""Acceptance-collapse watchdog: notice when speculation stops paying and say what to do.

The peers' worst failure is silent: a draft lost or overwritten on refit or sleep keeps
decoding correctly (verification is exact) but every draft is rejected, so the rollout runs
at autoregressive speed plus the draft's cost. Weight verification (``verify``) catches the
known causes; this catches the rest from the outcome. A step is *collapsed* when its mean
accept length (tokens per verify step, 1.0 = nothing accepted) is at or below ``threshold``.
:meth:`AcceptanceWatchdog.observe` warns once and returns ``Action.FALLBACK`` when fallback is
enabled (the caller then decodes without drafts, which is cheaper than drafting for nothing),
else ``Action.WARN``:

* at once, on the first collapsed step, when the collapse is *sudden*: the step's gain over
  plain decoding (accept length - 1) is at most ``sudden_fraction`` of the gain of the healthy
  steps just before it (their mean over the last ``window``). A draft that gained 2.6 accepted
  tokens per verify step and now gains 0.02 was broken by something (a corrupted or lost update),
  not by drift: waiting ``window`` steps would spend them drafting for nothing;
* after ``window`` consecutive collapsed steps otherwise (slow decay, or no healthy step seen
  yet): one step near the threshold after a gradual fall is not evidence enough.

One healthy step resets it. A step without any speculative verify step (``None``: speculation
already off, or an adaptive engine that chose k = 0 throughout) is no evidence either way: the
streak stands and the current verdict is repeated.

Plain state, no engines or processes.
"""

from __future__ import annotations

import enum
import logging
import math

logger = logging.getLogger(__name__)


class Action(enum.StrEnum):
    """What the caller should do after a step (a ``str``: JSON-serialisable in metrics)."""

    OK = "ok"
    WARN = "warn"
    FALLBACK = "fallback"


class AcceptanceWatchdog:
    """Args:
        window: consecutive collapsed steps before acting (>= 1).
        fallback: return ``Action.FALLBACK`` (instead of ``WARN``) on collapse.
        threshold: accept length at or below which a step counts as collapsed. With k draft
            tokens a working draft gives 1 + sum of per-position accept rates; 1.1 means
            fewer than one draft accepted every ten verify steps.
        sudden_fraction: a collapsed step whose gain (accept length - 1) is at most this fraction
            of the recent healthy gain acts at once (0 = only an exact 1.0 after a healthy step;
            a negative value turns the immediate path off: windowed only).
    """

    def __init__(self, window: int = 3, fallback: bool = False, threshold: float = 1.1,
                 sudden_fraction: float = 0.25):
        if window < 1:
            raise ValueError(f"watchdog window must be >= 1 step, got {window}")
        if not threshold >= 1.0:
            raise ValueError(
                f"watchdog threshold is an accept length (>= 1.0 tokens per verify step), got {threshold}"
            )
        if not sudden_fraction < 1.0:
            raise ValueError(
                "watchdog sudden_fraction must be < 1 (a fraction of the healthy gain), got "
                f"{sudden_fraction}"
            )
        self.window, self.fallback, self.threshold = window, fallback, threshold
        self.sudden_fraction = sudden_fraction
        self.streak = 0
        self.tripped = False
        self.healthy: list[float] = []  # the last ``window`` healthy accept lengths

    def observe(self, accept_length: float | None) -> Action:
        """Record one step's mean accept length (None: the step verified no draft); returns what to do now."""
        if accept_length is None:
            return (Action.FALLBACK if self.fallback else Action.WARN) if self.tripped else Action.OK
        if math.isnan(accept_length):
            raise ValueError(f"accept length must be a number, got {accept_length!r}")
        if accept_length > self.threshold:
            if self.tripped:
                logger.info("speculative acceptance recovered (accept length %.3f)", accept_length)
            self.streak, self.tripped = 0, False
            self.healthy = (self.healthy + [accept_length])[-self.window:]
            return Action.OK
        sudden = self.streak == 0 and self.is_sudden(accept_length)
        self.streak += 1
        if self.streak < self.window and not sudden and not self.tripped:
            return Action.OK
        if not self.tripped:
            self.tripped = True
            if sudden:
                what = (f"accept length fell to {accept_length:.3f} from {self.baseline():.3f} "
                        f"(mean of the last {len(self.healthy)} healthy steps) in one step")
            else:
                what = (f"accept length <= {self.threshold:.2f} for {self.streak} consecutive steps "
                        f"(last {accept_length:.3f})")
            logger.warning(
                "speculative acceptance collapsed: %s; the draft is probably stale, corrupted or lost "
                "(check the draft weight sync and the last draft update)%s",
                what,
                "; falling back to autoregressive decoding" if self.fallback else "",
            )
        return Action.FALLBACK if self.fallback else Action.WARN

    def baseline(self) -> float | None:
        """Mean accept length of the last ``window`` healthy steps (None before the first)."""
        return sum(self.healthy) / len(self.healthy) if self.healthy else None

    def is_sudden(self, accept_length: float) -> bool:
        """Whether a collapsed ``accept_length`` right after healthy steps is a sudden collapse."""
        base = self.baseline()
        return (base is not None and self.sudden_fraction >= 0
                and accept_length - 1.0 <= self.sudden_fraction * (base - 1.0))

    def reset(self) -> None:
        """Forget the streak and the healthy history (e.g. after re-pushing the draft)."""
        self.streak, self.tripped = 0, False
        self.healthy = []
