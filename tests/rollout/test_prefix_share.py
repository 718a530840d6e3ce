"""Prompts admitted together share the forward of their common beginning (``prefix_share.py``): which
beginning runs once, and the engine's tokens, log-probs and drafts unchanged by it."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.rollout.native import prefix_share
from megatron_spec.rollout.native.prefix_share import shared_length
from megatron_spec.rollout.types import GenerateRequest, SamplingParams


def _reqs(prompts):
    return [GenerateRequest(str(i), p, SamplingParams()) for i, p in enumerate(prompts)]


def test_the_common_beginning_short_of_the_shortest_prompts_last_token():
    assert shared_length(_reqs([[1, 2, 3, 4, 9], [1, 2, 3, 5]]), min_saved=0) == 3
    assert shared_length(_reqs([[1, 2, 3, 4], [1, 2, 3]]), min_saved=0) == 2  # [1, 2, 3] keeps its 3
    assert shared_length(_reqs([[1, 2, 3], [1, 2, 3]]), min_saved=0) == 2
    assert shared_length(_reqs([[7, 2], [1, 2]]), min_saved=0) == 0
    assert shared_length(_reqs([[1, 2, 3, 4]]), min_saved=0) == 0  # one prompt: nothing to share with


def test_a_beginning_runs_once_only_where_it_saves_enough_tokens():
    three = _reqs([[5] * 10 + [i] for i in range(3)])  # 10 shared tokens, saved twice: 20
    assert shared_length(three, min_saved=20) == 10
    assert shared_length(three, min_saved=21) == 0
    assert shared_length(three) == (10 if 20 >= prefix_share.MIN_SAVED_TOKENS else 0)


@pytest.mark.parametrize("draft", ["none", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_beginnings_give_the_tokens_of_whole_prefills(setup, monkeypatch, draft, temperature):
    """Prompts with a common beginning and endings of different lengths (one of a single token), several
    samples each, more than the batch holds: admitted alone and beside running rows, a request's samples
    parked. The same tokens and drafts as prefilling whole prompts, log-probs to the packed prefill's
    tolerance; the first admission shared its beginning."""
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer

    g = torch.Generator().manual_seed(11)
    vocab = setup.cfg.vocab_size
    common = torch.randint(4, vocab, (13,), generator=g).tolist()
    prompts = [common + torch.randint(4, vocab, (n,), generator=g).tolist() for n in (1, 6, 3, 9, 2, 5)]
    prompts.append(torch.randint(4, vocab, (8,), generator=g).tolist())  # begins otherwise
    samples, news = (1, 2, 1, 1, 5, 1, 1), (4, 6, 4, 8, 8, 5, 7)
    runs = []
    monkeypatch.setattr(prefix_share, "MIN_SAVED_TOKENS", 0)  # every common beginning shared
    for share in (False, True):  # whole prompts (--no-rollout-share-prefix) / shared beginnings
        server = EngineServer(EngineConfig(model_path=setup.target, draft_kind=draft,
                                           draft_path=setup.eagle3 if draft == "eagle3" else None,
                                           num_draft_tokens=2, context_length=64, max_batch_size=4,
                                           share_prefix=share))
        shared = []
        take = server.core._take

        def spy(waiting, rows, take=take, shared=shared):
            adm = take(waiting, rows)
            if adm is not None:
                shared.append((adm.shared, len(rows)))
            return adm

        server.core._take = spy
        reqs = [GenerateRequest(str(i), p, SamplingParams(temperature=temperature, max_new_tokens=m,
                                                           ignore_eos=True), n=n)
                for i, (p, n, m) in enumerate(zip(prompts, samples, news))]
        out, _ = server.core.generate(reqs, seed=3)
        runs.append((out, shared))
    (whole, none_shared), (split, shared) = runs
    assert all(c == 0 for c, _ in none_shared)
    assert shared[0] == (13, 0)  # the first three prompts: 13 tokens, their shortest ends one past them
    assert shared[1][0] == 13  # the next two (the second's other samples park)
    if draft == "none":  # beside two running rows (drafting, the rows may all end in one step)
        assert shared[1][1] == 2
    assert [s.output_ids for s in split] == [s.output_ids for s in whole]
    assert [s.accepted_per_step for s in split] == [s.accepted_per_step for s in whole]
    for got, want in zip(split, whole):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
