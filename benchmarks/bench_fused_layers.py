"""The native engine's decoder layers run from C++ (``megatron_spec::decoder_layers``, csrc/decoder_cpu.cpp)
against the same layers in Python (issue 30).

    python benchmarks/bench_fused_layers.py [--dtypes auto,float32] [--batch-sizes 1,16] [--rounds 4]

On the real model (SmolLM2-135M-Instruct): the native engine, greedy, 64 new tokens, 2B held-out chat prompts
at max batch B, with the C++ layers on and off (``fused_layers.FUSED_LAYERS``) in alternating order round by
round in one process, and in fp32 (where ``--rollout-compile`` compiles) also the compiled layer, a second
engine in the same rounds. tokens/s is each side's best round, a ratio the median of the paired per-round
ratios (``bench_rollout.paired_ratio``); the greedy outputs are compared (the C++ layers must give the same
tokens). Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def compare(dtype: str, batch: int, path: str, requests, rounds: int, threads: int, context: int) -> dict:
    from bench_rollout import paired_ratio
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native import warm_up
    from megatron_spec.rollout.native.server import EngineServer
    from profile_engine_step import python_layers

    def server(compile_: bool) -> EngineServer:
        saved = warm_up.compiling_pays
        # compiled even where the C++ layers run (to compare them)
        warm_up.compiling_pays = lambda _dtype: True
        try:
            return EngineServer(EngineConfig(model_path=path, dtype=dtype, max_batch_size=batch,
                                             context_length=context, num_threads=threads, compile=compile_))
        finally:
            warm_up.compiling_pays = saved

    eager = server(False)
    sides = {"cpp": (eager, True), "python": (eager, False)}
    if dtype == "float32":
        sides["compiled"] = (server(True), True)

    def run(name: str):
        srv, fused = sides[name]
        with contextlib.nullcontext() if fused else python_layers():
            samples, st = srv.core.generate(requests, seed=0)
        return st, [s.output_ids for s in samples]

    names = list(sides)
    for n in names:  # warm-up (and the compiled engine's first graphs)
        run(n)
    stats: dict[str, list] = {n: [] for n in names}
    outs: dict[str, list] = {}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            st, outs[n] = run(n)
            stats[n].append(st)
    res = {f"{n}_tokens_per_s": round(max(s.tokens_per_s for s in stats[n]), 1) for n in names}
    res["cpp_over_python"] = round(paired_ratio(stats["cpp"], stats["python"]), 3)
    if "compiled" in stats:
        res["cpp_over_compiled"] = round(paired_ratio(stats["cpp"], stats["compiled"]), 3)
    res["same_tokens"] = all(outs[n] == outs["python"] for n in names)
    print(
        f"| {dtype}, B={batch} | {res['cpp_tokens_per_s']} | {res['python_tokens_per_s']} | "
        f"{res.get('compiled_tokens_per_s', '')} | **{res['cpp_over_python']}** | "
        f"{res.get('cpp_over_compiled', '')} | "
        f"{res['same_tokens']} |",
        flush=True,
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from _real_model import chat_prompts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.layers.fused_layers import fused_layers_available
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    path = resolve_model(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    result: dict = {"model": args.model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": args.threads}
    print(
        "| engine | C++ layers, tokens/s | Python layers | compiled layer | C++ / Python | C++ / compiled | "
        "same tokens |\n"
        "|---|---|---|---|---|---|---|"
    )
    for dtype in dict.fromkeys(resolve_dtype(d) for d in args.dtypes.split(",")):
        if not fused_layers_available(getattr(torch, dtype)):
            print(f"[skip] {dtype}: the extension's kernels for it do not all run here", file=sys.stderr)
            continue
        for b in (int(x) for x in args.batch_sizes.split(",")):
            prompts = chat_prompts(tok, args.work_dir, 2 * b, seed=5)
            reqs = [GenerateRequest(str(i), p, greedy) for i, p in enumerate(prompts)]
            result[f"{dtype}_b{b}"] = compare(dtype, b, path, reqs, args.rounds, args.threads,
                                              max(map(len, prompts)) + 80)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
