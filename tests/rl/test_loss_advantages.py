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
    loss, st = grpo_loss(
        lp, old, torch.tensor([1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.28, normalizer=2.0
    )
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
    loss, st = grpo_loss(
        lp, lp, torch.zeros(2), mask, ref_logprobs=ref, kl_coef=0.1, agg="sequence", normalizer=2.0
    )
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
    from megatron_spec.config import RunConfig
    from megatron_spec.rl.policy_optim import policy_lr

    cfg = RunConfig()
    cfg.grpo.lr, cfg.grpo.lr_warmup_steps = 1e-4, 4
    lrs = [policy_lr(cfg.grpo, s) for s in range(6)]
    assert lrs == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    cfg.grpo.lr_warmup_steps = 0
    assert policy_lr(cfg.grpo, 0) == 1e-4
    cfg.grpo.lr_warmup_steps = -1
    cfg.model.hf_checkpoint, cfg.data.prompt_data = "some/checkpoint", "synthetic:sum"
    with pytest.raises(ValueError, match="lr-warmup-steps"):
        cfg.validate()


def test_tokens_outside_a_support_give_no_nan_and_no_gradient():
    """Issue 17, defect 2: a sampled token the current policy's top-k/top-p support excludes has
    log-prob -inf; before, (-inf) - (-inf) made the ratio NaN. It now reads as ratio 0: no loss,
    no gradient, still in the normalizer. A reference that excludes a token adds no KL there."""
    inf = float("inf")
    lp = torch.tensor([[-1.0, -inf, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -inf]])
    ref = torch.tensor([[-inf, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, st = grpo_loss(lp, old, torch.tensor([1.0]), mask, ref_logprobs=ref, kl_coef=0.1, normalizer=3.0)
    # only token 0 is inside both supports: ratio 1, A = 1 -> -1; its reference is -inf: no KL
    assert loss.item() == pytest.approx(-1.0 / 3.0)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0 / 3.0, 0.0, 0.0]]))
    assert st.out_of_support == 2 and st.tokens == 3 and st.kl_sum == 0.0
    assert st.ratio_sum == pytest.approx(1.0) and st.ratio_max == pytest.approx(1.0)


def test_truncated_is_weight_multiplies_the_kl_term_too():
    # token: lp = old = -1, ref = -0.5 -> d = 0.5, k3 = e^0.5 - 1.5; A = 0 so only the KL term is left
    lp = torch.full((1, 1), -1.0, requires_grad=True)
    ref = torch.full((1, 1), -0.5)
    k3 = math.exp(0.5) - 1.5
    w = torch.tensor([[0.25]])
    loss, st = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.1,
                         is_weights=w)
    assert loss.item() == pytest.approx(0.25 * 0.1 * k3, rel=1e-6)
    # loss/kl stays the raw estimate
    assert st.pg_loss_sum == 0.0 and st.kl_sum == pytest.approx(k3, rel=1e-6)


def test_split_never_drops_and_select_for_training():
    """Defect 1: 48 rollouts / micro-batch 8 / 4 minibatches trained 32 before (the microbatch list
    was cut to len // parts); the split is now of rollouts, in chunks differing by at most one."""
    from megatron_spec.rl.rollouts import Rollout, micro_batches, select_for_training, split

    items = list(range(48))
    parts = split(items, 4)
    assert [len(p) for p in parts] == [12] * 4 and sum(parts, []) == items
    assert [len(m) for m in micro_batches(parts[0], 8)] == [8, 4]
    assert [len(p) for p in split(list(range(10)), 4)] == [3, 3, 2, 2]
    assert split([], 3) == [[], [], []]
    with pytest.raises(ValueError):
        split(items, 0)

    def ro(p, reward, finish="stop"):
        return Rollout(p, 0, [1], [2], [0.0], finish, 0, reward=reward)

    rollouts = [ro(0, 1.0), ro(0, 1.0), ro(1, 0.0), ro(1, 1.0, "length"), ro(2, 0.0), ro(2, 0.0)]
    kept, groups, truncated = select_for_training(rollouts, 2, drop_equal_reward_groups=True)
    assert [r.prompt_index for r in kept] == [1, 1] and groups == 2 and truncated == 0
    kept, groups, truncated = select_for_training(rollouts, 2, drop_truncated=True)
    assert len(kept) == 5 and groups == 0 and truncated == 1
    kept, _, truncated = select_for_training(rollouts, 2, drop_equal_reward_groups=True, drop_truncated=True)
    assert [r.reward for r in kept] == [0.0] and truncated == 1
    with pytest.raises(ValueError, match="whole groups"):
        select_for_training(rollouts[:3], 2, drop_equal_reward_groups=True)
    with pytest.raises(ValueError, match="mix prompts"):
        select_for_training(rollouts[1:5], 2, drop_equal_reward_groups=True)


@pytest.mark.parametrize("style, expected", [
    # W = 2, T = 6, lr 1e-4, lr_min 1e-5: warm-up 5e-5, 1e-4; then t = 0, 1/4, 2/4, 3/4
    ("constant", [5e-5, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4]),
    ("linear", [5e-5, 1e-4, 1e-4, 7.75e-5, 5.5e-5, 3.25e-5]),
    # cosine: 1e-5 + 9e-5 (1 + cos(pi t)) / 2 -> 1e-4, 8.6820e-5, 5.5e-5, 2.3180e-5
    ("cosine", [5e-5, 1e-4, 1e-4, 1e-5 + 9e-5 * (1 + math.cos(math.pi / 4)) / 2, 5.5e-5,
                1e-5 + 9e-5 * (1 + math.cos(3 * math.pi / 4)) / 2]),
])
def test_lr_schedule_after_the_warm_up(style, expected):
    from megatron_spec.config import ConfigError, RunConfig
    from megatron_spec.rl.policy_optim import policy_lr

    cfg = RunConfig()
    cfg.grpo.lr, cfg.grpo.lr_min, cfg.grpo.lr_warmup_steps, cfg.grpo.train_iters = 1e-4, 1e-5, 2, 6
    cfg.grpo.lr_decay_style = style
    lrs = [policy_lr(cfg.grpo, s) for s in range(6)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    cfg.model.hf_checkpoint, cfg.data.prompt_data = "some/checkpoint", "synthetic:sum"
    cfg.grpo.lr_min = 2e-4
    with pytest.raises(ConfigError, match="lr-min"):
        cfg.validate()


def test_entropy_and_support_mass_match_the_full_distribution():
    """capture/support.py: entropy of the processed (top-k) distribution and log Z, the mass its
    support keeps, against softmax over the whole vocabulary (no tensor parallelism)."""
    from megatron_spec.capture.support import vocab_parallel_entropy_and_log_mass, vocab_parallel_support_mask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 16, generator=g)
    t = 0.7
    exclude = vocab_parallel_support_mask(logits, vocab_size=14, temperature=t, top_k=5)
    entropy, log_mass = vocab_parallel_entropy_and_log_mass(logits, exclude, vocab_size=14, temperature=t)
    x = logits[..., :14] / t
    full = torch.softmax(x, dim=-1)
    kept = ~exclude[..., :14]
    assert kept.sum(-1).eq(5).all()
    torch.testing.assert_close(log_mass, (full * kept).sum(-1).log(), atol=1e-5, rtol=0)
    p = torch.softmax(x.masked_fill(~kept, float("-inf")), dim=-1)
    ref = -(torch.where(kept, p * p.log(), torch.zeros_like(p))).sum(-1)
    torch.testing.assert_close(entropy, ref, atol=1e-5, rtol=0)
    h_all, z_all = vocab_parallel_entropy_and_log_mass(logits, None, vocab_size=14, temperature=t)
    torch.testing.assert_close(h_all, -(full * full.log()).sum(-1), atol=1e-5, rtol=0)
    assert torch.equal(z_all, torch.zeros_like(z_all))
