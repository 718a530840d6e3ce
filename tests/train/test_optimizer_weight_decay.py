"""MixedPrecisionAdamW's parameter groups: weight decay on matrices, none on norms and biases (issue 17, item
5)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.train.optimizer import MixedPrecisionAdamW


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gradients_decay_matrices_only(dtype):
    # with zero gradients AdamW's update is the decoupled decay alone: w <- w (1 - lr wd)
    model = _model().to(dtype)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt = MixedPrecisionAdamW(list(model.parameters()), lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = {n: p.detach().float() for n, p in model.named_parameters()}
    torch.testing.assert_close(after["0.weight"], (before["0.weight"] * 0.95).to(dtype).float())
    for name in ("0.bias", "1.weight", "1.bias"):  # the linear's bias, the norm's scale and bias
        assert torch.equal(after[name], before[name]), name


def test_single_group_state_of_an_older_checkpoint_loads():
    """State saved by the single-group optimizer (indices in the model's order) is renumbered."""
    model = _model()
    params = list(model.parameters())  # order: 0.weight (2-D), 0.bias, 1.weight, 1.bias
    old = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    old.step()
    saved = {"adamw": old.state_dict(), "main_params": [None] * len(params)}
    opt = MixedPrecisionAdamW(params, lr=0.1, weight_decay=0.5)
    opt.load_state_dict(saved)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    for i, p in enumerate(params):  # every parameter got its own moments back
        torch.testing.assert_close(opt.optimizer.state[p]["exp_avg"], torch.full_like(p, 0.1 * (i + 1)))
