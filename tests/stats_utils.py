"""Goodness-of-fit helpers for sampler tests (fixed seeds, tolerances derived from N).

``chi_square_pvalue`` merges cells whose expected count is below 5 into one (the usual
validity rule). ``tv_bound(K, N, delta)`` bounds the total variation between an empirical
distribution of N draws over K cells and the true one, with probability >= 1 - delta:
E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt(K / N) (Cauchy-Schwarz), and TV is
1/N-Lipschitz in each draw, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping

from scipy import stats


def chi_square_pvalue(
    counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], min_expected: float = 5.0
) -> float:
    n = sum(counts.values())
    outside = sum(c for key, c in counts.items() if probs.get(key, 0.0) <= 0.0)
    if outside:
        return 0.0  # a sample where the target puts no mass: impossible under the null
    obs, exp = [], []
    rest_obs, rest_exp = 0, 0.0
    for key, p in probs.items():
        e = p * n
        if e < min_expected:
            rest_obs += counts.get(key, 0)
            rest_exp += e
        else:
            obs.append(counts.get(key, 0))
            exp.append(e)
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    if len(obs) < 2:
        return 1.0
    scale = sum(obs) / sum(exp)
    return float(stats.chisquare(obs, [e * scale for e in exp]).pvalue)


def total_variation(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float]) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def tv_bound(num_cells: int, n: int, delta: float = 1e-3) -> float:
    return 0.5 * math.sqrt(num_cells / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical(samples) -> Counter:
    return Counter(samples)
