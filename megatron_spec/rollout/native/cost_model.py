"""The adaptive controller's pure cost model: the tokens a step is expected to emit, and its rate.

Speculation pays ``E(k) / T(B, k)`` tokens per second for a batch of B rows drafting k tokens:

* ``E_b(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_b[j]`` expected tokens emitted by row b, with
  ``alpha_b[j]`` the probability that draft j is accepted given drafts 1..j-1 were (acceptance per
  position, Leviathan et al. 2023, sec. 3.1, generalised from one alpha to one per position);
* ``T(B, k) = V(B * (k+1)) + P_k(B)``: the step's time, V the target forward + verification +
  host work of ``B * (k+1)`` tokens, ``P_k`` the main drafter's proposal of k tokens over B rows
  (k = 0: a plain step, ``V(B)``).

Three kinds of step are priced (a row's draft sources are its :class:`DraftOption` list, the main
drafter's first, the history's proposal second where it has one):

* every row drafts k tokens from its better source (:func:`all_rows_rates`);
* only the rows with a history proposal draft, up to k of it, and the main drafter does not run:
  ``T = V(B + sum_b min(k, n_b))`` (the verify forward runs packed: each row its last token and its own
  proposal of n_b tokens), the other rows emit one token (:func:`history_rows_rates`); a packed forward
  runs the Python layers and is priced as an unpacked one of as many tokens times ``packed_ratio``;
* a *tree*: every row drafts k tokens from the main drafter and the rows with a history proposal carry
  up to m of it as a second branch of the same verify, ``T = V(B * (1+k+m)) + P_k(B)``. A tree row emits
  ``1 + max(a, n)`` tokens, a the main branch's accepted drafts and n the history's matching ones,
  estimated as ``E = 1 + sum_j P(a >= j or n >= j)`` with the two independent
  (``1 - (1 - PA_j)(1 - PB_j)``), the drafted part then scaled by a calibration the controller learns
  (:func:`tree_rows_rates`).

Functions of numbers only (acceptance rates, lengths, batch sizes, and the measured costs passed in as
functions of a size); the controller (:mod:`megatron_spec.rollout.native.adaptive`) measures the costs
and chooses among the rates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

Seconds = Callable[[int], "float | None"]
"""A measured cost as a function of a size (tokens of a verify, rows of a proposal); None: no estimate."""


class DraftOption(NamedTuple):
    """One draft source of one row."""

    alpha: Sequence[float]
    """Acceptance per position."""
    limit: int | None = None
    """The proposal's length (None: any k, the main drafter)."""


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


def all_rows_rates(
    options: Sequence[Sequence[DraftOption]], ks: range, step_seconds: Callable[[int, int], float | None]
) -> dict[int, float]:
    """Tokens per second for every k in ``ks`` with a cost, every row drafting from its best source at
    that k: ``sum_b max_o E_o(k) / T(B, k)``, ``step_seconds(B, k)`` the step's time."""
    b = len(options)
    seconds = {k: t for k in ks if (t := step_seconds(b, k)) is not None}
    if not seconds:
        return {}
    top = max(seconds)
    totals = dict.fromkeys(seconds, 0.0)
    for opts in options:  # each option's E(0..top) in one pass: the same sums as expected_tokens, in order
        best = expected_tokens_upto(opts[0].alpha, top, opts[0].limit)
        for o in opts[1:]:
            best = [max(x, y) for x, y in zip(best, expected_tokens_upto(o.alpha, top, o.limit))]
        for k in totals:
            totals[k] += best[k]
    return {k: totals[k] / seconds[k] for k in seconds}


def expected_tokens_upto(alpha: Sequence[float], k_max: int, limit: int | None = None) -> list[float]:
    """``[expected_tokens(alpha, k, limit) for k in 0..k_max]`` in one pass (the same floating-point sums)."""
    n = k_max if limit is None else min(k_max, limit)
    out, total, run = [1.0], 1.0, 1.0
    for i in range(n):
        run *= alpha[i]
        total += run
        out.append(total)
    return out + [total] * (k_max - n)


def history_rows_rates(
    options: Sequence[Sequence[DraftOption]], k_max: int, verify_seconds: Seconds, packed_ratio: float
) -> dict[int, float]:
    """Tokens per second for every k in ``1..k_max`` when only the rows with a history proposal
    (``options[b][1]``) draft: they emit its expected tokens, the others one; the step costs the verify
    of ``B + sum_b min(k, n_b)`` tokens, times ``packed_ratio`` where rows draft different lengths.
    Empty when no row has a history proposal."""
    hist = [opts[1] if len(opts) > 1 else None for opts in options]
    if not any(hist):
        return {}
    b = len(options)
    out = {}
    for k in range(1, k_max + 1):
        t = verify_seconds(b + sum(min(k, h.limit or k) for h in hist if h))
        if t is not None and not all(h and (h.limit or k) >= k for h in hist):
            t *= packed_ratio  # packed: the rows without a proposal run their last token only
        if t is not None:
            out[k] = sum(expected_tokens(h.alpha, k, h.limit) if h else 1.0 for h in hist) / t
    return out


def tree_tokens(
    options: Sequence[Sequence[DraftOption]], k_main: int, k_tree: int, calibration: float = 1.0
) -> np.ndarray:
    """``[k_main, k_tree]``: the batch's expected tokens of a tree step drafting k from the main drafter
    and up to m from the history (vectorised over ``B x k x m x positions``); a row without a history
    proposal drafts its main branch alone; ``calibration`` scales the tree rows' drafted part."""
    b, kk, mm = len(options), k_main, k_tree
    depth = max(kk, mm)
    pa = np.zeros((b, depth))  # P(the main branch accepts >= j + 1 drafts)
    pb = np.zeros((b, depth))  # P(the history branch matches >= j + 1 tokens)
    lim = np.zeros(b, dtype=np.int64)
    for i, opts in enumerate(options):
        pa[i, :kk] = np.cumprod(np.asarray(opts[0].alpha[:kk], dtype=np.float64))
        if len(opts) > 1:
            n = min(opts[1].limit or mm, mm)
            pb[i, :n] = np.cumprod(np.asarray(opts[1].alpha[:n], dtype=np.float64))
            lim[i] = n
    j = np.arange(depth)
    ka = (j[None, :] < np.arange(1, kk + 1)[:, None]).astype(np.float64)  # [k, depth]
    mb = (j[None, :] < np.arange(1, mm + 1)[:, None]).astype(np.float64)  # [m, depth]
    a = pa[:, None, None, :] * ka[None, :, None, :]  # [B, k, 1, depth]
    h = pb[:, None, None, :] * mb[None, None, :, :]  # [B, 1, m, depth]
    union = (a + h - a * h).sum(-1)  # [B, k, m]
    main_only = (pa[:, None, :] * ka[None]).sum(-1)  # [B, k]
    drafted = np.where((lim > 0)[:, None, None], calibration * union, main_only[:, :, None])
    return (1.0 + drafted).sum(0)  # [k, m]


def tree_rows_rates(
    options: Sequence[Sequence[DraftOption]], k_main: int, k_tree: int, calibration: float,
    verify_seconds: Seconds, proposal_seconds: Callable[[int, int], float | None],
) -> dict[tuple[int, int], float]:
    """Tokens per second of a tree step for every (k, m), k in ``1..k_main``, m in ``1..k_tree``:
    :func:`tree_tokens` over ``V(B (1+k+m)) + P_k(B)``. Empty without a tree or a history proposal."""
    if not k_tree or not any(len(opts) > 1 for opts in options):
        return {}
    b = len(options)
    tokens = tree_tokens(options, k_main, k_tree, calibration)
    out = {}
    for k in range(1, k_main + 1):
        whole = proposal_seconds(b, k)
        if whole is None:
            continue
        for m in range(1, k_tree + 1):
            t = verify_seconds(b * (1 + k + m))
            if t is not None:
                out[(k, m)] = float(tokens[k - 1, m - 1]) / (t + whole)
    return out


def token_threshold(plain_s: float | None, double_s: float | None) -> float | None:
    """The probability of being reached and accepted above which one more drafted token per row pays:
    what a verify of twice the tokens costs more (``double_s``, each extra token ``(T(2b) - T(b)) / b``)
    over a plain step (``plain_s``, each row's token ``T(b) / b``), in [0, 1]. Near 1 compute-bound (a
    large batch on a CPU), near 0 memory-bound (few rows)."""
    if not plain_s or double_s is None:
        return None
    return min(1.0, max(0.0, (double_s - plain_s) / plain_s))


def size_class(b: int) -> int:
    """The batch-size class a calibration is kept per: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return b.bit_length()
