"""Engine helpers: the drafters' draw (argmax without a distribution for all-greedy batches, a
sample and its distribution otherwise) and the target model's mixed-segment forward."""

from __future__ import annotations

import torch

from megatron_spec.rollout.native.drafters import draw
from megatron_spec.spec import SamplingTensors, process_logits


def test_all_greedy_batch_is_argmax_without_distribution():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.5, -2.0]])
    tok, q = draw(logits, SamplingTensors.from_values(0.0, batch_size=2), torch.Generator().manual_seed(0))
    assert tok.tolist() == [1, 0]  # ties go to the first maximum, as process_logits' one-hot does
    assert q is None
    lp = process_logits(logits, SamplingTensors.from_values(0.0, batch_size=2))
    assert lp.argmax(-1).tolist() == [1, 0]


def test_mixed_batch_samples_and_returns_the_processed_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=g)
    sampling = SamplingTensors.from_values([0.0, 1.0, 0.7], [0, 0, 3], [1.0, 0.9, 1.0], [0.0, 0.0, 0.0])
    tok, q = draw(logits, sampling, torch.Generator().manual_seed(2))
    torch.testing.assert_close(q, process_logits(logits, sampling).exp())
    assert int(tok[0]) == int(logits[0].argmax())
    assert all(float(q[i, int(tok[i])]) > 0 for i in range(3))  # drawn inside the processed support


def test_segments_in_one_forward_equal_separate_forwards(setup):
    """``forward_segments``: a verify-shaped segment and a padded prefill segment share one pass
    over the weights; logits, aux states and every cache entry equal two separate forwards."""
    from tests.conftest import load_native
    from megatron_spec.rollout.native.model import Segment

    model = load_native(setup.target)
    g = torch.Generator().manual_seed(5)
    vocab = setup.cfg.vocab_size
    prompt = torch.randint(4, vocab, (2, 7), generator=g)
    caches = [model.new_cache(4, 32) for _ in range(2)]
    with torch.no_grad():
        for c in caches:  # slots 0-1 hold 7 tokens of context
            model(prompt, torch.arange(7).expand(2, 7), c, torch.tensor([7, 7]))
        step = Segment(torch.randint(4, vocab, (2, 3), generator=g), 7 + torch.arange(3).expand(2, 3),
                       torch.tensor([10, 10]))
        lens = torch.tensor([5, 3])
        pre = Segment(torch.randint(4, vocab, (2, 5), generator=g), torch.arange(5).expand(2, 5), lens, 2,
                      (lens - 1).unsqueeze(1))
        aux = (1, 3)
        mixed = model.forward_segments([step, pre], caches[0], aux_layers=aux)
        apart = [model.forward_segments([s], caches[1], aux_layers=aux)[0] for s in (step, pre)]
    for (lg, ax), (lg2, ax2) in zip(mixed, apart):
        torch.testing.assert_close(lg, lg2, atol=1e-5, rtol=0)
        torch.testing.assert_close(ax, ax2, atol=1e-5, rtol=0)
    assert mixed[0][0].shape == (2, 3, vocab) and mixed[1][0].shape == (2, 1, vocab)
    for layer in range(setup.cfg.num_layers):
        for slot, n in ((0, 10), (1, 10), (2, 5), (3, 3)):
            torch.testing.assert_close(caches[0].k[layer][slot, :, :n], caches[1].k[layer][slot, :, :n],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(caches[0].v[layer][slot, :, :n], caches[1].v[layer][slot, :, :n],
                                       atol=1e-5, rtol=0)
