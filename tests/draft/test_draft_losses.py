"""Draft losses, with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_spec.draft.losses import (
    acceptance_rows,
    acceptance_sum,
    chain_acceptance_rows,
    hard_cross_entropy_sum,
    soft_cross_entropy_sum,
    top1_agreement_sum,
    ttt_step_weights,
    ttt_valid_rows,
    tv_loss_rows,
    tv_loss_sum,
)


def test_soft_ce_full_teacher_is_cross_entropy():
    # p = (0.5, 0.5), q = (0.25, 0.75): -(0.5 ln 0.25 + 0.5 ln 0.75) = 0.5 (1.3863 + 0.2877) = 0.8370
    logq = torch.log(torch.tensor([[0.25, 0.75]]))
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    loss, n = soft_cross_entropy_sum(logq, logp, torch.tensor([True]))
    assert n == 1
    assert loss.item() == pytest.approx(0.5 * (math.log(4) + math.log(4 / 3)), abs=1e-6)


def test_soft_ce_topk_keeps_the_rest_as_one_class():
    # top-2 teacher p = (0.5, 0.2), rest 0.3; draft q at those ids (0.4, 0.4), rest 0.2:
    # -(0.5 ln 0.4 + 0.2 ln 0.4 + 0.3 ln 0.2) = 0.7 * 0.9163 + 0.3 * 1.6094 = 1.1242
    logq = torch.log(torch.tensor([[0.4, 0.4]]))
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    loss, _ = soft_cross_entropy_sum(logq, logp, torch.tensor([True]))
    assert loss.item() == pytest.approx(0.7 * math.log(2.5) + 0.3 * math.log(5), abs=1e-6)


def test_soft_ce_topk_minimum_matches_teacher_mass_not_renormalised():
    # Over q = (a, b, rest), the loss is minimised at q = p = (0.5, 0.2, 0.3), not at (5/7, 2/7, 0).
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    z = torch.zeros(1, 3, requires_grad=True)  # logits of (id0, id1, rest)
    opt = torch.optim.SGD([z], lr=1.0)
    for _ in range(500):
        logq = torch.log_softmax(z, -1)[:, :2]
        loss, _ = soft_cross_entropy_sum(logq, logp, torch.tensor([True]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(
        torch.softmax(z, -1).detach(), torch.tensor([[0.5, 0.2, 0.3]]), atol=1e-3, rtol=0
    )


def test_masked_rows_contribute_nothing_even_if_nan():
    logq = torch.tensor([[0.0, float("nan")], [math.log(0.5), math.log(0.5)]])
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    loss, n = soft_cross_entropy_sum(logq, logp, torch.tensor([False, True]))
    assert n == 1 and loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_hard_ce_and_agreement():
    # -(ln 0.5 + ln 0.25) over the two unmasked rows = 0.6931 + 1.3863
    lq = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    loss, n = hard_cross_entropy_sum(lq, torch.tensor([True, True, False]))
    assert n == 2 and loss.item() == pytest.approx(math.log(2) + math.log(4), abs=1e-6)
    a = top1_agreement_sum(
        torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3]), torch.tensor([True, True, False])
    )
    assert a.item() == 1


def test_ttt_weights_and_valid_rows():
    assert ttt_step_weights(3, 0.9) == pytest.approx([1.0, 0.9, 0.81])
    with pytest.raises(ValueError):
        ttt_step_weights(0, 0.9)
    # segment lengths 3 and 1, padded to 3; step 1 scores rows q with 1 <= q < length
    v = ttt_valid_rows(torch.tensor([3, 1]), 3, 1)
    assert v.tolist() == [[False, True, True], [False, False, False]]


def test_acceptance_is_one_minus_total_variation():
    # p = (0.5, 0.3, 0.2), q = (0.2, 0.3, 0.5): sum min = 0.2 + 0.3 + 0.2 = 0.7 = 1 - TV (TV = 0.3)
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    logq = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]]))
    assert acceptance_rows(logq, logp).tolist() == pytest.approx([0.7, 1.0], abs=1e-6)
    total, n = acceptance_sum(logq, logp, torch.tensor([True, False]))
    assert n == 1 and total.item() == pytest.approx(0.7, abs=1e-6)
    # top-2 teacher p = (0.5, 0.2), rest 0.3; q there (0.4, 0.1), rest 0.5: 0.4 + 0.1 + min(0.3, 0.5) = 0.8
    a = acceptance_rows(torch.log(torch.tensor([0.4, 0.1])), torch.log(torch.tensor([0.5, 0.2])))
    assert a.item() == pytest.approx(0.8, abs=1e-6)


def test_acceptance_against_the_target_not_the_renormalised_teacher():
    """With a reduced draft vocabulary the engine verifies a draft from ``Vd`` against the target's whole
    distribution: ``sum_{v in Vd} min(p(tid(v)), q(v))``. The renormalised teacher with its log mass gives
    exactly that (full teacher) or an upper bound no larger than the renormalised teacher alone (top-k)."""
    g = torch.Generator().manual_seed(1)
    p_full = torch.softmax(torch.randn(6, 20, generator=g) * 2, -1)  # the target over 20 ids
    tid = torch.tensor([3, 11, 0, 7, 15, 2, 9, 18])  # draft id -> target id
    logq = torch.log_softmax(torch.randn(6, 8, generator=g) * 2, -1)  # the draft over its 8 ids
    exact = torch.minimum(p_full[:, tid], logq.exp()).sum(-1)
    mass = p_full[:, tid].sum(-1)
    teacher = (p_full[:, tid] / mass.unsqueeze(-1)).log()
    torch.testing.assert_close(acceptance_rows(logq, teacher, mass.log()), exact)
    renormalised = acceptance_rows(logq, teacher)
    # what it overstated
    assert torch.all(renormalised >= exact - 1e-6) and torch.any(renormalised > exact + 1e-3)
    top_lp, top_ids = teacher.topk(3, dim=-1)
    bound = acceptance_rows(logq.gather(-1, top_ids), top_lp, mass.log())
    assert torch.all(bound >= exact - 1e-6)
    assert torch.all(bound <= acceptance_rows(logq.gather(-1, top_ids), top_lp) + 1e-6)


def test_tv_loss_is_the_acceptance_on_the_teachers_entries():
    """Full teacher: 1 - acceptance. Top-k teacher: the rest class is left out (only a lower bound on the
    acceptance is trained, which mass moved off the teacher's entries cannot raise). With the log mass the
    teacher is scaled to the target's own distribution, as the evaluation does."""
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    logq = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]]))
    assert tv_loss_rows(logq, logp).tolist() == pytest.approx([0.3, 0.0], abs=1e-6)
    assert tv_loss_sum(logq, logp, torch.tensor([True, False])).item() == pytest.approx(0.3, abs=1e-6)
    assert tv_loss_sum(logq, logp, torch.tensor([False, False])).item() == 0.0
    # top-2 teacher p = (0.5, 0.2), q there (0.4, 0.1): 1 - (0.4 + 0.1), the rest's min(0.3, 0.5) not counted
    top = tv_loss_rows(torch.log(torch.tensor([0.4, 0.1])), torch.log(torch.tensor([0.5, 0.2])))
    assert top.item() == pytest.approx(0.5, abs=1e-6)
    # a reduced vocabulary holding 0.8 of the target's mass: p = 0.8 * (0.5, 0.3, 0.2) = (0.4, 0.24, 0.16)
    scaled = tv_loss_rows(logq[:1], logp[:1], torch.log(torch.tensor([0.8])))
    assert scaled.item() == pytest.approx(1 - (0.2 + 0.24 + 0.16), abs=1e-6)
    g = torch.Generator().manual_seed(2)
    teacher = torch.log_softmax(torch.randn(5, 12, generator=g), -1)
    draft = torch.log_softmax(torch.randn(5, 12, generator=g), -1)
    mass = torch.rand(5, generator=g).clamp(min=0.3).log()
    torch.testing.assert_close(tv_loss_rows(draft, teacher, mass), 1 - acceptance_rows(draft, teacher, mass))


def test_chain_acceptance_length():
    # k = 2, one row of T = 3: alpha step 0 = (0.5, 0.9, 0.8), step 1 = (x, 0.6, 0.4)
    # chain from row 0: 1 + 0.5 + 0.5 * 0.6 = 1.8; from row 1: 1 + 0.9 + 0.9 * 0.4 = 2.26
    alpha = torch.tensor([[[0.5, 0.9, 0.8]], [[0.0, 0.6, 0.4]]])
    assert chain_acceptance_rows(alpha)[0].tolist() == pytest.approx([1.8, 2.26])
    assert chain_acceptance_rows(alpha[:, :, :1]).shape == (1, 0)
