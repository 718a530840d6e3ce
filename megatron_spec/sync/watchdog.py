"""Acceptance-collapse watchdog: notice when speculation stops paying and say what to do.

The peers' worst failure is silent: a draft lost or overwritten on refit or sleep keeps
decoding correctly (verification is exact) but every draft is rejected, so the rollout runs
at autoregressive speed plus the draft's cost. Weight verification (``verify``) catches the
known causes; this catches the rest from the outcome: if the mean accept length (tokens
per verify step, 1.0 = nothing accepted) stays at or below ``threshold`` for ``window``
consecutive steps, :meth:`AcceptanceWatchdog.observe` warns once and returns
``Action.FALLBACK`` when fallback is enabled (the caller then decodes without drafts,
which is cheaper than drafting for nothing), else ``Action.WARN``. One healthy step
resets it.

Plain state, no engines or processes.
"""

from __future__ import annotations

import enum
import logging
import math

logger = logging.getLogger(__name__)


class Action(str, enum.Enum):
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
    """

    def __init__(self, window: int = 3, fallback: bool = False, threshold: float = 1.1):
        if window < 1:
            raise ValueError(f"watchdog window must be >= 1 step, got {window}")
        if not threshold >= 1.0:
            raise ValueError(f"watchdog threshold is an accept length (>= 1.0 tokens per verify step), got {threshold}")
        self.window, self.fallback, self.threshold = window, fallback, threshold
        self.streak = 0
        self.tripped = False

    def observe(self, accept_length: float) -> Action:
        """Record one step's mean accept length; returns what to do now."""
        if accept_length is None or math.isnan(accept_length):
            raise ValueError(f"accept length must be a number, got {accept_length!r}")
        if accept_length > self.threshold:
            if self.tripped:
                logger.info("speculative acceptance recovered (accept length %.3f)", accept_length)
            self.streak, self.tripped = 0, False
            return Action.OK
        self.streak += 1
        if self.streak < self.window:
            return Action.OK
        if not self.tripped:
            self.tripped = True
            logger.warning(
                "speculative acceptance collapsed: accept length <= %.2f for %d consecutive steps (last %.3f); "
                "the draft is probably stale or lost (check the draft weight sync)%s", self.threshold, self.streak,
                accept_length, "; falling back to autoregressive decoding" if self.fallback else "")
        return Action.FALLBACK if self.fallback else Action.WARN

    def reset(self) -> None:
        """Forget the streak (e.g. after re-pushing the draft)."""
        self.streak, self.tripped = 0, False
