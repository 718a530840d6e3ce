"""The adaptive controller's pure cost model: expected tokens of a draft from acceptance per position.

Functions of numbers only (acceptance rates, lengths, batch sizes); the controller
(:mod:`megatron_spec.rollout.native.adaptive`) combines them with the step costs it measures.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens(alpha: Sequence[float], k: int, limit: int | None = None) -> float:
    """``1 + sum_{i<=k'} prod_{j<=i} alpha[j]`` with ``k' = min(k, limit)`` (a proposal shorter
    than k drafts only ``limit`` tokens)."""
    k = k if limit is None else min(k, limit)
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alpha[i]
        total += run
    return total


def tree_expected_tokens(
    main: Sequence[float], k: int, hist: Sequence[float] | None, limit: int, m: int
) -> float:
    """``1 + sum_j (1 - (1 - PA_j)(1 - PB_j))`` for a tree row: PA_j the main branch's chance to accept
    j drafts (j <= k), PB_j the history branch's chance to match j tokens (j <= min(m, limit))."""
    if hist is None or not limit or not m:
        return expected_tokens(main, k)
    m = min(m, limit)
    total, pa, pb = 1.0, 1.0, 1.0
    for j in range(max(k, m)):
        pa = pa * main[j] if j < k else 0.0
        pb = pb * hist[j] if j < m else 0.0
        total += pa + pb - pa * pb
    return total


def size_class(b: int) -> int:
    """The batch-size class a calibration is kept per: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return b.bit_length()
