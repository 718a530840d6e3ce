"""The engine's fp32 RMSNorm and RoPE: the extension's one-pass kernels against torch's ops (issue 30).

    python benchmarks/bench_norm_rope.py [--repeats 500] [--rounds 4] [--no-engine]

Ops: ``megatron_spec::rms_norm_f32`` against ``torch.rms_norm`` (a composite of five ops on the CPU in
torch 2.13) on SmolLM2's rows (576 features: decode, verify, a 1024-row prefill) and Qwen3-style per-head
norms; ``megatron_spec::rope_f32`` against the six ops of ``layers.decoder.rotate`` on the transposed
query/key view the engine rotates (12 heads of 64: SmolLM2's 9 query and 3 key heads at once). Mean
microseconds over ``--repeats`` calls after 20 warm-up calls, the two alternated per shape.

Engine: the native engine on the real model (SmolLM2-135M-Instruct, greedy, 64 new tokens, 2B held-out
chat prompts at max batch B = 1 and 16) and on the demo's model when ``runs/bench_grpo/base`` exists
(T=1, 16 prompts x 8 samples, batch 16), with the kernels on and off (``layers.decoder``'s switch) in
alternating order round by round in one process: tokens/s is each side's best round, the ratio the
median of the paired per-round ratios (``bench_rollout.paired_ratio``); the greedy outputs are compared.
Prints markdown tables and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

NORM_SHAPES = [(1, 576), (16, 576), (64, 576), (1024, 576), (16, 12, 64)]
ROPE_SHAPES = [(1, 12, 1, 64), (16, 12, 1, 64), (16, 12, 4, 64), (1, 12, 512, 64)]


def mean_us(fn, repeats: int, *args) -> float:
    for _ in range(20):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t0) / repeats * 1e6


def torch_rms_norm(x, w):
    return torch.rms_norm(x, (x.shape[-1],), w, 1e-5)


def torch_rotate(x, cos, sin):
    """``layers.decoder.rotate``'s torch arithmetic (what it ran before the kernel)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def ops(repeats: int) -> dict:
    from megatron_spec.layers.decoder import rotate

    out = {}
    print("| op, shape | kernel, us | torch, us | torch / kernel |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for shape in NORM_SHAPES:
        x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
        n = max(20, repeats // 20) if shape[0] >= 512 else repeats
        k = mean_us(torch.ops.megatron_spec.rms_norm_f32, n, x, w, 1e-5)
        t = mean_us(torch_rms_norm, n, x, w)
        out[f"rms_norm_{'x'.join(map(str, shape))}"] = {"kernel_us": round(k, 2), "torch_us": round(t, 2)}
        print(f"| rms_norm {list(shape)} | {k:.1f} | {t:.1f} | {t / k:.1f} |")
    for b, nh, t_, d in ROPE_SHAPES:
        x = torch.randn(b, t_, nh, d, generator=g).transpose(1, 2)
        cos, sin = torch.randn(b, 1, t_, d, generator=g), torch.randn(b, 1, t_, d, generator=g)
        n = max(20, repeats // 20) if t_ >= 256 else repeats
        k = mean_us(torch.ops.megatron_spec.rope_f32, n, x, cos, sin)
        t = mean_us(torch_rotate, n, x, cos, sin)
        assert torch.equal(rotate(x, cos, sin), torch_rotate(x, cos, sin))
        out[f"rope_{b}x{nh}x{t_}x{d}"] = {"kernel_us": round(k, 2), "torch_us": round(t, 2)}
        print(f"| rope [{b}, {nh}, {t_}, {d}] | {k:.1f} | {t:.1f} | {t / k:.1f} |")
    return out


def engine_ab(name: str, path: str, requests, batch: int, context: int, rounds: int, threads: int) -> dict:
    from bench_rollout import paired_ratio
    from megatron_spec.layers import decoder
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer

    srv = EngineServer(EngineConfig(model_path=path, max_batch_size=batch, context_length=context,
                                    num_threads=threads))

    def run(on: bool) -> tuple:
        decoder._KERNELS["rope_f32"] = on
        samples, st = srv.core.generate(requests, seed=0)
        return st, [s.output_ids for s in samples]

    try:
        run(True), run(False)  # warm-up
        stats, outs = {True: [], False: []}, {}
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                st, outs[on] = run(on)
                stats[on].append(st)
    finally:
        decoder._KERNELS.pop("rope_f32", None)
    res = {"kernels_tokens_per_s": round(max(st.tokens_per_s for st in stats[True]), 1),
           "torch_tokens_per_s": round(max(st.tokens_per_s for st in stats[False]), 1),
           "kernels_over_torch": round(paired_ratio(stats[True], stats[False]), 3),
           "same_tokens": outs[True] == outs[False]}
    print(f"| {name} | {res['kernels_tokens_per_s']} | {res['torch_tokens_per_s']} | "
          f"**{res['kernels_over_torch']}** | {res['same_tokens']} |", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import megatron_spec.ops  # noqa: F401  (registers the fake kernels)
    from megatron_spec.layers.decoder import norm_rope_kernels_available

    if not norm_rope_kernels_available():
        ap.error(
            "the extension (megatron_spec._C) is not built with rms_norm_f32 / rope_f32: nothing to compare"
        )
    result: dict = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads}
    with torch.inference_mode():
        result["ops"] = ops(args.repeats)
    if args.engine:
        import transformers

        from _real_model import chat_prompts
        from megatron_spec.models.fetch import resolve_model
        from megatron_spec.rollout.types import GenerateRequest, SamplingParams

        print("\n| engine | kernels, tokens/s | torch ops, tokens/s | kernels / torch | same tokens |\n"
              "|---|---|---|---|---|")
        path = resolve_model(args.model)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
        for b in (1, 16):
            reqs = [GenerateRequest(str(i), p, greedy)
                    for i, p in enumerate(chat_prompts(tok, args.work_dir, 2 * b, seed=5))]
            result[f"{args.model}_b{b}"] = engine_ab(f"{args.model}, fp32, B={b}, greedy", path, reqs, b, 320,
                                                     args.rounds, args.threads)
        demo = os.path.join(ROOT, "runs", "bench_grpo", "base")
        if os.path.isfile(os.path.join(demo, "config.json")):
            rng = random.Random(0)
            with open(os.path.join(demo, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            sampled = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
            reqs = [GenerateRequest(str(i), [rng.randrange(4, vocab) for _ in range(20)], sampled, n=8)
                    for i in range(16)]
            result["demo_b16"] = engine_ab("demo model (8 layers, 256 wide), T=1, B=16", demo, reqs, 16, 128,
                                           args.rounds, args.threads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
