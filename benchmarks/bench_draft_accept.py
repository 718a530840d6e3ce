"""Two or more EAGLE-3 drafts of the same target, compared where it counts: the engine's acceptance.

The held-out evaluation (``Eagle3Trainer.evaluate``) scores a draft on cached answers; this runs the
native engine itself on the benchmarks' interpolate chat prompts (``_real_model.chat_prompts``) at T=1
with a fixed k, the drafts alternated round by round with the same sampling seed per round, and prints
each draft's tokens per verify step (``mean_accept_length``) per round and the paired differences from
the first draft. Whole answers (EOS ends them) unless ``--ignore-eos``.

    python benchmarks/bench_draft_accept.py --drafts OLD,NEW [--prompts 128] [--rounds 2]  # ~4.5 min a
    draft, round

Measured with it: docs/draft_training.md, "Training for acceptance".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _real_model import ROOT, chat_prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", required=True, help="comma-separated ModelOpt EAGLE-3 exports of the target")
    ap.add_argument("--model", default="smollm2", help="megatron-spec fetch-model name, HF folder or Hub id")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-new-tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args(argv)
    drafts = [d for d in args.drafts.split(",") if d]
    missing = [d for d in drafts if not os.path.isfile(os.path.join(d, "config.json"))]
    if len(drafts) < 2 or missing:
        ap.error(
            f"--drafts needs two or more ModelOpt exports (a folder with config.json); not one: {missing}"
        )
    if args.prompts < 1 or args.rounds < 1 or args.k < 1:
        ap.error("--prompts, --rounds and --k must be >= 1")

    from transformers import AutoTokenizer

    from megatron_spec.isa import resolve_dtype
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    target = resolve_model(args.model, log=lambda m: print(f"[setup] {m}", file=sys.stderr, flush=True))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), args.work_dir, args.prompts, seed=11)
    dtype = resolve_dtype(args.dtype)
    sp = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos
    )
    reqs = [GenerateRequest(str(i), tuple(p), sp) for i, p in enumerate(prompts)]
    per = {d: [] for d in drafts}
    for r in range(args.rounds):
        for d in drafts:  # one engine at a time: the cores are the drafts' only shared resource
            srv = EngineServer(
                EngineConfig(
                    model_path=target,
                    draft_kind="eagle3",
                    draft_path=d,
                    num_draft_tokens=args.k,
                    dtype=dtype,
                    max_batch_size=args.batch_size,
                    context_length=max(map(len, prompts)) + args.max_new_tokens,
                )
            )
            t0 = time.perf_counter()
            _, st = srv.generate(reqs, seed=args.seed + r)
            del srv
            per[d].append(st.mean_accept_length)
            print(
                f"round {r} {d}: {st.mean_accept_length:.4f} tokens per verify step "
                f"({st.num_verify_steps} steps, {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    first = per[drafts[0]]
    print(
        json.dumps(
            {
                "k": args.k,
                "temperature": args.temperature,
                "prompts": args.prompts,
                "dtype": str(dtype),
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": args.ignore_eos,
                "accept_length": {d: [round(x, 4) for x in v] for d, v in per.items()},
                "accept_length_mean": {d: round(statistics.mean(v), 4) for d, v in per.items()},
                "paired_gain_over_first": {
                    d: [round(a - b, 4) for a, b in zip(v, first)] for d, v in per.items() if d != drafts[0]
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())
