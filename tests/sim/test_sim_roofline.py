"""Roofline forward costs, checked against hand-computed bytes / bandwidth and FLOPs / peak."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_spec.sim.hardware import get_hardware
from megatron_spec.sim.models import get_model
from megatron_spec.sim.params import EfficiencyParams, EngineSettings
from megatron_spec.sim.roofline import ForwardModel, Parallelism, StepModel

H100 = get_hardware("h100")  # 3.35e12 B/s, 989.5e12 bf16 FLOP/s
IDEAL = EfficiencyParams(mem_eff=1.0, flop_eff=1.0, step_overhead_s=0.0, train_mfu=0.5)
NO_LIMITS = EngineSettings(graph_max_tokens=1 << 30, fused_verify_max_q=0)

# Qwen3-8B per layer: q 4096x4096, k and v 4096x1024, o 4096x4096, MLP 3x4096x12288; LM head.
QWEN3_8B_READ = 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288) + 151936 * 4096


def fwd(model="qwen3-8b", par=Parallelism(), settings=NO_LIMITS, eff=IDEAL):
    return ForwardModel(get_model(model), H100, eff, settings, par, "bf16")


def test_decode_one_token_is_weight_streaming():
    f = fwd()
    out = f.forward(1, 1, 0.0, 0.0)
    weights = QWEN3_8B_READ * 2 / 3.35e12  # ~4.5 ms: memory-bound
    logits = 151936 * 4 * 3 / 3.35e12
    assert float(out["gemm"]) == pytest.approx(weights)
    assert float(out["logits"]) == pytest.approx(logits)
    assert float(out["total"]) == pytest.approx(weights + logits)


def test_large_batch_is_compute_bound():
    out = fwd().forward(4096, 1, 0.0, 0.0)
    assert float(out["gemm"]) == pytest.approx(2 * QWEN3_8B_READ * 4096 / 989.5e12)


def test_kv_cache_read_once_per_forward():
    f = fwd()
    ctx = 100_000.0
    attn = float(f.forward(8, 1, ctx, 0.0)["attn"])
    assert attn == pytest.approx(ctx * 147456 / 3.35e12)  # memory-bound KV read
    # verifying 4 tokens per sequence reads the same cache once (fused kernel)
    assert float(f.forward(8, 4, ctx, 0.0)["attn"]) == pytest.approx(attn)


def test_unfused_verify_rereads_kv_per_query_token():
    f = fwd(settings=EngineSettings(graph_max_tokens=1 << 30, fused_verify_max_q=4))
    ctx = 100_000.0
    one = float(f.forward(8, 1, ctx, 0.0)["attn"])
    assert float(f.forward(8, 4, ctx, 0.0)["attn"]) == pytest.approx(one)
    assert float(f.forward(8, 6, ctx, 0.0)["attn"]) == pytest.approx(6 * one)


def test_verify_is_nearly_free_at_small_batch_and_costly_at_large_batch():
    steps = StepModel(fwd(), None, "ngram", 3)
    small = steps.spec_step(np.array([1.0]), np.array([0.0]))["total"][0] / steps.ar_step(1.0, 0.0)["total"]
    big = (
        steps.spec_step(np.array([2048.0]), np.array([0.0]))["total"][0] / steps.ar_step(2048.0, 0.0)["total"]
    )
    assert small < 1.01  # 4 tokens ride on the same weight read
    assert big == pytest.approx(4.0, rel=0.02)  # compute-bound: 4x the tokens, 4x the time


def test_tensor_parallel_halves_weights_and_adds_allreduce():
    f1, f2 = fwd(), fwd(par=Parallelism(tp=2))
    assert float(f2.forward(1, 1, 0.0, 0.0)["gemm"]) == pytest.approx(
        float(f1.forward(1, 1, 0.0, 0.0)["gemm"]) / 2
    )
    # 36 layers x 2 all-reduces x (10 us latency + 2 (tp-1)/tp x 4096 x 2 B / 450 GB/s)
    expected = 36 * 2 * (10e-6 + 1.0 * 4096 * 2 / 450e9)
    assert float(f2.forward(1, 1, 0.0, 0.0)["comm"]) == pytest.approx(expected)


def test_moe_reads_only_touched_experts():
    m = get_model("qwen3-235b-a22b")
    f = fwd("qwen3-235b-a22b", par=Parallelism(tp=8, ep=8))
    one = float(f.forward(1, 1, 0.0, 0.0)["gemm"])
    always = m.always_read_params * 2 / 8 / 3.35e12
    experts = 94 * (128 / 8) * (8 / 128) * m.expert_params * 2 / 3.35e12  # 1 token touches 8 of 128
    assert one == pytest.approx(always + experts)
    # 4 tokens touch ~4x as many experts: verification of k+1 tokens costs more on MoE
    four = float(f.forward(1, 4, 0.0, 0.0)["gemm"])
    assert four > 1.5 * one


def test_eager_overhead_above_graph_capture_size():
    eff = IDEAL.replace(step_overhead_s=1e-3, eager_layer_overhead_s=1e-4)
    f = fwd(settings=EngineSettings(graph_max_tokens=512, fused_verify_max_q=0), eff=eff)
    assert float(f.forward(128, 4, 0.0, 1e-3)["overhead"]) == pytest.approx(1e-3)  # 512 tokens: graphed
    assert float(f.forward(129, 4, 0.0, 1e-3)["overhead"]) == pytest.approx(1e-3 + 36 * 1e-4)


def test_parallelism_validation():
    with pytest.raises(ValueError, match="must divide"):
        Parallelism(tp=4, ep=6)
    with pytest.raises(ValueError, match=">= 1"):
        Parallelism(tp=0)
