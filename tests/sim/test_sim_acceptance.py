"""Acceptance profiles: tau = 1 + sum of marginal rates; constructors and their errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_spec.sim.acceptance import AcceptanceProfile, geometric_accept_length


def test_accept_length_is_one_plus_marginal_rates():
    p = AcceptanceProfile.from_rates([0.8, 0.6, 0.3])
    assert p.accept_length(3) == pytest.approx(1 + 0.8 + 0.6 + 0.3)
    assert p.accept_length(1) == pytest.approx(1.8)
    # alpha = 0.5, k = 3: 1 + 0.5 + 0.25 + 0.125
    assert geometric_accept_length(0.5, 3) == pytest.approx(1.875)


def test_extrapolation_uses_last_conditional_rate():
    p = AcceptanceProfile.from_rates([0.8, 0.4])
    assert p.marginal(4) == pytest.approx([0.8, 0.4, 0.2, 0.1])  # ratio 0.4 / 0.8
    assert p.extrapolated(4) and not p.extrapolated(2)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 12), frac=st.floats(0.0, 1.0))
def test_from_accept_length_round_trips(k, frac):
    tau = 1.0 + frac * k
    p = AcceptanceProfile.from_accept_length(tau, k)
    assert p.accept_length(k) == pytest.approx(tau, abs=1e-9)


@pytest.mark.parametrize("tau, k, match", [
    (4.5, 3, r"impossible with k=3 draft tokens: it must be in \[1, k\+1\]"),
    (0.5, 3, "impossible"),
    (2.0, 0, "k=0 must be >= 1"),
])
def test_impossible_accept_lengths(tau, k, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceProfile.from_accept_length(tau, k)


@pytest.mark.parametrize("rates, match", [
    ([1.2, 0.5], r"position 1 is 1.2, outside \[0, 1\]"),
    ([0.5, -0.1], r"position 2 is -0.1, outside \[0, 1\]"),
    ([0.4, 0.6], "must not increase"),
    ([], "at least one"),
])
def test_bad_rates(rates, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceProfile.from_rates(rates)
