"""Measure this CPU's roofline figures for the simulator's ``cpu`` hardware profile.

What it measures, on ``--threads`` torch threads (2 by default, as the rollout engine runs):

* ``mem_bw``: bytes read + written per second by ``Tensor.copy_`` on 256 MiB buffers
  (the STREAM-copy convention: a copy of B bytes moves 2B).
* per dtype (bfloat16 where this CPU does bf16 natively, and float32), on a stack of the rollout engine's own
linear layers
  (oneDNN-prepacked, ~100M parameters, hidden 4096): the time of one forward at 1, 2, 4, 8,
  16, 32, 64 and 256 tokens. ``flops`` is 2 * params * tokens / time at 256 tokens (the
  compute-bound end); the table's shape t(n) / t(1) is the simulator's CPU GEMM curve (on this
  CPU a 4-token forward is *faster* than a 1-token one: oneDNN's GEMV path streams weights
  slower than its small-GEMM path, which no roofline formula captures).
* per dtype, the time of one one-token call of that linear layer at four weight shapes
  (1024x1024 to 4096x14336), fitted to ``t = gemm_call_s + weight bytes / weight_bw``:
  ``weight_bw`` (streaming rate) and ``gemm_call_s`` (fixed cost per call: dispatch, thread
  fork/join), which dominates small models.
* ``attn_bw``: per dtype and per number of query tokens q (1, 2, 4, 8), K+V bytes / time of one
  ``scaled_dot_product_attention`` over 8192 cached positions (32 query heads, 8 KV heads,
  head_dim 128): how fast attention reads a KV cache when decoding (q=1) or verifying
  (q=k+1). On this CPU the bf16 path is far slower than the fp32 one and q>1 can be faster
  than q=1 (a different kernel): the table keeps what was measured.
* ``layer_overhead_s``: per layer, the one-token forward of the engine's own decoder at
  hidden 64 (norms, RoPE, KV-cache write, attention, activations) less its GEMM calls: the
  op-sequence cost that remains when no bytes or FLOPs are left.

It measures kernels and the engine's layer code, not the engine's scheduler. The
engine benchmark (benchmarks/bench_rollout.py --steady-only) is what validates the
simulator end to end (docs/simulator.md, "Validating on this CPU").

Every figure is measured ``--rounds`` times and the best kept: on a shared machine other jobs
slow some runs down, never speed them up.

Usage: ``python benchmarks/measure_cpu_profile.py [--threads 2] [--rounds 3] [--output PATH]``.
Writes the profile JSON (default ``megatron_spec/sim/data/cpu_profile.json``) and ends by
printing one JSON line with the headline figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUTPUT = REPO / "megatron_spec" / "sim" / "data" / "cpu_profile.json"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256)


def best_time(fn, *, repeats: int, warmup: int = 3) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs (the least disturbed by other load)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_mem_bw(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeats=repeats)
    return 2 * nbytes / t


def _packed_linears(count: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> list:
    """``count`` bias-free linears of the rollout engine (megatron_spec.layers.linear.Linear),
    random weights, prepacked for oneDNN as the engine runs them."""
    from megatron_spec.layers.linear import Linear

    mods = []
    for _ in range(count):
        lin = Linear(fan_in, fan_out, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.normal_(0.0, fan_in ** -0.5)
        lin.pack()
        mods.append(lin)
    return mods


def measure_linear_stack(dtype: torch.dtype, hidden: int = 4096, layers: int = 6,
                         repeats: int = 10) -> dict:
    """Forward time of ``layers`` bias-free [hidden, hidden] linears, per token count, with the
    rollout engine's own linear layer (megatron_spec.layers.linear.Linear: weights
    prepacked for oneDNN), so the profile describes the kernels the engine runs."""
    torch.manual_seed(0)
    mods = _packed_linears(layers, hidden, hidden, dtype)
    params = layers * hidden * hidden
    times = {}
    with torch.inference_mode():
        for n in TOKENS:
            x = torch.randn(n, hidden, dtype=dtype)

            def fwd(x=x):
                h = x
                for lin in mods:
                    h = lin(h)
                return h

            times[n] = best_time(fwd, repeats=repeats if n <= 64 else 4)
    bytes_per_param = torch.finfo(dtype).bits // 8
    return {
        "params": params,
        "bytes_per_param": bytes_per_param,
        "forward_s": {str(n): t for n, t in times.items()},
        "weight_bw": params * bytes_per_param / times[1],
        "flops": 2 * params * TOKENS[-1] / times[TOKENS[-1]],
    }


def measure_attn_bw(dtype: torch.dtype, kv_heads: int = 8, q_heads: int = 32, ctx: int = 8192,
                    head_dim: int = 128, repeats: int = 8) -> dict[str, float]:
    """K+V bytes per second of SDPA over ``ctx`` cached positions, per query-token count."""
    torch.manual_seed(0)
    k = torch.randn(1, kv_heads, ctx, head_dim, dtype=dtype)
    v = torch.randn(1, kv_heads, ctx, head_dim, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    out = {}
    with torch.inference_mode():
        for q_tokens in (1, 2, 4, 8):
            q = torch.randn(1, q_heads, q_tokens, head_dim, dtype=dtype)
            t = best_time(lambda q=q: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           repeats=repeats)
            out[str(q_tokens)] = kv_bytes / t
    return out


GEMM_SHAPES = ((1024, 1024), (1024, 4096), (4096, 4096), (4096, 14336))


def measure_gemm_calls(dtype: torch.dtype, repeats: int = 20) -> list[dict]:
    """Seconds per one-token call of the engine's linear layer, per weight shape [in, out]
    (a stack of copies, so each call streams its weight from memory, not from cache). The
    profile fits ``t = gemm_call_s + weight bytes / weight_bw`` to these points: a fixed cost
    per GEMM call (oneDNN dispatch and thread fork/join) plus streaming."""
    torch.manual_seed(0)
    out = []
    for fan_in, fan_out in GEMM_SHAPES:
        nbytes = fan_in * fan_out * (torch.finfo(dtype).bits // 8)
        copies = max(2, min(32, (256 << 20) // nbytes))  # >= 256 MiB in all: past every cache
        mods = _packed_linears(copies, fan_in, fan_out, dtype)
        x = torch.randn(1, fan_in, dtype=dtype)
        with torch.inference_mode():
            t = best_time(lambda mods=mods, x=x: [m(x) for m in mods], repeats=repeats) / copies
        out.append({"shape": [fan_in, fan_out], "bytes": nbytes, "s_per_call": t})
    return out


def fit_gemm_calls(points: list[dict]) -> tuple[float, float]:
    """``t = t0 + bytes / bw`` over the measured calls, least squares on the relative error
    (small and large calls count alike): (t0 seconds, bw bytes/s)."""
    import numpy as np

    x = np.array([p["bytes"] for p in points], dtype=float)
    y = np.array([p["s_per_call"] for p in points], dtype=float)
    slope, t0 = np.polyfit(x, y, 1, w=1.0 / y)
    return max(0.0, float(t0)), float(1.0 / slope)


def _tiny_engine_model(layers: int):
    """The engine's own decoder (megatron_spec.rollout.native.model.CausalLM) at hidden 64:
    its time per layer is the cost of the layer's op sequence, not of bytes or FLOPs."""
    from megatron_spec.layers.linear import pack_linears
    from megatron_spec.models.hf_config import DecoderConfig
    from megatron_spec.rollout.native.model import CausalLM

    cfg = DecoderConfig(architecture="Qwen3ForCausalLM", family="qwen3", vocab_size=64, hidden_size=64,
                        intermediate_size=128, num_layers=layers, num_attention_heads=4, num_kv_heads=2,
                        head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=256,
                        tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    torch.manual_seed(0)
    model = CausalLM(cfg).to(_engine_dtype()).eval()
    pack_linears(model)
    return model


def _engine_dtype() -> torch.dtype:
    """The dtype the engine computes in on this CPU (``megatron_spec.isa``)."""
    from megatron_spec.isa import resolve_dtype

    return getattr(torch, resolve_dtype("auto"))


def measure_layer_overhead(layers: int = 16, repeats: int = 20, context: int = 48) -> float:
    """Seconds per decoder layer of the engine's op sequence (norms, RoPE, KV-cache write,
    attention, activations, residuals) beyond its GEMM calls: the tiny engine model's
    one-token forward, less its GEMM calls, per layer."""
    model = _tiny_engine_model(layers)
    cache = model.new_cache(1, 128)
    ids = torch.randint(4, 64, (1, context))
    with torch.inference_mode():
        model(ids, torch.arange(context).unsqueeze(0), cache, torch.tensor([context]))  # fill the cache
        pos = torch.tensor([[context]])
        lens = torch.tensor([context + 1])
        one = torch.randint(4, 64, (1, 1))
        per_layer = best_time(lambda: model(one, pos, cache, lens), repeats=repeats, warmup=5) / layers
        layer = model.layers[0]
        lins = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        xs = [torch.randn(1, 1, m.in_features, dtype=_engine_dtype()) for m in lins]
        gemms = best_time(lambda: [m(a) for m, a in zip(lins, xs)], repeats=repeats * 5, warmup=5)
    return max(0.0, per_layer - gemms)


def _best_of(rounds: list[dict]) -> tuple[float, dict, dict, float]:
    """Per figure, the best value over rounds (fastest time, highest rate)."""
    mem_bw = max(r["mem_bw"] for r in rounds)
    layer_overhead = min(r["layer_overhead"] for r in rounds)
    gemm_calls = {dt: [{**pt, "s_per_call": min(r["gemm_calls"][dt][i]["s_per_call"] for r in rounds)}
                       for i, pt in enumerate(first)]
                  for dt, first in rounds[0]["gemm_calls"].items()}
    attn_bw = {dt: {q: max(r["attn_bw"][dt][q] for r in rounds) for q in rounds[0]["attn_bw"][dt]}
               for dt in rounds[0]["attn_bw"]}
    stacks = {}
    for dt, first in rounds[0]["stacks"].items():
        times = {n: min(r["stacks"][dt]["forward_s"][n] for r in rounds) for n in first["forward_s"]}
        stacks[dt] = {"params": first["params"], "bytes_per_param": first["bytes_per_param"],
                      "forward_s": times,
                      "weight_bw": first["params"] * first["bytes_per_param"] / times["1"],
                      "flops": 2 * first["params"] * TOKENS[-1] / times[str(TOKENS[-1])]}
    return mem_bw, stacks, attn_bw, layer_overhead, gemm_calls


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure everything this many times and keep the best of each figure "
                             "(other jobs on a shared machine slow some runs down)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import resolve_dtype

    # bf16 only where the engine would run it (megatron_spec.isa): without native bf16 its matmuls are
    # 30-130x slower and oneDNN cannot pack them, so the profile then holds fp32 alone.
    dtypes = {name: getattr(torch, name) for name in dict.fromkeys((resolve_dtype("auto"), "float32"))}
    t0 = time.perf_counter()
    rounds = []
    for _ in range(args.rounds):
        rounds.append({
            "mem_bw": measure_mem_bw(),
            "stacks": {name: measure_linear_stack(dt) for name, dt in dtypes.items()},
            "attn_bw": {name: measure_attn_bw(dt) for name, dt in dtypes.items()},
            "gemm_calls": {name: measure_gemm_calls(dt) for name, dt in dtypes.items()},
            "layer_overhead": measure_layer_overhead(),
        })
    mem_bw, stacks, attn_bw, layer_overhead, gemm_calls = _best_of(rounds)
    fits = {dt: fit_gemm_calls(points) for dt, points in gemm_calls.items()}
    profile = {
        "name": "cpu",
        "source": "benchmarks/measure_cpu_profile.py",
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads, "memory_bytes": _memory_bytes(),
                    **cpu_facts()},
        "rounds": args.rounds,
        "mem_bw": mem_bw,
        "attn_bw": attn_bw,
        "weight_bw": {dt: fits[dt][1] for dt in stacks},
        "gemm_call_s": {dt: fits[dt][0] for dt in stacks},
        "flops": {dt: s["flops"] for dt, s in stacks.items()},
        "layer_overhead_s": layer_overhead,
        "linear_stack": stacks,
        "gemm_calls": gemm_calls,
        "measure_wall_s": time.perf_counter() - t0,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(profile, indent=2) + "\n")
    print(
        json.dumps(
            {
                "mem_bw_GBps": round(mem_bw / 1e9, 2),
                "attn_bw_GBps": {
                    dt: {q: round(b / 1e9, 2) for q, b in t.items()} for dt, t in attn_bw.items()
                },
                "weight_bw_GBps": {dt: round(fits[dt][1] / 1e9, 2) for dt in stacks},
                "gemm_call_us": {dt: round(fits[dt][0] * 1e6, 1) for dt in stacks},
                "gflops": {dt: round(s["flops"] / 1e9, 1) for dt, s in stacks.items()},
                "layer_overhead_us": round(layer_overhead * 1e6, 1),
                "bf16_verify4_over_decode1": (
                    round(stacks["bfloat16"]["forward_s"]["4"] / stacks["bfloat16"]["forward_s"]["1"], 3)
                    if "bfloat16" in stacks
                    else None
                ),
                **cpu_facts(),
                "dtype": resolve_dtype("auto"),
                "output": str(args.output),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
