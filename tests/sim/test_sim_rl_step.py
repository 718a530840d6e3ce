"""One RL step: stage bookkeeping, sync vs async, and clear errors for impossible configs."""

from __future__ import annotations

import pytest

from megatron_spec.sim.rl_step import SimConfig, optimal_k, simulate
from megatron_spec.sim.workload import PRESETS

SMALL = PRESETS["rl-zero"].replace(prompts_per_step=64, response_median=800.0, max_response_len=4096)


def cfg(**kw) -> SimConfig:
    base = dict(model="qwen3-8b", hardware="h100", num_gpus=8, num_draft_tokens=3, accept_length=2.5,
                workload=SMALL)
    base.update(kw)
    return SimConfig(**base)


def test_sync_step_is_the_sum_of_its_stages():
    r = simulate(cfg())
    for st in (r.stages_ar, r.stages_spec):
        assert st["step"] == pytest.approx(sum(v for k, v in st.items() if k != "step"))
    assert r.rollout_speedup == pytest.approx(r.stages_ar["gen"] / r.stages_spec["gen"])
    assert r.e2e_speedup == pytest.approx(r.step_time_ar_s / r.step_time_spec_s)
    # only generation changes: e2e gain is diluted by the stages speculation does not touch
    assert 1.0 < r.e2e_speedup < r.rollout_speedup


def test_async_step_overlaps_generation_with_training():
    r = simulate(cfg(num_gpus=16, mode="async", policy_lag=1, train_gpus=4))
    for st in (r.stages_ar, r.stages_spec):
        train_side = st["logprob"] + st["train"] + st["draft_train"]
        gen_side = st["prepare"] + st["gen"]
        assert st["step"] == pytest.approx(st["data"] + max(train_side, gen_side))
        assert st["exposed_gen"] == pytest.approx(max(0.0, gen_side - train_side))
    assert r.detail["engine"]["train_gpus"] == 4 and r.detail["engine"]["gen_gpus"] == 12


def test_lag_two_hides_the_long_tail():
    lag1 = simulate(cfg(num_gpus=16, mode="async", policy_lag=1))
    lag2 = simulate(cfg(num_gpus=16, mode="async", policy_lag=2))
    assert lag2.stages_ar["gen"] < lag1.stages_ar["gen"]


def test_more_acceptance_more_speedup():
    speeds = [simulate(cfg(accept_length=t)).rollout_speedup for t in (1.5, 2.5, 3.5)]
    assert speeds[0] < speeds[1] < speeds[2]


def test_zero_acceptance_is_slower_than_ar():
    assert simulate(cfg(accept_length=1.0)).rollout_speedup < 1.0


def test_optimal_k_is_the_argmax():
    best, rows = optimal_k(cfg(accept_length=None, accept_rates=(0.8, 0.64, 0.51)), k_max=8)
    assert best == max(rows, key=lambda r: r["e2e_speedup"])["k"]
    assert [r["k"] for r in rows] == list(range(1, 9))


def test_online_draft_training_costs_time():
    off = simulate(cfg())
    on = simulate(cfg(online_draft_training=True))
    assert on.stages_spec["draft_train"] > 0 and on.e2e_speedup < off.e2e_speedup


@pytest.mark.parametrize("kw, match", [
    (dict(model="qwen3-235b-a22b"), r"qwen3-235b-a22b does not fit: .* per device with tp=1 ep=1"),
    (dict(model="llama-3.1-70b", tp=1), "does not fit"),
    (dict(num_draft_tokens=0, accept_length=None, accept_rates=(0.5,)), "k=0 must be >= 1"),
    (dict(accept_length=4.5), r"accept length 4.5 is impossible with k=3"),
    (dict(accept_length=None, accept_rates=(0.9, 1.3)), r"outside \[0, 1\]"),
    (dict(accept_length=None, accept_rates=(-0.1,)), r"outside \[0, 1\]"),
    (dict(accept_length=2.0, accept_rates=(0.5,)), "exactly one"),
    (dict(model="no-such-model"), "unknown model 'no-such-model'"),
    (dict(hardware="tpu-v5"), "unknown hardware 'tpu-v5'"),
    (dict(tp=3), "tp=3 does not divide the 32 attention heads"),
    (dict(ep=2), "ep=2 needs an MoE model"),
    (dict(num_gpus=6, tp=4), "not a multiple of the 4 devices per engine"),
    (dict(mode="async", policy_lag=0), "policy_lag >= 1"),
    (dict(mode="async", train_gpus=8), "1 <= train_gpus < num_gpus"),
    (dict(draft_kind="mtp"), "no MTP layers"),
    (dict(draft_kind="medusa"), "unknown draft kind"),
    (dict(workload=SMALL.replace(max_response_len=2_000_000)), "KV cache holds"),
    (dict(model="llama-3.1-70b", tp=8, num_gpus=8), "training llama-3.1-70b needs at least"),
])
def test_impossible_configs_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        simulate(cfg(**kw))


def test_moe_with_expert_parallel_runs():
    r = simulate(cfg(model="qwen3-235b-a22b", hardware="gb200", num_gpus=64, tp=4, ep=8))
    assert r.detail["engine"]["devices_per_engine"] == 8 and r.rollout_speedup > 0
