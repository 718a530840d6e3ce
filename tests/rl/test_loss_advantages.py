"""GRPO math with hand-computed values (torchtune style)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_spec.rl.advantages import grpo_advantages
from megatron_spec.rl.loss import grpo_loss


def test_group_advantages_hand_computed():
    # group 1: rewards 1, 0 -> mean 0.5, std 0.5 -> +1, -1; group 2: all equal -> 0, 0
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.3, 0.3]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    no_std = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, normalize_std=False)
    torch.testing.assert_close(no_std, torch.tensor([0.5, -0.5, 1.0, -1.0]))
    batch = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, baseline="batch")
    torch.testing.assert_close(batch, torch.tensor([1.0, 1.0, -1.0, -1.0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="G=3"):
        grpo_advantages(torch.zeros(4), 3)


def test_on_policy_loss_is_minus_mean_advantage_token_level():
    # ratio = 1 everywhere: loss = -sum_t A_i m_t / normalizer
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, st = grpo_loss(lp, lp.detach(), adv, mask, normalizer=3.0)
    # tokens: two of sample 0 (A=2), one of sample 1 (A=-1): -(2 + 2 - 1) / 3 = -1
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    # d loss / d lp_t = -A_i * ratio / normalizer on response tokens, 0 elsewhere
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, -2 / 3, 0.0], [1 / 3, 0.0, 0.0]]))
    assert st.tokens == 3 and st.clipped == 0 and st.ratio_sum == pytest.approx(3.0)


def test_clipping_decoupled_bounds():
    old = torch.zeros(1, 2)
    # ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065
    lp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    mask = torch.ones(1, 2)
    # A > 0: the high ratio is clipped at 1 + 0.28 (the min picks the clipped term), the low one is not
    loss, st = grpo_loss(lp, old, torch.tensor([1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.28, normalizer=2.0)
    expected = -(1.28 + math.exp(-0.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert st.clipped == 1
    loss.backward()
    assert lp.grad[0, 0] == 0.0 and lp.grad[0, 1] != 0.0  # no gradient through a binding clip
    # A < 0: the low ratio clips at 1 - 0.2 = 0.8, -min(-r, -0.8) = max(r, 0.8)
    loss2, st2 = grpo_loss(lp.detach(), old, torch.tensor([-1.0]), mask, normalizer=2.0)
    assert loss2.item() == pytest.approx((math.exp(0.5) + 0.8) / 2, rel=1e-6)
    assert st2.clipped == 1


def test_k3_kl_and_sequence_aggregation():
    lp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    ref = torch.tensor([[-1.0, -0.5], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # k3 at token (0,1): d = 0.5 -> e^0.5 - 0.5 - 1 = 0.148721
    loss, st = grpo_loss(lp, lp, torch.zeros(2), mask, ref_logprobs=ref, kl_coef=0.1, agg="sequence", normalizer=2.0)
    k3 = math.exp(0.5) - 1.5
    # sequence means: sample 0 (0 + 0.1 k3) / 2, sample 1: 0 -> sum / 2
    assert loss.item() == pytest.approx(0.1 * k3 / 2 / 2, rel=1e-6)
    assert st.kl_sum == pytest.approx(k3, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, torch.zeros(2), mask, kl_coef=0.1)


def test_truncated_is_weights_scale_tokens():
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), is_weights=w, normalizer=2.0)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


def test_policy_lr_warms_up_linearly_and_depends_on_the_step_alone():
    """--lr-warmup-steps N: lr * (step + 1) / N for the first N steps, then lr (so a resumed run,
    which restores the step, continues the schedule exactly); 0 = constant; < 0 is refused."""
    from types import SimpleNamespace

    from megatron_spec.config import RunConfig
    from megatron_spec.rl.trainer import GRPOTrainer

    cfg = RunConfig()
    cfg.grpo.lr, cfg.grpo.lr_warmup_steps = 1e-4, 4
    lrs = [GRPOTrainer.policy_lr(SimpleNamespace(cfg=cfg, step=s)) for s in range(6)]
    assert lrs == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    cfg.grpo.lr_warmup_steps = 0
    assert GRPOTrainer.policy_lr(SimpleNamespace(cfg=cfg, step=0)) == 1e-4
    cfg.grpo.lr_warmup_steps = -1
    cfg.model.hf_checkpoint, cfg.data.prompt_data = "some/checkpoint", "synthetic:sum"
    with pytest.raises(ValueError, match="lr-warmup-steps"):
        cfg.validate()
