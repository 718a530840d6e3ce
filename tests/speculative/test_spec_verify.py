"""verify_chain API: greedy == argmax decoding, ragged chains, hand-computed cases, errors, randomness."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_spec.ops import verify_chain_reference
from megatron_spec.speculative import (
    SamplingTensors,
    acceptance_probability,
    expected_num_accepted,
    process_logits,
    sample_from_logprobs,
    verify_chain,
)

NEG_INF = float("-inf")


def greedy_lp(logits: torch.Tensor) -> torch.Tensor:
    return process_logits(logits, SamplingTensors.from_values([0.0] * logits.shape[0]))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("impl", ["public", "reference"])
def test_greedy_equals_argmax_decoding(seed, impl):
    """Markov-1 target: argmax decoding vs drafts that follow it with random corruptions."""
    g = torch.Generator().manual_seed(seed)
    V, B, k = [5, 17, 300, 1000][seed % 4], 64, [1, 3, 5, 8][seed % 4]
    # integer logits make ties common: argmax must take the lowest index
    table = torch.randint(-3, 3, (V + 1, V), generator=g).float()  # row 0: start, row 1 + a: after a
    start = torch.zeros(B, dtype=torch.int64)
    # argmax decoding, k + 1 steps from the start row
    ar = []
    cur_row = start
    for _ in range(k + 1):
        t = table[cur_row].argmax(-1)
        ar.append(t)
        cur_row = t + 1
    ar = torch.stack(ar, 1)  # [B, k+1]
    # drafts: the argmax chain with a random corruption after a random number of correct tokens
    n_good = torch.randint(0, k + 1, (B,), generator=g)
    drafts = ar[:, :k].clone()
    for b in range(B):
        if n_good[b] < k:
            wrong = (
                (ar[b, n_good[b]] + 1 + torch.randint(0, V - 1, (1,), generator=g)) % V if V > 1 else ar[b, 0]
            )
            drafts[b, n_good[b]] = wrong
    # target log-probs along the drafted prefix (what the verifier sees)
    rows = torch.cat([start[:, None], drafts + 1], 1)  # [B, k+1]
    lp = greedy_lp(table[rows].reshape(-1, V)).reshape(B, k + 1, V)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)  # ignored by greedy rows
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    greedy = torch.ones(B, dtype=torch.bool)
    if impl == "public":
        r = verify_chain(lp, drafts, q, greedy=greedy, u_accept=ua, u_sample=us)
        tokens, n_acc = r.tokens, r.num_accepted
    else:
        tokens, n_acc = verify_chain_reference(lp, drafts, q, None, greedy, ua, us)
    expect_acc = torch.where(n_good < k, n_good, torch.full_like(n_good, k))
    assert torch.equal(n_acc, expect_acc)
    for b in range(B):
        m = int(n_acc[b]) + 1
        assert tokens[b, :m].tolist() == ar[b, :m].tolist(), f"row {b}"
        assert (tokens[b, m:] == -1).all()


def test_greedy_ignores_uniforms_and_draft_probs():
    g = torch.Generator().manual_seed(1)
    lp = greedy_lp(torch.randn(40, 50, generator=g)).reshape(10, 4, 50)
    x = torch.randint(0, 50, (10, 3), generator=g)
    x[:, 0] = lp[:, 0].argmax(-1)
    greedy = torch.ones(10, dtype=torch.bool)
    outs = [
        verify_chain(lp, x, q, greedy=greedy, generator=torch.Generator().manual_seed(s)).tokens
        for s, q in [(0, None), (1, torch.rand(10, 3, 50)), (2, torch.softmax(torch.randn(10, 3, 50), -1))]
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_hand_computed_accept_and_residual():
    # V = 2, k = 1. p_0 = [0.25, 0.75], q_0 = [0.5, 0.5], draft x_0 = 0.
    # accept with min(1, p/q) = 0.5: u = 0.49 accepts, u = 0.51 rejects.
    # residual max(0, p - q) = [0, 0.25] -> always token 1. Bonus from p_1 = [1, 0] -> token 0.
    lp = torch.log(torch.tensor([[[0.25, 0.75], [1.0, 0.0]]] * 2))
    x = torch.tensor([[0], [0]])
    q = torch.tensor([[[0.5, 0.5]]] * 2)
    r = verify_chain(lp, x, q, u_accept=torch.tensor([[0.49], [0.51]], dtype=torch.float64),
                     u_sample=torch.tensor([0.9, 0.0], dtype=torch.float64))
    assert r.tokens.tolist() == [[0, 0], [1, -1]]
    assert r.num_accepted.tolist() == [1, 0]
    assert r.num_emitted.tolist() == [2, 1]
    torch.testing.assert_close(r.logprobs, torch.tensor([[math.log(0.25), 0.0], [math.log(0.75), 0.0]]))
    assert r.emitted() == [[0, 0], [1]]


def test_point_mass_accepts_with_p_and_excludes_draft_on_rejection():
    # p = [0.2, 0.3, 0.5], draft 2 (no q): accept with p(2) = 0.5; on rejection sample
    # p without token 2 renormalised = [0.4, 0.6]: u_sample 0.39 -> 0, 0.41 -> 1.
    lp = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]] * 3))
    x = torch.tensor([[2]] * 3)
    r = verify_chain(lp, x, None, u_accept=torch.tensor([[0.49], [0.51], [0.51]], dtype=torch.float64),
                     u_sample=torch.tensor([0.1, 0.39, 0.41], dtype=torch.float64))
    assert r.num_accepted.tolist() == [1, 0, 0]
    assert r.tokens[:, 0].tolist() == [2, 0, 1]


def test_q_zero_where_p_positive_accepts_and_p_zero_rejects():
    lp = torch.log(torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]] * 2))
    q = torch.tensor([[[0.0, 0.5, 0.5]]] * 2)
    r = verify_chain(lp, torch.tensor([[0], [2]]), q,
                     u_accept=torch.full((2, 1), 0.999, dtype=torch.float64),
                     u_sample=torch.zeros(2, dtype=torch.float64))
    # draft 0 has q = 0 < p: accepted whatever u; draft 2 has p = 0: rejected, residual [0.5, 0, 0]
    assert r.tokens.tolist() == [[0, 0], [0, -1]]


def test_reduced_draft_vocab_through_d2t():
    # target V = 4, draft vocabulary = target ids [1, 3]: d2t = [1, 2]
    d2t = torch.tensor([1, 2])
    lp = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25] * 4]]))
    q = torch.tensor([[[0.2, 0.8]]])  # q over target = [0, 0.2, 0, 0.8]
    # draft target id 3: p/q = 0.5 -> u = 0.6 rejects; residual = [0.1, 0.0, 0.3, 0.0] -> u_s 0.5 -> id 2
    r = verify_chain(lp, torch.tensor([[3]]), q, d2t=d2t,
                     u_accept=torch.tensor([[0.6]], dtype=torch.float64),
                     u_sample=torch.tensor([0.5], dtype=torch.float64))
    assert r.tokens.tolist() == [[2, -1]]
    # a draft outside the draft vocabulary has q = 0: accepted
    r = verify_chain(lp, torch.tensor([[2]]), q, d2t=d2t,
                     u_accept=torch.tensor([[0.99]], dtype=torch.float64),
                     u_sample=torch.tensor([0.0], dtype=torch.float64))
    assert r.num_accepted.tolist() == [1]


def test_ragged_chains_end_at_negative_ids():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 4, 6, generator=g), -1)
    x = torch.tensor([[1, 2, 3], [4, -1, 5], [-1, 0, 0]])
    r = verify_chain(lp, x, None, u_accept=torch.zeros(3, 3, dtype=torch.float64),
                     u_sample=torch.full((3,), 0.5, dtype=torch.float64))
    # u_accept = 0 accepts any draft with p > 0: row 0 takes all 3 + bonus, row 1 stops at the hole
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert (r.tokens[1, 2:] == -1).all() and (r.tokens[2, 1:] == -1).all()
    # the token at an empty slot is a plain draw from p at that position (no residual)
    plain = sample_from_logprobs(lp[2:3, 0], u=torch.tensor([0.5], dtype=torch.float64))
    assert r.tokens[2, 0] == plain[0]


def test_generator_is_reproducible_and_exclusive_with_uniforms():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(8, 3, 20, generator=g), -1)
    x = torch.randint(0, 20, (8, 2), generator=g)
    a = verify_chain(lp, x, generator=torch.Generator().manual_seed(5)).tokens
    b = verify_chain(lp, x, generator=torch.Generator().manual_seed(5)).tokens
    assert torch.equal(a, b)
    # the generator draws u_accept then u_sample, in that order
    g2 = torch.Generator().manual_seed(5)
    ua = torch.rand(8, 2, dtype=torch.float64, generator=g2)
    us = torch.rand(8, dtype=torch.float64, generator=g2)
    assert torch.equal(verify_chain(lp, x, u_accept=ua, u_sample=us).tokens, a)
    with pytest.raises(ValueError, match="explicit"):
        verify_chain(lp, x)
    with pytest.raises(ValueError, match="not both"):
        verify_chain(lp, x, u_accept=ua, u_sample=us, generator=g2)
    with pytest.raises(ValueError, match="both"):
        verify_chain(lp, x, u_accept=ua)


@pytest.mark.parametrize("impl", ["public", "reference"])
def test_errors_name_the_bad_input(impl):
    def call(lp, x, q=None, d2t=None, ua=None, us=None):
        B, K1, _ = lp.shape
        ua = torch.zeros(B, K1 - 1, dtype=torch.float64) if ua is None else ua
        us = torch.zeros(B, dtype=torch.float64) if us is None else us
        greedy = torch.zeros(B, dtype=torch.bool)
        if impl == "public":
            return verify_chain(lp, x, q, d2t=d2t, greedy=greedy, u_accept=ua, u_sample=us)
        return verify_chain_reference(lp, x, q, d2t, greedy, ua, us)

    lp = torch.log_softmax(torch.randn(2, 3, 5), -1)
    x = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(IndexError, match=r"draft_tokens\[1, 0\] = 7"):
        call(lp, torch.tensor([[0, 1], [7, 3]]))
    with pytest.raises(ValueError, match="u_accept"):
        call(lp, x, ua=torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="u_sample"):
        call(lp, x, us=torch.tensor([0.1, -0.1], dtype=torch.float64))
    with pytest.raises(ValueError, match="draft_probs"):
        call(lp, x, q=torch.rand(2, 2, 4))
    with pytest.raises(ValueError, match="same target id"):
        call(lp, x, q=torch.rand(2, 2, 2), d2t=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        call(lp, x, q=torch.rand(2, 2, 2), d2t=torch.tensor([0, 9]))
    dead = lp.clone()
    dead[1, 0] = NEG_INF
    with pytest.raises(ValueError, match="no probability mass"):
        call(dead, torch.full((2, 2), -1))


def test_sample_from_logprobs_matches_inverse_cdf_and_greedy():
    lp = torch.log(torch.tensor([[0.1, 0.2, 0.7]] * 4))
    u = torch.tensor([0.05, 0.15, 0.35, 0.99], dtype=torch.float64)
    assert sample_from_logprobs(lp, u=u).tolist() == [0, 1, 2, 2]
    greedy = torch.tensor([True, False, True, False])
    assert sample_from_logprobs(lp, greedy, u=u).tolist() == [2, 1, 2, 2]


def test_analytic_acceptance_helpers():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    alpha = acceptance_probability(p, q)
    assert alpha.tolist() == [0.5, 0.5]
    # 0.5 + 0.5 * 0.5
    assert expected_num_accepted(alpha).item() == pytest.approx(0.75)


def test_empty_batch_and_k_zero():
    r = verify_chain(torch.zeros(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64), generator=torch.Generator())
    assert r.tokens.shape == (0, 3) and r.num_accepted.shape == (0,)
    lp = torch.log_softmax(torch.randn(4, 1, 7), -1)
    r = verify_chain(lp, torch.zeros(4, 0, dtype=torch.int64), generator=torch.Generator().manual_seed(0))
    assert r.tokens.shape == (4, 1) and (r.num_accepted == 0).all() and (r.tokens >= 0).all()


def test_raw_logits_are_refused_by_the_public_api():
    """Issue 18: logits passed where log-probs belong accepted nearly every draft before."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 50, generator=g) * 3
    x = torch.randint(0, 50, (4, 2), generator=g)
    with pytest.raises(ValueError, match="not a log-probability|not normalised"):
        verify_chain(logits, x, generator=g)
    with pytest.raises(ValueError, match="not normalised"):
        sample_from_logprobs(logits[:, 0], generator=g)
    with pytest.raises(ValueError, match=r"contains NaN \(greedy row\)"):
        sample_from_logprobs(torch.full((2, 5), float("nan")), torch.ones(2, dtype=torch.bool), generator=g)
    lp = torch.log_softmax(logits, -1)
    assert verify_chain(lp, x, generator=g).tokens.shape == (4, 3)
