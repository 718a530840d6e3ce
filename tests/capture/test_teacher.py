"""The draft teacher and vocab-parallel log-prob helpers against full-vocabulary references (TP=1 here;
TP=2 agreement is checked under torchrun in tests/draft/test_draft_isolation.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.capture.teacher import (
    draft_vocab_log_mass,
    draft_vocab_teacher,
    log_mass_and_token_logprobs,
    vocab_parallel_argmax,
    vocab_parallel_log_softmax,
    vocab_parallel_logprobs_at,
)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 12, generator=g) * 3  # 12 columns: vocab 10 + 2 padded


def test_full_vocab_teacher_is_log_softmax_over_true_vocab(logits):
    ids, lp = draft_vocab_teacher(logits, vocab_size=10)
    assert ids is None
    torch.testing.assert_close(lp, torch.log_softmax(logits[:, :10], -1))


def test_reduced_vocab_teacher_renormalises_over_draft_ids(logits):
    target_ids = torch.tensor([7, 2, 9, 0])  # draft id i -> target id target_ids[i]
    _, full = draft_vocab_teacher(logits, vocab_size=10, target_ids=target_ids)
    ref = torch.log_softmax(logits[:, target_ids], -1)  # ModelOpt: softmax over the mapped logits
    torch.testing.assert_close(full, ref)
    ids, top = draft_vocab_teacher(logits, vocab_size=10, target_ids=target_ids, topk=2)
    want_lp, want_ids = ref.topk(2, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(top, want_lp)


def test_log_mass_is_the_targets_mass_on_the_draft_ids(logits):
    target_ids = torch.tensor([7, 2, 9, 0])
    want = torch.softmax(logits[:, :10].double(), -1)[:, target_ids].sum(-1).log()  # padded columns excluded
    torch.testing.assert_close(
        draft_vocab_log_mass(logits, vocab_size=10, target_ids=target_ids).double(), want
    )
    assert torch.equal(draft_vocab_log_mass(logits, vocab_size=10), torch.zeros(5))  # the full vocabulary
    every = draft_vocab_log_mass(logits, vocab_size=10, target_ids=torch.arange(10))
    torch.testing.assert_close(every, torch.zeros(5), atol=1e-6, rtol=0)


def test_log_mass_and_token_logprobs_from_one_pass(logits):
    from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs

    target_ids = torch.tensor([7, 2, 9, 0])
    tokens = torch.tensor([7, 3, 0, 9, 5])  # in the draft vocabulary and not
    mass, lp = log_mass_and_token_logprobs(logits, tokens, vocab_size=10, target_ids=target_ids)
    assert torch.equal(mass, draft_vocab_log_mass(logits, vocab_size=10, target_ids=target_ids))
    want = torch.log_softmax(logits[:, :10].double(), -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lp.double(), want)
    ref = vocab_parallel_token_logprobs(logits.unsqueeze(0), tokens.unsqueeze(0), vocab_size=10)[0]
    torch.testing.assert_close(lp, ref)
    with pytest.raises(ValueError, match="tokens \\[N\\]"):
        log_mass_and_token_logprobs(logits, tokens[:3], vocab_size=10, target_ids=target_ids)


def test_topk_must_fit_draft_vocab(logits):
    with pytest.raises(ValueError, match="top-k 5 must be in 1..4"):
        draft_vocab_teacher(logits, vocab_size=10, target_ids=torch.tensor([1, 2, 3, 4]), topk=5)


def test_logprobs_at_and_log_softmax_and_argmax(logits):
    ref = torch.log_softmax(logits[:, :10], -1)
    ids = torch.tensor([[0, 9], [3, 3], [1, 2], [8, 0], [5, 6]])
    x = logits.clone().requires_grad_(True)
    got = vocab_parallel_logprobs_at(x, ids, vocab_size=10)
    torch.testing.assert_close(got, ref.gather(1, ids))
    got.sum().backward()  # differentiable, no gradient into padded columns
    assert torch.all(x.grad[:, 10:] == 0)
    ls = vocab_parallel_log_softmax(logits, vocab_size=10)
    torch.testing.assert_close(ls[:, :10], ref)
    assert torch.isinf(ls[:, 10:]).all()
    assert torch.equal(vocab_parallel_argmax(logits, vocab_size=10), logits[:, :10].argmax(-1))
