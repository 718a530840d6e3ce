"""Measure this CPU's roofline figures for the simulator's ``cpu`` hardware profile.

What it measures, on ``--threads`` torch threads (2 by default, as the rollout engine runs):

* ``mem_bw``: bytes read + written per second by ``Tensor.copy_`` on 256 MiB buffers
  (the STREAM-copy convention: a copy of B bytes moves 2B).
* per dtype (bfloat16, float32), on a stack of ``nn.Linear`` layers of ~100M parameters:
  the time of one forward at 1, 2, 4, 8, 16, 32, 64 and 256 tokens. From it,
  ``weight_bw`` (weight bytes / time at 1 token: what decoding achieves when it streams the
  weights through a GEMV) and ``flops`` (2 * params * tokens / time at 256 tokens, the
  compute-bound end). The whole table is kept so the simulator's roofline can be checked
  against it (tests/sim/test_cpu_profile.py).
* ``attn_bw``: per dtype and per number of query tokens q (1, 2, 4, 8), K+V bytes / time of one
  ``scaled_dot_product_attention`` over 8192 cached positions (32 query heads, 8 KV heads,
  head_dim 128): how fast attention reads a KV cache when decoding (q=1) or verifying
  (q=k+1). On this CPU the bf16 path is far slower than the fp32 one and q>1 can be faster
  than q=1 (a different kernel): the table keeps what was measured.
* ``layer_overhead_s``: the wall time of one tiny (hidden 64) decoder layer in eager
  PyTorch: the per-layer launch cost that remains when no bytes or FLOPs are left.

It does not know the rollout engine: it measures kernels, not the engine's scheduler. The
engine benchmark (benchmarks/bench_rollout.py, when it exists) is what validates the
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
import time
from pathlib import Path

import sys

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUTPUT = REPO / "megatron_spec" / "sim" / "data" / "cpu_profile.json"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256)


def _best_time(fn, *, repeats: int, warmup: int = 3) -> float:
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
    t = _best_time(lambda: dst.copy_(src), repeats=repeats)
    return 2 * nbytes / t


def measure_linear_stack(dtype: torch.dtype, hidden: int = 4096, layers: int = 6,
                         repeats: int = 10) -> dict:
    """Forward time of ``layers`` bias-free [hidden, hidden] linears, per token count, with the
    rollout engine's own linear layer (megatron_spec.rollout.native.model.Linear: weights
    prepacked for oneDNN), so the profile describes the kernels the engine runs."""
    from megatron_spec.rollout.native.model import Linear

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        lin = Linear(hidden, hidden, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight_t.normal_(0.0, hidden ** -0.5)
        lin.pack()
        mods.append(lin)
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

            times[n] = _best_time(fwd, repeats=repeats if n <= 64 else 4)
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
            t = _best_time(lambda q=q: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           repeats=repeats)
            out[str(q_tokens)] = kv_bytes / t
    return out


class _TinyLayer(torch.nn.Module):
    """A decoder layer's op sequence at hidden 64: its time is launch overhead, not work."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.gate_up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, -1).transpose(1, 2)
        k = torch.cat([k_cache, k.view(b, t, self.heads, -1).transpose(1, 2)], dim=2)
        v = torch.cat([v_cache, v.view(b, t, self.heads, -1).transpose(1, 2)], dim=2)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def measure_layer_overhead(layers: int = 16, repeats: int = 20) -> float:
    torch.manual_seed(0)
    stack = [_TinyLayer() for _ in range(layers)]
    x = torch.randn(1, 1, 64)
    k_cache = torch.randn(1, 4, 16, 16)
    v_cache = torch.randn(1, 4, 16, 16)

    def fwd():
        h = x
        for layer in stack:
            h = layer(h, k_cache, v_cache)
        return h

    with torch.inference_mode():
        return _best_time(fwd, repeats=repeats, warmup=5) / layers


def _best_of(rounds: list[dict]) -> tuple[float, dict, dict, float]:
    """Per figure, the best value over rounds (fastest time, highest rate)."""
    mem_bw = max(r["mem_bw"] for r in rounds)
    layer_overhead = min(r["layer_overhead"] for r in rounds)
    attn_bw = {dt: {q: max(r["attn_bw"][dt][q] for r in rounds) for q in rounds[0]["attn_bw"][dt]}
               for dt in rounds[0]["attn_bw"]}
    stacks = {}
    for dt, first in rounds[0]["stacks"].items():
        times = {n: min(r["stacks"][dt]["forward_s"][n] for r in rounds) for n in first["forward_s"]}
        stacks[dt] = {"params": first["params"], "bytes_per_param": first["bytes_per_param"],
                      "forward_s": times,
                      "weight_bw": first["params"] * first["bytes_per_param"] / times["1"],
                      "flops": 2 * first["params"] * TOKENS[-1] / times[str(TOKENS[-1])]}
    return mem_bw, stacks, attn_bw, layer_overhead


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

    t0 = time.perf_counter()
    rounds = []
    for _ in range(args.rounds):
        rounds.append({
            "mem_bw": measure_mem_bw(),
            "stacks": {"bfloat16": measure_linear_stack(torch.bfloat16),
                       "float32": measure_linear_stack(torch.float32)},
            "attn_bw": {"bfloat16": measure_attn_bw(torch.bfloat16), "float32": measure_attn_bw(torch.float32)},
            "layer_overhead": measure_layer_overhead(),
        })
    mem_bw, stacks, attn_bw, layer_overhead = _best_of(rounds)
    profile = {
        "name": "cpu",
        "source": "benchmarks/measure_cpu_profile.py",
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads, "memory_bytes": _memory_bytes()},
        "rounds": args.rounds,
        "mem_bw": mem_bw,
        "attn_bw": attn_bw,
        "weight_bw": {dt: s["weight_bw"] for dt, s in stacks.items()},
        "flops": {dt: s["flops"] for dt, s in stacks.items()},
        "layer_overhead_s": layer_overhead,
        "linear_stack": stacks,
        "measure_wall_s": time.perf_counter() - t0,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({
        "mem_bw_GBps": round(mem_bw / 1e9, 2),
        "attn_bw_GBps": {dt: {q: round(b / 1e9, 2) for q, b in t.items()} for dt, t in attn_bw.items()},
        "weight_bw_GBps": {dt: round(s["weight_bw"] / 1e9, 2) for dt, s in stacks.items()},
        "gflops": {dt: round(s["flops"] / 1e9, 1) for dt, s in stacks.items()},
        "layer_overhead_us": round(layer_overhead * 1e6, 1),
        "bf16_verify4_over_decode1": round(stacks["bfloat16"]["forward_s"]["4"]
                                           / stacks["bfloat16"]["forward_s"]["1"], 3),
        "output": str(args.output),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
