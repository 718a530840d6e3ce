"""Acceptance profiles: how many drafted tokens a verify step keeps, per draft position.

A profile is the list of *marginal* per-position acceptance rates a_1 >= a_2 >= ... : a_i is the
fraction of verify steps in which draft position i was accepted (what ``megatron-spec generate``
reports as ``accept_rate_per_position`` and the trainer logs as ``spec/accept_rate_pos{i}``).
The mean accept length of a chain draft of k tokens is then

    tau(k) = 1 + sum_{i<=k} a_i          (the +1 is the token the verifier always emits)

(Leviathan et al. 2023, eq. 1, for the geometric case a_i = alpha^i).

Two constructors: from measured rates, or from one mean accept length ``tau`` at a given k, in
which case a geometric profile a_i = alpha^i with tau(k; alpha) = tau is assumed. Positions
beyond the measured ones are extrapolated with the last conditional rate a_m / a_{m-1}
(flagged by :meth:`AcceptanceProfile.extrapolated`).

What it does not know: tree drafts (top-k > 1), per-sequence variance of acceptance, drift of
acceptance during training.
"""

from __future__ import annotations

from dataclasses import dataclass

from scipy.optimize import brentq


def geometric_accept_length(alpha: float, k: int) -> float:
    """tau(k) = 1 + alpha + ... + alpha^k."""
    return float(sum(alpha ** i for i in range(k + 1)))


@dataclass(frozen=True)
class AcceptanceProfile:
    """Marginal acceptance rates per draft position (see module docstring)."""

    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("acceptance profile needs at least one per-position rate")
        for i, a in enumerate(self.rates, 1):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"accept rate for position {i} is {a}, outside [0, 1]")
        for i in range(1, len(self.rates)):
            if self.rates[i] > self.rates[i - 1] + 1e-9:
                raise ValueError(
                    f"accept rates must not increase with position (marginal rates: accepting "
                    f"position {i + 1} needs position {i} accepted), got {self.rates[i - 1]} then "
                    f"{self.rates[i]}")

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_rates(cls, rates: list[float] | tuple[float, ...]) -> AcceptanceProfile:
        return cls(tuple(float(a) for a in rates))

    @classmethod
    def geometric(cls, alpha: float, positions: int) -> AcceptanceProfile:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"geometric acceptance alpha={alpha} outside [0, 1]")
        return cls(tuple(alpha ** i for i in range(1, positions + 1)))

    @classmethod
    def from_accept_length(cls, tau: float, k: int) -> AcceptanceProfile:
        """The geometric profile whose mean accept length at ``k`` draft tokens is ``tau``."""
        if k < 1:
            raise ValueError(f"num_draft_tokens k={k} must be >= 1")
        if not 1.0 <= tau <= k + 1:
            raise ValueError(f"accept length {tau} is impossible with k={k} draft tokens: it must be "
                             f"in [1, k+1] = [1, {k + 1}]")
        if tau >= k + 1 - 1e-12:
            alpha = 1.0
        elif tau <= 1.0 + 1e-12:
            alpha = 0.0
        else:
            alpha = brentq(lambda a: geometric_accept_length(a, k) - tau, 0.0, 1.0, xtol=1e-12)
        return cls.geometric(alpha, k)

    # ---- queries -----------------------------------------------------------------------------
    def extrapolated(self, k: int) -> bool:
        return k > len(self.rates)

    def marginal(self, k: int) -> list[float]:
        """a_1..a_k, extending past the measured positions with the last conditional rate."""
        if k < 1:
            raise ValueError(f"num_draft_tokens k={k} must be >= 1")
        out = list(self.rates[:k])
        if len(out) < k:
            last = self.rates[-1]
            ratio = last / self.rates[-2] if len(self.rates) >= 2 and self.rates[-2] > 0 else last
            while len(out) < k:
                out.append(out[-1] * ratio)
        return out

    def accept_length(self, k: int) -> float:
        """Mean tokens emitted per verify step with k draft tokens."""
        return 1.0 + sum(self.marginal(k))

    def describe(self, k: int) -> dict:
        return {"accept_length": self.accept_length(k), "accept_rates": self.marginal(k),
                "extrapolated": self.extrapolated(k)}
