"""Statistical proof that speculative verification samples the target's processed distribution.

Setting: a Markov-1 target over a small vocabulary (the distribution of the next token depends on the
previous one), processed by ``process_logits`` with a temperature and top-k / top-p / min-p, and a
draft ``q`` of one of several kinds. Drafts are sampled from ``q`` (mapped through ``d2t`` for a
reduced draft vocabulary), verified, and, where a step emitted a single token, generation continues
with a second step, exactly as an engine would. The first emitted token must follow ``P0`` and the
first two the joint ``P0(a) P1(b | a)``.

Acceptance criteria per histogram of N draws over the m cells of positive probability:
* no draw in a cell of probability 0 (the support is exact);
* chi-square goodness of fit, cells with expected count < 5 pooled: p-value > 1e-3;
* total variation TV = 1/2 sum |f_i - p_i| below
      bound(N, m) = 1/2 sqrt((m - 1) / N) + sqrt(ln(1/delta) / (2 N)),   delta = 1e-6.
  Derivation: E|f_i - p_i| <= sqrt(p_i (1 - p_i) / N), so by Cauchy-Schwarz
  E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt((m - 1) / N). TV is a function of N
  independent draws that changes by at most 1/N when one draw changes, so McDiarmid's inequality gives
  P(TV - E[TV] >= t) <= exp(-2 N t^2); t = sqrt(ln(1/delta) / (2N)) makes that delta.
Seeds are fixed, so each case is deterministic. Deliberately wrong samplers (below) fail the same
checks, which shows the checks can see the bugs they are meant to catch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from megatron_spec.ops import inverse_cdf_chunked, verify_chain_reference
from megatron_spec.speculative import SamplingTensors, expected_num_accepted, process_logits, verify_chain

pytestmark = pytest.mark.statistical

DELTA = 1e-6
P_MIN = 1e-3
N_DRAWS = 20000
K_DRAFT = 3

TEMPERATURES = [0.0, 0.7, 1.0, 1.5]
TRUNCATIONS = [
    {},
    {"top_k": 3},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"top_k": 5, "top_p": 0.9, "min_p": 0.05},
]
Q_KINDS = ["random", "zeros_where_p", "one_hot", "near_uniform", "equal_p", "point", "d2t"]
VOCABS = [4, 9, 16]


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def tv_bound(n: int, m: int) -> float:
    return 0.5 * math.sqrt(max(m - 1, 0) / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


@dataclass
class FitResult:
    ok: bool
    p_value: float
    tv: float
    bound: float
    outside_support: int

    def __str__(self) -> str:
        return (f"p={self.p_value:.3g} tv={self.tv:.4f} bound={self.bound:.4f} "
                f"outside_support={self.outside_support}")


def fit(counts: np.ndarray, probs: np.ndarray) -> FitResult:
    counts = counts.astype(np.float64).ravel()
    probs = probs.astype(np.float64).ravel()
    probs = probs / probs.sum()
    n = int(counts.sum())
    support = probs > 0
    outside = int(counts[~support].sum())
    obs = counts[support]
    expected = probs[support] * obs.sum()  # draws outside the support already fail above
    small = expected < 5
    if small.any():  # pool rare cells so the chi-square approximation holds
        expected = np.concatenate([expected[~small], [expected[small].sum()]])
        obs = np.concatenate([obs[~small], [obs[small].sum()]])
    p_value = 1.0 if len(expected) < 2 else float(stats.chisquare(obs, expected).pvalue)
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    bound = tv_bound(n, int(support.sum()))
    return FitResult(outside == 0 and p_value > P_MIN and tv < bound, p_value, tv, bound, outside)


# ---------------------------------------------------------------------------------------------
# Markov-1 target and drafts
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    V: int
    sampling: SamplingTensors  # one row
    lp0: torch.Tensor  # [V] processed target log-probs of the first token
    lp1: torch.Tensor  # [V, V] row a: processed target log-probs after token a
    q0: torch.Tensor | None  # [Vd] draft distribution of the first token (None: point mass)
    q1: torch.Tensor | None  # [V, Vd]
    d2t: torch.Tensor | None  # [Vd]
    lookup0: torch.Tensor  # point-mass proposals: first token
    lookup1: torch.Tensor  # [V] point-mass proposals after token a

    @property
    def greedy(self) -> bool:
        return bool(self.sampling.greedy[0])

    @property
    def draft_targets(self) -> torch.Tensor:  # [Vd] target id of each draft id
        Vd = self.q0.shape[0]
        return torch.arange(Vd) + (self.d2t if self.d2t is not None else 0)


def make_case(V: int, q_kind: str, temperature: float, trunc: dict, seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(V + 1, V, generator=g) * 2.0  # row 0: first token; row 1 + a: after token a
    holes = torch.rand(V + 1, V, generator=g) < 0.2  # p with zeros
    holes[torch.arange(V + 1), torch.randint(0, V, (V + 1,), generator=g)] = False
    raw = raw.masked_fill(holes, float("-inf"))
    s1 = SamplingTensors.from_values([temperature], **{k: [v] for k, v in trunc.items()})
    lp = process_logits(raw, s1.repeat_interleave(V + 1))  # [V+1, V]
    p = lp.exp()
    d2t = None
    if q_kind == "d2t":
        Vd = max(2, V // 2 + 1)
        tgt = torch.randperm(V, generator=g)[:Vd].sort().values
        d2t = tgt - torch.arange(Vd)
        q = torch.softmax(torch.randn(V + 1, Vd, generator=g) * 1.5, -1)
    elif q_kind == "random":
        q = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)
    elif q_kind == "zeros_where_p":  # q = 0 on about half of the tokens p supports
        q = torch.softmax(torch.randn(V + 1, V, generator=g), -1)
        kill = (torch.rand(V + 1, V, generator=g) < 0.5) & (p > 0)
        kill[torch.arange(V + 1), torch.randint(0, V, (V + 1,), generator=g)] = False
        q = q.masked_fill(kill, 0.0)
        q = q / q.sum(-1, keepdim=True)
    elif q_kind == "one_hot":
        q = torch.nn.functional.one_hot(torch.randint(0, V, (V + 1,), generator=g), V).float()
    elif q_kind == "near_uniform":
        q = torch.softmax(torch.randn(V + 1, V, generator=g) * 0.05, -1)
    elif q_kind == "equal_p":
        q = p.clone()
    elif q_kind == "point":
        q = None
    else:
        raise AssertionError(q_kind)
    lookup = torch.randint(0, V, (V + 1,), generator=g)
    return Case(V, s1, lp[0], lp[1:], None if q is None else q[0], None if q is None else q[1:], d2t,
                lookup[0], lookup[1:])


def draft_chain(case: Case, prev: torch.Tensor | None, n: int, k: int, g: torch.Generator):
    """Drafts, target log-probs and draft probs for n rows; prev [n] (None: first token of the text)."""
    lp_rows, q_rows, x_cols = [], [], []
    cur = prev
    for i in range(k + 1):
        lp_rows.append(case.lp0.expand(n, -1) if cur is None else case.lp1[cur])
        if i == k:
            break
        if case.q0 is None:
            x = case.lookup0.expand(n) if cur is None else case.lookup1[cur]
        else:
            qi = case.q0.expand(n, -1) if cur is None else case.q1[cur]
            q_rows.append(qi)
            x = case.draft_targets[torch.multinomial(qi, 1, generator=g)[:, 0]]
        x_cols.append(x)
        cur = x
    lp = torch.stack(lp_rows, 1).contiguous()  # [n, k+1, V]
    x = torch.stack(x_cols, 1) if k else torch.empty(n, 0, dtype=torch.int64)  # [n, k]
    q = torch.stack(q_rows, 1).contiguous() if q_rows else None  # [n, k, Vd]
    return lp, x, q


def run_public(lp, x, q, d2t, greedy, ua, us):
    r = verify_chain(lp, x, q, d2t=d2t, greedy=greedy, u_accept=ua, u_sample=us)
    return r.tokens


def run_reference(lp, x, q, d2t, greedy, ua, us):
    return verify_chain_reference(lp, x, q, d2t, greedy, ua, us)[0]


def first_two_tokens(case: Case, verify_fn, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    greedy = torch.full((n,), case.greedy)

    def step(prev, rows):
        lp, x, q = draft_chain(case, prev, rows, k, g)
        ua = torch.rand(rows, k, dtype=torch.float64, generator=g)
        us = torch.rand(rows, dtype=torch.float64, generator=g)
        tokens = verify_fn(lp, x, q, case.d2t, greedy[:rows], ua, us)
        return tokens, (tokens >= 0).sum(1)

    tokens, emitted = step(None, n)
    first = tokens[:, 0]
    second = tokens[:, 1].clone() if k else torch.full((n,), -1)
    more = (emitted < 2).nonzero()[:, 0]
    if more.numel():
        t2, _ = step(first[more], more.numel())
        second[more] = t2[:, 0]
    return first, second


def check_case(case: Case, verify_fn, n: int = N_DRAWS, k: int = K_DRAFT, seed: int = 0):
    first, second = first_two_tokens(case, verify_fn, n, k, seed)
    V = case.V
    p0 = case.lp0.double().exp()
    joint = p0[:, None] * case.lp1.double().exp()  # [V, V]
    assert (first >= 0).all() and (second >= 0).all()
    c1 = torch.bincount(first, minlength=V).numpy()
    c2 = torch.bincount(first * V + second, minlength=V * V).numpy()
    return fit(c1, p0.numpy()), fit(c2, joint.numpy())


GRID = [
    (V, kind, t, i % len(TRUNCATIONS))
    for i, (V, kind, t) in enumerate((V, kind, t) for V in VOCABS for kind in Q_KINDS for t in TEMPERATURES)
]


@pytest.mark.parametrize("V,q_kind,temperature,trunc_id", GRID)
def test_emitted_tokens_follow_processed_target(V, q_kind, temperature, trunc_id):
    seed = V * 1000 + Q_KINDS.index(q_kind) * 100 + TEMPERATURES.index(temperature) * 10 + trunc_id
    case = make_case(V, q_kind, temperature, TRUNCATIONS[trunc_id], seed)
    r1, r2 = check_case(case, run_public, seed=seed)
    assert r1.ok, f"first token: {r1}"
    assert r2.ok, f"first two tokens: {r2}"


@pytest.mark.parametrize("q_kind", ["random", "zeros_where_p", "point", "d2t"])
def test_reference_follows_processed_target(q_kind):
    case = make_case(9, q_kind, 1.0, {"top_p": 0.9}, seed=7)
    r1, r2 = check_case(case, run_reference, seed=11)
    assert r1.ok and r2.ok, f"{r1} / {r2}"


# ---------------------------------------------------------------------------------------------
# Teeth: textbook sampler with injectable bugs
# ---------------------------------------------------------------------------------------------
def textbook_sampler(bug: str | None):
    """Direct transcription of Leviathan et al. Algorithm 1 on dense q, with an optional bug."""

    def fn(lp, x, q, d2t, greedy, ua, us):
        n, K1, V = lp.shape
        k = K1 - 1
        p = lp.double().exp()  # [n, k+1, V]
        if q is None:
            qd = torch.nn.functional.one_hot(x, V).double()
        elif d2t is not None:
            qd = torch.zeros(n, k, V, dtype=torch.float64)
            qd[:, :, torch.arange(q.shape[-1]) + d2t] = q.double()
        else:
            qd = q.double()
        px = p[:, :k].gather(-1, x[..., None])[..., 0]
        qx = qd.gather(-1, x[..., None])[..., 0]
        if bug == "accept_with_p":
            a = px
        else:
            a = torch.where(qx > 0, torch.clamp(px / qx.clamp(min=1e-300), max=1.0), torch.ones_like(px))
        accept = ua < a
        j = torch.cumprod(accept.long(), 1).sum(1)  # [n]
        rows = torch.arange(n)
        pj = p[rows, j]
        qj = torch.where((j < k)[:, None], qd[rows, j.clamp(max=k - 1)], torch.zeros_like(pj))
        r = pj if bug == "residual_is_p" else (pj - qj).clamp(min=0)
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, pj)
        tok, _ = inverse_cdf_chunked(r, us)
        full = j == k
        if bug == "bonus_left_unset":
            tok = torch.where(full, torch.zeros_like(tok), tok)
        if bug == "bonus_not_emitted":
            tok = torch.where(full, torch.full_like(tok, -1), tok)
        pos = torch.arange(K1)[None]
        xp = torch.cat([x, torch.full((n, 1), -1)], 1)
        return torch.where(
            pos < j[:, None], xp, torch.where(pos == j[:, None], tok[:, None], torch.full_like(xp, -1))
        )

    return fn


def test_textbook_sampler_passes_so_the_harness_is_fair():
    case = make_case(9, "random", 1.0, {}, seed=3)
    r1, r2 = check_case(case, textbook_sampler(None), seed=5)
    assert r1.ok and r2.ok, f"{r1} / {r2}"


@pytest.mark.parametrize("bug", ["accept_with_p", "residual_is_p", "bonus_left_unset"])
def test_distribution_check_catches_wrong_samplers(bug):
    # k=1 so bonus tokens are frequent; a draft far from the target so acceptance matters.
    case = make_case(9, "random", 1.0, {}, seed=3)
    r1, r2 = check_case(case, textbook_sampler(bug), k=1, seed=5)
    assert not (r1.ok and r2.ok), f"the check missed {bug}: {r1} / {r2}"


# ---------------------------------------------------------------------------------------------
# Acceptance length = sum_i prod_{j<=i} alpha_j
# ---------------------------------------------------------------------------------------------
def iid_positions(kind: str, V: int, k: int, seed: int):
    """Per-position target / draft independent of earlier tokens: [k+1, V] log-probs, [k, Vd] q."""
    g = torch.Generator().manual_seed(seed)
    s = SamplingTensors.from_values([0.0 if kind == "greedy" else 0.8], top_p=[0.95])
    lp = process_logits(torch.randn(k + 1, V, generator=g) * 2, s.repeat_interleave(k + 1))
    d2t = None
    if kind in ("random", "greedy"):
        q = torch.softmax(torch.randn(k, V, generator=g), -1)
    elif kind == "zeros_where_p":
        q = torch.softmax(torch.randn(k, V, generator=g), -1) * (torch.rand(k, V, generator=g) < 0.5)
        q[:, 0] += 0.1
        q = q / q.sum(-1, keepdim=True)
    elif kind == "d2t":
        Vd = V // 2
        tgt = torch.randperm(V, generator=g)[:Vd].sort().values
        d2t = tgt - torch.arange(Vd)
        q = torch.softmax(torch.randn(k, Vd, generator=g), -1)
    elif kind == "point":
        q = None
    return lp, q, d2t


def accept_length_stats(kind: str, verify_fn, n: int = 40000, V: int = 12, k: int = 4, seed: int = 0):
    lp, q, d2t = iid_positions(kind, V, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    p = lp.double().exp()
    if q is None:
        x = torch.randint(0, V, (n, k), generator=g)  # an n-gram guess: any proposal, point mass
        alpha_rows = p[:k].T.gather(0, x).double()  # accept prob p_i(x_i) per row
        expected = torch.cumprod(alpha_rows, 1).sum(1).mean()
        qb = None
    else:
        Vd = q.shape[-1]
        tgt = torch.arange(Vd) + (d2t if d2t is not None else 0)
        x = tgt[torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)]
        q_t = torch.zeros(k, V, dtype=torch.float64)
        q_t[:, tgt] = q.double()
        if kind == "greedy":
            alpha = (q_t * (p[:k] == p[:k].amax(-1, keepdim=True))).sum(-1)  # draft hits the argmax
        else:
            alpha = torch.minimum(p[:k], q_t).sum(-1)
        expected = expected_num_accepted(alpha)
        qb = q.expand(n, -1, -1).contiguous()
    lpb = lp.expand(n, -1, -1).contiguous()
    greedy = torch.full((n,), kind == "greedy")
    ua = torch.rand(n, k, dtype=torch.float64, generator=g)
    us = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = verify_fn(lpb, x, qb, d2t, greedy, ua, us)
    emitted = (tokens >= 0).sum(1).double()
    return emitted, float(expected)


@pytest.mark.parametrize("kind", ["random", "zeros_where_p", "d2t", "point", "greedy"])
def test_mean_accept_length_matches_theory(kind):
    emitted, expected = accept_length_stats(kind, run_public)
    accepted = emitted - 1
    se = float(accepted.std()) / math.sqrt(len(accepted))
    # 5 standard errors: a false alarm has probability < 1e-6 (and seeds are fixed)
    assert abs(float(accepted.mean()) - expected) < 5 * se + 1e-12, (float(accepted.mean()), expected, se)


@pytest.mark.parametrize("bug", ["bonus_not_emitted", "accept_with_p"])
def test_length_check_catches_wrong_samplers(bug):
    # k=1: full acceptance (the bonus case) is frequent, as is the acceptance test itself.
    emitted, expected = accept_length_stats("random", textbook_sampler(bug), k=1)
    accepted_if_correct = emitted - 1
    se = float(emitted.std()) / math.sqrt(len(emitted))
    assert abs(float(accepted_if_correct.mean()) - expected) > 5 * se, f"the length check missed {bug}"


def test_forgotten_bonus_is_invisible_to_the_stream_test_but_not_to_the_length_test():
    # Dropping the bonus token keeps every emitted token correctly distributed (the next step samples
    # it instead), so only the accepted-length check can catch it: both facts are pinned here.
    case = make_case(9, "random", 1.0, {}, seed=3)
    r1, r2 = check_case(case, textbook_sampler("bonus_not_emitted"), k=1, seed=5)
    assert r1.ok and r2.ok
    test_length_check_catches_wrong_samplers("bonus_not_emitted")
