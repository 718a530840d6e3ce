"""Layout search (engines x TP x EP) and the MoE expected-distinct-experts term."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_spec.sim.capacity import LayoutError
from megatron_spec.sim.layout import HEADROOM, candidate_shapes, search_layouts, simulate_layout
from megatron_spec.sim.models import get_model
from megatron_spec.sim.rl_step import SimConfig, build_step_model, simulate, step_cost_breakdown
from megatron_spec.sim.roofline import expected_distinct_experts
from megatron_spec.sim.workload import PRESETS


def _cfg(**kw) -> SimConfig:
    base = dict(model="qwen3-8b", hardware="h100", num_gpus=8, mode="sync", tp=None, ep=None,
                num_draft_tokens=3, accept_length=3.0)
    base.update(kw)
    return SimConfig(**base)


# ---- dense: the smallest engine with KV headroom --------------------------------------------------
def test_dense_small_workload_fits_one_gpu_engines():
    # 32 prompts x 8 samples on 8 H100: 32 rollouts per TP=1 engine fit with room to spare
    wl = PRESETS["rl-zero"].replace(prompts_per_step=32, samples_per_prompt=8, max_response_len=8192)
    s = search_layouts(_cfg(workload=wl))
    assert (s.spec.tp, s.spec.ep, s.spec.engines) == (1, 1, 8)
    assert s.ar is s.spec and s.spec.headroom_ok
    assert s.spec.kv_capacity_tokens >= HEADROOM * s.spec.kv_needed_tokens


def test_dense_large_workload_needs_a_wider_engine_for_headroom():
    # 4096 rollouts on 8 H100: 512 running sequences per engine of ~1.85k tokens need ~0.95M
    # cached tokens x 1.25; one H100 holds ~0.35M after the 16 GB of weights, two ~0.8M
    s = search_layouts(_cfg())
    by_tp = {c.tp: c for c in s.candidates}
    assert by_tp[1].fits and not by_tp[1].headroom_ok
    assert by_tp[2].fits and not by_tp[2].headroom_ok
    assert s.spec.tp == 4 and s.spec.engines == 2 and s.spec.headroom_ok
    # the reported optima are the best simulated generation over every fitting candidate
    fit = [c for c in s.candidates if c.fits]
    assert s.ar_optimum.gen_ar_s == min(c.gen_ar_s for c in fit)
    assert s.spec_optimum.gen_spec_s == min(c.gen_spec_s for c in fit)


def test_dense_does_not_fit_anywhere():
    with pytest.raises(ValueError, match="no rollout engine layout fits 'llama-3.1-70b' on 1 h100"):
        search_layouts(_cfg(model="llama-3.1-70b", num_gpus=1))
    # a pinned layout that cannot hold the weights is a LayoutError naming the bytes
    with pytest.raises(LayoutError, match=r"llama-3.1-70b does not fit: 143\.9 GB of bf16 weights"):
        simulate(_cfg(model="llama-3.1-70b", num_gpus=8, tp=1, ep=1))


def test_tp_pin_restricts_and_num_engines_leaves_gpus_idle():
    s = search_layouts(_cfg(tp=2))
    assert {c.tp for c in s.candidates} == {2}
    res, search = simulate_layout(_cfg(tp=2, num_engines=3))
    assert search is None  # pinned: no search
    assert (res.detail["engine"]["engines"], res.detail["engine"]["gen_gpus"]) == (3, 6)
    with pytest.raises(ValueError, match="num_engines=5 engines of 2 devices need 10 GPUs; 8 generate"):
        simulate(_cfg(tp=2, ep=1, num_engines=5))


def test_candidate_shapes_respect_heads_and_experts():
    moe = get_model("qwen3-235b-a22b")  # 64 heads, 128 experts
    shapes = candidate_shapes(moe, 512)
    assert (16, 64) in shapes and (1, 128) in shapes and (32, 1) not in shapes  # MAX_TP 16
    assert all(128 % e == 0 and 64 % t == 0 for t, e in shapes)
    assert all(512 % max(t, e) == 0 for t, e in shapes)
    with pytest.raises(ValueError, match="ep=2 needs an MoE model"):
        candidate_shapes(get_model("qwen3-8b"), 8, ep=2)


# ---- MoE: the best rollout throughput per mode ------------------------------------------------------
def test_moe_search_picks_the_throughput_optimum_per_mode():
    cfg = _cfg(model="qwen3-235b-a22b", hardware="gb200", num_gpus=512)
    s = search_layouts(cfg)
    fit = [c for c in s.candidates if c.fits]
    assert s.ar.gen_ar_s == min(c.gen_ar_s for c in fit)
    assert s.spec.gen_spec_s == min(c.gen_spec_s for c in fit)
    no_fit = {(c.tp, c.ep): c.reason for c in s.candidates if not c.fits}
    assert "471.1 GB" in no_fit[(1, 1)]
    res, _ = simulate_layout(cfg)
    # the combined projection compares each mode on its own best layout
    assert res.rollout_speedup == pytest.approx(s.ar.gen_ar_s / s.spec.gen_spec_s)
    assert res.detail["engine_ar"]["tp"] == s.ar.tp and res.detail["engine"]["tp"] == s.spec.tp
    # pinning ep keeps it
    assert {c.ep for c in search_layouts(cfg.replace(ep=8)).candidates} == {8}


# ---- expected distinct experts ----------------------------------------------------------------------
def test_expected_distinct_experts_hand_values():
    # E=128, top-8. One token: exactly 8. Four tokens (one sequence verifying k=3):
    # 128 (1 - (120/128)^4) = 128 (1 - 0.772476) = 29.12. Many tokens: all 128.
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(128, 8, 4) == pytest.approx(29.1230, abs=1e-3)
    assert expected_distinct_experts(128, 8, 10_000) == pytest.approx(128.0)
    # DeepSeek-V3: 256 routed, top-8, 16 tokens: 256 (1 - (31/32)^16) = 101.7
    assert expected_distinct_experts(256, 8, 16) == pytest.approx(256 * (1 - (31 / 32) ** 16))
    with pytest.raises(ValueError):
        expected_distinct_experts(8, 9, 1)


def test_expected_distinct_experts_matches_sampled_routing():
    # Uniform top-k routing sampled with a fixed seed: each token draws k distinct experts.
    rng = np.random.default_rng(0)
    E, k, trials = 64, 6, 4000
    for n in (1, 3, 12):
        counts = np.empty(trials)
        for t in range(trials):
            picks = np.argsort(rng.random((n, E)), axis=1)[:, :k]
            counts[t] = len(np.unique(picks))
        expected = float(expected_distinct_experts(E, k, n))
        # 5 standard errors of the sample mean
        assert abs(counts.mean() - expected) <= 5 * counts.std(ddof=1) / math.sqrt(trials) + 1e-9


def test_verify_streams_more_experts_than_decode_at_small_batch_only():
    cfg = _cfg(model="qwen3-235b-a22b", hardware="gb200", num_gpus=64, tp=4, ep=8)
    steps = build_step_model(cfg)
    small = step_cost_breakdown(steps, 1, 2000.0, 3.0)
    large = step_cost_breakdown(steps, 256, 2000.0, 3.0)
    assert small["decode_distinct_experts_per_layer"] == pytest.approx(8.0)
    assert small["verify_distinct_experts_per_layer"] == pytest.approx(29.12, abs=0.01)
    assert small["verify_weight_gb_per_device"] > 2 * small["decode_weight_gb_per_device"]
    assert large["verify_distinct_experts_per_layer"] == pytest.approx(128.0, abs=0.01)
    assert large["verify_weight_gb_per_device"] == pytest.approx(
        large["decode_weight_gb_per_device"], rel=1e-3
    )
    # EP all-to-all carries k+1 times the tokens when verifying
    assert large["verify_parts_ms"]["comm"] > large["decode_parts_ms"]["comm"]
