"""The native engine's panels on huge pages against the same engine without them, and the A/A check of the
lockstep runner (``_lockstep.py``) that found them.

    python benchmarks/bench_huge_pages.py [--model smollm2] [--dtypes auto,float32] [--batch-sizes 1,16]
        [--rounds 3] [--engines 4]

Per dtype and batch size, ``--engines`` identical plain-decoding engines of the real model are built one after
the other in this process, every other one with ``MEGATRON_SPEC_NO_HUGE_PAGES=1`` (so ``on``, ``off``, ``on``,
``off``: each kind built both early and late), and step in turn through ``run_in_turn`` (each on its own
clock), led by each engine in turn, on the 16 chat prompts of ``bench_vs_vllm.py`` (64 greedy tokens each).
Round 0 warms up and is not counted. Keys (``{dtype}_b{B}``):

  * ``huge_pages_speedup``: the paired median over rounds of (the ``on`` engines' mean tokens/s) / (the
    ``off`` engines' mean);
  * ``aa_on`` / ``aa_off``: the last-built engine of a kind over the first-built one, the paired median: 1
    where the runner treats identical engines alike. Before the panels moved (session 56), the first engine
    built in a process read 0.85-0.93 of its twins here, every round (bf16, one row).

The JSON line says which CPU kind, kernels, allocator and huge-page setting ran (``cpu_facts``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(model: str, dtype: str, b: int, max_len: int, count: int) -> dict:
    """``count`` plain engines, ``on0``, ``off0``, ``on1``, ... in build order; the ``off`` ones built with
    huge pages turned off (the switch is read when an engine places its panels)."""
    from bench_vs_vllm import OurEngine
    from megatron_spec.host_memory import NO_HUGE_PAGES_ENV

    engines, before = {}, os.environ.get(NO_HUGE_PAGES_ENV)
    try:
        for i in range(count):
            kind = "on" if i % 2 == 0 else "off"
            os.environ[NO_HUGE_PAGES_ENV] = "0" if kind == "on" else "1"
            eng = OurEngine(model, dtype, b, max_len, "none", None, 2)
            moved = eng.srv.info()["panels_on_huge_pages_mb"]
            if (moved > 0) != (kind == "on"):
                raise RuntimeError(f"engine {i} ({kind}) moved {moved} MB of panels to huge pages")
            engines[f"{kind}{i // 2}"] = eng
    finally:
        if before is None:
            os.environ.pop(NO_HUGE_PAGES_ENV, None)
        else:
            os.environ[NO_HUGE_PAGES_ENV] = before
    return engines


def rounds_of(engines: dict, prompts, new_tokens: int, rounds: int, tag: str) -> dict[str, list[float]]:
    """tokens/s of every engine in every counted round (round 0 warms up), stepped in turn."""
    from _lockstep import run_in_turn

    names = list(engines)
    speed: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        lead = r % len(names)
        got = run_in_turn({n: engines[n].start(prompts, new_tokens) for n in names[lead:] + names[:lead]})
        line = []
        for n in names:
            wall, out = engines[n].finish(*got[n][:2])
            rate = sum(map(len, out)) / wall
            if r:
                speed[n].append(rate)
            line.append(f"{n} {rate:.1f}")
        print(f"[{tag}] round {r}: " + ", ".join(line), file=sys.stderr, flush=True)
    return speed


def keys(speed: dict[str, list[float]], tag: str) -> dict:
    """The speed-up of the ``on`` engines over the ``off`` ones and the two A/A ratios (module docstring)."""
    def of(kind: str) -> list[str]:
        return [n for n in speed if n.startswith(kind)]

    def mean_per_round(names: list[str]) -> list[float]:
        return [statistics.fmean(speed[n][r] for n in names) for r in range(len(speed[names[0]]))]

    def paired(a: list[float], b: list[float]) -> float:
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)

    out = {f"huge_pages_speedup_{tag}": paired(mean_per_round(of("on")), mean_per_round(of("off"))),
           f"tokens_per_s_{tag}": {n: round(max(v), 1) for n, v in speed.items()}}
    for kind in ("on", "off"):
        names = of(kind)
        if len(names) > 1:
            out[f"aa_{kind}_{tag}"] = paired(speed[names[-1]], speed[names[0]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"),
                    help="where the held-out questions are kept (bench_vs_vllm.py's)")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", type=int, default=4, help="engines per cell, on and off in turn (>= 2)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.engines < 2 or args.rounds < 1:
        ap.error("--engines must be >= 2 and --rounds >= 1")

    from transformers import AutoTokenizer

    from _real_model import chat_prompts
    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.models.fetch import resolve_model

    model = resolve_model(args.model, log=lambda m: print(f"[setup] {m}", file=sys.stderr))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model), args.work_dir, args.prompts, seed=11)
    max_len = max(map(len, prompts)) + args.new_tokens
    result: dict = {"model": args.model, **cpu_facts(), "engines": args.engines, "rounds": args.rounds}
    for dtype in dict.fromkeys(resolve_dtype(d.strip()) for d in args.dtypes.split(",")):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            tag = f"{dtype}_b{b}"
            engines = build(model, dtype, b, max_len, args.engines)
            result.update(keys(rounds_of(engines, prompts, args.new_tokens, args.rounds, tag), tag))
            for eng in engines.values():
                eng.close()
            cell = {k: v for k, v in result.items() if k.endswith(tag)}
            print(json.dumps(cell), file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
