"""Two-branch tree verification (``verify_tree``): the emitted tokens follow the target exactly.

A toy target and draft over a 5-token vocabulary give a distribution for every context (seeded by
the context). Each row drafts a first branch of k tokens from the draft (q known) and carries a
second, deterministic branch y (drawn beforehand from a third distribution, so it sometimes agrees
with the first branch, sometimes starts with the token the first branch was rejected at, and has
its own length, 0..m). After the tree step the row is completed by plain sampling from the
target; the joint of the first three tokens must be the target's.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from megatron_spec.speculative.verify import verify_tree
from tests.stats_utils import chi_square_pvalue, total_variation, tv_bound

V = 5


def dist(context: tuple[int, ...], salt: int, temperature: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + context) % (2 ** 31))
    return torch.softmax(torch.randn(V, generator=g) * 1.5 / temperature, -1)


def p(context):
    return dist(context, 1)


def q(context):
    return dist(context, 2)


def _tree_step(n: int, k: int, m: int, seed: int, greedy: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ctx0 = (0,)
    drafts = torch.zeros(n, k, dtype=torch.long)
    qs = torch.zeros(n, k, V)
    lp_a = torch.zeros(n, k + 1, V)
    ys = torch.full((n, m), -1, dtype=torch.long)
    lp_b = torch.zeros(n, m, V)
    for r in range(n):
        ctx = ctx0
        for j in range(k):
            qd = q(ctx)
            lp_a[r, j] = p(ctx).log()
            t = int(torch.multinomial(qd, 1, generator=gen))
            drafts[r, j], qs[r, j] = t, qd
            ctx = ctx + (t,)
        lp_a[r, k] = p(ctx).log()
        # y: its own length, from a distribution between p and q (agrees with both sometimes)
        length = int(torch.randint(0, m + 1, (1,), generator=gen))
        ctx = ctx0
        for j in range(length):
            t = int(torch.multinomial(0.5 * p(ctx) + 0.5 * dist(ctx, 3), 1, generator=gen))
            ys[r, j] = t
            ctx = ctx + (t,)
            lp_b[r, j] = p(ctx).log()
    g = torch.full((n,), greedy)
    res = verify_tree(lp_a, drafts, None if greedy else qs, lp_b, ys, greedy=g, generator=gen)
    return res, drafts, ys, gen


@pytest.mark.statistical
def test_tree_emits_the_target_distribution():
    n, k, m = 12000, 2, 3
    res, drafts, ys, gen = _tree_step(n, k, m, seed=7)
    emitted = [row[row >= 0].tolist() for row in res.tokens]
    assert all(len(e) == int(a) + 1 for e, a in zip(emitted, res.num_accepted))
    # every path occurred: first branch kept, second branch kept after agreeing, after a rejection
    assert bool(res.second.any()) and bool((~res.second).any())
    on_second = res.second & (res.tokens[:, 0] != drafts[:, 0])
    assert int(on_second.sum()) > 100  # the second branch won after the first draft was rejected
    assert bool((res.second_len[res.second] == res.num_accepted[res.second]).all())
    # complete to 3 tokens by plain sampling from the target
    counts = Counter()
    for e in emitted:
        seq = list(e[:3])
        while len(seq) < 3:
            seq.append(int(torch.multinomial(p((0,) + tuple(seq)), 1, generator=gen)))
        counts[tuple(seq)] += 1
    exact = {}
    for seq in itertools.product(range(V), repeat=3):
        pr, ctx = 1.0, (0,)
        for t in seq:
            pr *= float(p(ctx)[t])
            ctx = ctx + (t,)
        exact[seq] = pr
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert total_variation(counts, exact) < tv_bound(len(exact), n)
    # the tree emits more than the first branch alone would have on the same draws
    assert float(res.num_accepted.float().mean()) > 0


def test_tree_greedy_follows_the_argmax():
    res, _, _, _ = _tree_step(400, 2, 4, seed=3, greedy=True)
    for row, n in zip(res.tokens, res.num_accepted.tolist()):
        ctx = (0,)
        for t in row[:n + 1].tolist():
            assert t == int(p(ctx).argmax())
            ctx = ctx + (t,)
    assert bool(res.second.any())  # some rows went on along y


def test_tree_positions_point_at_the_logits_that_verified_each_token():
    res, drafts, ys, _ = _tree_step(600, 2, 4, seed=11)
    k = drafts.shape[1]
    for r in range(600):
        n = int(res.num_accepted[r]) + 1
        pos = res.positions[r, :n].tolist()
        if bool(res.second[r]):
            a = int(res.first_accepted[r])
            assert pos == list(range(a + 1)) + [k + j for j in range(a + 1, n)]
            assert res.tokens[r, : n - 1].tolist() == ys[r, : n - 1].tolist() and n - 1 == int(
                res.second_len[r]
            )
        else:
            assert pos == list(range(n))
            a = int(res.first_accepted[r])
            assert n == a + 1 and res.tokens[r, :a].tolist() == drafts[r, :a].tolist()
