"""process_logits / SamplingTensors: hand-computed cases, an independent numpy oracle, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_spec.speculative import SamplingTensors, process_logits

NEG_INF = float("-inf")


def probs_of(logits, **params) -> torch.Tensor:
    logits = torch.as_tensor(logits, dtype=torch.float32)[None]
    s = SamplingTensors.from_values(**{k: [v] for k, v in params.items()})
    return process_logits(logits, s)[0].exp()


def test_temperature_scales_logits():
    # logits log(1), log(2), log(4): T=1 -> [1, 2, 4]/7; T=0.5 squares the odds -> [1, 4, 16]/21.
    lg = [0.0, math.log(2), math.log(4)]
    torch.testing.assert_close(probs_of(lg, temperature=1.0), torch.tensor([1, 2, 4]) / 7.0)
    torch.testing.assert_close(probs_of(lg, temperature=0.5), torch.tensor([1, 4, 16]) / 21.0)
    # T=2 takes square roots: [1, sqrt2, 2] / (3 + sqrt2)
    expect = torch.tensor([1, math.sqrt(2), 2]) / (3 + math.sqrt(2))
    torch.testing.assert_close(probs_of(lg, temperature=2.0), expect)


def test_greedy_is_exact_one_hot_lowest_index_on_ties():
    lp = process_logits(torch.tensor([[1.0, 3.0, 3.0, -2.0]]), SamplingTensors.from_values([0.0]))
    assert lp[0].tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF]
    # greedy ignores truncation parameters and respects the token mask
    s = SamplingTensors.from_values([0.0], top_k=[1], top_p=[0.1], min_p=[0.9])
    mask = torch.tensor([[True, False, True, True]])
    lp = process_logits(torch.tensor([[1.0, 3.0, 3.0, -2.0]]), s, token_mask=mask)
    assert lp[0].tolist() == [NEG_INF, NEG_INF, 0.0, NEG_INF]


def test_greedy_is_not_a_tiny_temperature():
    # Two logits 1e-7 apart: a tiny temperature would still split mass; greedy puts all of it on one.
    lg = torch.tensor([[5.0, 5.0 + 1e-6]])
    lp = process_logits(lg, SamplingTensors.from_values([0.0]))
    assert lp[0].tolist() == [NEG_INF, 0.0]


def test_top_k_keeps_ties_at_the_boundary():
    # logits [3, 1, 3, 2], k=1: both 3s tie for the top -> [0.5, 0, 0.5, 0]
    torch.testing.assert_close(probs_of([3.0, 1.0, 3.0, 2.0], top_k=1), torch.tensor([0.5, 0.0, 0.5, 0.0]))
    # k=2 keeps the two 3s only; k=3 adds the 2; k >= V is off
    p = probs_of([3.0, 1.0, 3.0, 2.0], top_k=3)
    assert (p > 0).tolist() == [True, False, True, True]
    p = probs_of([3.0, 1.0, 3.0, 2.0], top_k=4)
    assert (p > 0).all()


def test_top_p_smallest_set_reaching_mass():
    lg = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    # mass ranked above each token: [0, .5, .75, .875]; top_p=0.6 keeps 2 -> [2/3, 1/3, 0, 0]
    torch.testing.assert_close(probs_of(lg, top_p=0.6), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # top_p=0.5: the first token alone reaches 0.5
    torch.testing.assert_close(probs_of(lg, top_p=0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # top_p=0.8 needs the third token, which ties with the fourth: both are kept
    assert (probs_of(lg, top_p=0.8) > 0).all()


def test_min_p_relative_to_max():
    lg = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    # threshold 0.3 * 0.5 = 0.15: keeps 0.5 and 0.25 -> [2/3, 1/3, 0, 0]
    torch.testing.assert_close(probs_of(lg, min_p=0.3), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    torch.testing.assert_close(probs_of(lg, min_p=0.25), torch.tensor([0.5, 0.25, 0.125, 0.125]))


def test_top_p_acts_on_renormalised_top_k():
    # probs [.4, .35, .25]; top_k=2 renormalises to [.533, .467]; top_p=0.5 then keeps one token.
    # (top-p on the un-renormalised distribution would keep two: mass above the second is 0.4 < 0.5.)
    lg = [math.log(0.4), math.log(0.35), math.log(0.25)]
    torch.testing.assert_close(probs_of(lg, top_k=2, top_p=0.5), torch.tensor([1.0, 0.0, 0.0]))


def test_token_mask_removes_before_everything():
    lg = torch.tensor([[0.0, math.log(2), math.log(4)]])
    lp = process_logits(
        lg, SamplingTensors.from_values([1.0]), token_mask=torch.tensor([[True, True, False]])
    )
    torch.testing.assert_close(lp[0].exp(), torch.tensor([1 / 3, 2 / 3, 0.0]))
    assert lp[0, 2].item() == NEG_INF


def _oracle_row(logits: np.ndarray, t: float, k: int, top_p: float, min_p: float) -> np.ndarray:
    """Independent float64 numpy implementation of the documented semantics (no ties in its inputs)."""
    x = logits.astype(np.float64)
    V = x.shape[0]
    if t == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / t
    if 0 < k < V:
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x >= kth, x, -np.inf)

    def softmax(v):
        e = np.exp(v - v.max())
        return e / e.sum()

    if top_p < 1:
        p = softmax(x)
        order = np.argsort(-p, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        keep = order[above < top_p]
        mask = np.zeros(V, bool)
        mask[keep] = True
        x = np.where(mask, x, -np.inf)
    if min_p > 0:
        p = softmax(x)
        x = np.where(p >= min_p * p.max(), x, -np.inf)
    return softmax(x)


@pytest.mark.parametrize("seed", range(6))
def test_batched_rows_match_independent_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    B, V = 24, 50
    logits = torch.randn(B, V, generator=g) * 3
    temps = [0.0, 0.7, 1.0, 1.5]
    s = SamplingTensors.from_values(
        temperature=[temps[i % 4] for i in range(B)],
        top_k=[[0, 5, 20][i % 3] for i in range(B)],
        top_p=[[1.0, 0.9, 0.5][(i // 3) % 3] for i in range(B)],
        min_p=[[0.0, 0.05, 0.3][(i // 9) % 3] for i in range(B)],
    )
    lp = process_logits(logits, s)
    assert lp.dtype == torch.float32
    for b in range(B):
        expect = _oracle_row(logits[b].numpy(), float(s.temperature[b]), int(s.top_k[b]), float(s.top_p[b]),
                             float(s.min_p[b]))
        got = lp[b].exp().double().numpy()
        # identical support, probabilities to float32 accuracy
        assert ((got > 0) == (expect > 0)).all(), f"row {b}"
        np.testing.assert_allclose(got, expect, rtol=2e-5, atol=1e-7)
        # and the batched call equals the single-row call
        one = process_logits(logits[b : b + 1], s.index_select(torch.tensor([b])))
        assert torch.equal(one[0], lp[b])


def test_leading_dims_share_row_parameters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g)  # [B, k+1, V]
    s = SamplingTensors.from_values([0.0, 0.7, 1.3], top_k=[0, 3, 0], top_p=[1.0, 1.0, 0.8])
    lp = process_logits(logits, s)
    lp_flat = process_logits(logits.reshape(12, 11), s.repeat_interleave(4)).reshape(3, 4, 11)
    assert torch.equal(lp, lp_flat)
    assert lp.shape == logits.shape


def test_sampling_tensors_constructors_and_validation():
    s = SamplingTensors.from_values(0.7, top_k=5, batch_size=3)
    assert s.temperature.tolist() == pytest.approx([0.7] * 3) and s.top_k.dtype == torch.int64
    assert s.repeat_interleave(2).batch_size == 6
    assert s.greedy.tolist() == [False] * 3
    with pytest.raises(ValueError, match="batch_size"):
        SamplingTensors.from_values(0.7)
    with pytest.raises(ValueError, match="temperature"):
        SamplingTensors.from_values([-0.1])
    with pytest.raises(ValueError, match="top_p"):
        SamplingTensors.from_values([1.0], top_p=[0.0])
    with pytest.raises(ValueError, match="min_p"):
        SamplingTensors.from_values([1.0], min_p=[1.5])
    with pytest.raises(ValueError, match="top_k"):
        SamplingTensors.from_values([1.0], top_k=[-1])
    with pytest.raises(ValueError, match="shapes"):
        SamplingTensors(torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.ones(2), torch.zeros(2))


def test_errors_name_the_problem():
    s = SamplingTensors.from_values([1.0, 1.0])
    with pytest.raises(ValueError, match="row 1 has no allowed token"):
        process_logits(
            torch.zeros(2, 3), s, token_mask=torch.tensor([[True, True, True], [False, False, False]])
        )
    with pytest.raises(ValueError, match="sampling rows"):
        process_logits(torch.zeros(3, 3), s)
    with pytest.raises(ValueError, match="bool"):
        process_logits(torch.zeros(2, 3), s, token_mask=torch.ones(2, 3))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, [0.5, 1.3, 2.0, 0.9]])
@pytest.mark.parametrize("lead", [(4,), (4, 3)])
def test_all_greedy_and_temperature_only_batches_take_a_short_path_to_the_same_bits(temperature, lead):
    """Batches whose rows are all greedy, or all plain sampling with no truncation, skip the
    per-row masks; the result must equal the general path bit for bit (ties included)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(*lead, 50, generator=g).to(torch.bfloat16)  # bf16 logits make exact ties
    logits[0, ..., 3] = logits[0, ..., 9] = logits.max() + 1  # a tie at the max in row 0
    s = SamplingTensors.from_values(temperature, 0, 1.0, 0.0, batch_size=4)
    assert s._kind == ("greedy" if temperature == 0.0 else "plain")
    general = SamplingTensors.from_values(temperature, 0, 1.0, 0.0, batch_size=4)
    object.__setattr__(general, "_kind", "mixed")
    fast, ref = process_logits(logits, s), process_logits(logits, general)
    assert fast.shape == ref.shape and fast.dtype == ref.dtype
    assert torch.equal(fast, ref)
    with pytest.raises(ValueError, match="fit neither"):  # the row-count check stays
        process_logits(torch.randn(5, 50), s)


def test_a_batch_with_truncation_or_mixed_greedy_rows_takes_the_general_path():
    assert SamplingTensors.from_values([0.0, 1.0], 0, 1.0, 0.0)._kind == "mixed"
    assert SamplingTensors.from_values(1.0, [0, 5], 1.0, 0.0)._kind == "mixed"
    assert SamplingTensors.from_values(1.0, 0, [1.0, 0.9], 0.0)._kind == "mixed"
    assert SamplingTensors.from_values(1.0, 0, 1.0, [0.0, 0.1])._kind == "mixed"
    # greedy ignores them
    assert SamplingTensors.from_values(0.0, 5, 0.9, 0.1, batch_size=2)._kind == "greedy"
