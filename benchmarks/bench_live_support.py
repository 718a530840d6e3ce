"""What the live group index's proposals are worth, replayed on the target's own sibling answers (issue 31).

The native engine generates G samples per prompt at T=1 (plain decoding: the answers are the target's),
then each group is replayed in lockstep: at every position every row's token enters its group's
``LiveIndex``, and every row asks for a proposal of up to k tokens. A point-mass draft x is accepted with
probability p(x), the probability that the target's own token is x, so "the proposal's first m tokens
equal what the row wrote next" has the distribution of m accepted drafts (what the engine's
``unused_history_observation`` learns from). Printed:

* tokens accepted per proposal, the continuation most sibling texts wrote (``LiveIndex.propose``, with
  ``max_candidates`` texts) against the newest occurrence's alone (``max_candidates`` 1: the index before
  the sibling support);
* per sibling-support class (``measures.support_class``: unanimous among 1, 2, 3+ texts, a majority, a
  minority; first position or later), how often its tokens were accepted: what ``SupportStats`` learns
  online in the engine.

    python benchmarks/bench_live_support.py [--prompts 32] [--samples 8] [--new-tokens 96]   # ~1.5 min here
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _real_model import ROOT, chat_prompts

CLASS_NAMES = ["1 of 1", "2 of 2", "3+ of 3+", "majority", "minority"]


def generate(
    model: str, work: str, prompts: int, samples: int, new_tokens: int, seed: int
) -> list[list[list[int]]]:
    """``prompts`` held-out chat prompts x ``samples`` T=1 answers each from the native engine (plain
    decoding)."""
    import torch
    from transformers import AutoTokenizer

    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    torch.set_num_threads(2)
    path = resolve_model(model, log=lambda m: print(m, file=sys.stderr))
    ps = chat_prompts(AutoTokenizer.from_pretrained(path), work, prompts, seed)
    srv = EngineServer(
        EngineConfig(
            model_path=path,
            draft_kind="none",
            dtype="auto",
            max_batch_size=2 * samples,
            context_length=max(map(len, ps)) + new_tokens,
            num_threads=2,
        )
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    out, _ = srv.core.generate(
        [GenerateRequest(str(i), p, sp, n=samples) for i, p in enumerate(ps)], seed=seed
    )
    groups: dict[str, list[list[int]]] = defaultdict(list)
    for s in out:
        groups[s.request_id].append(list(s.output_ids))
    return [[ps[int(i)]] + groups[i] for i in sorted(groups, key=int)]


def replay(groups: list[list[list[int]]], k: int, candidates: int) -> dict:
    """Lockstep replay of every group (first entry its prompt, then its answers)."""
    from megatron_spec.rollout.native.measures import SUPPORT_CLASSES, SupportStats
    from megatron_spec.speculative.live import LiveIndex

    accepted = {"majority": [], "newest": []}
    classes = SupportStats()  # what the engine learns online, here from the whole replay
    for g, (prompt, *rows) in enumerate(groups):
        ix = LiveIndex(max_candidates=candidates)
        for r in range(len(rows)):
            ix.start(g, r, prompt)
        for t in range(max(map(len, rows))):
            for r, toks in enumerate(rows):
                if t < len(toks):
                    ix.append(g, r, [toks[t]])
            for r, toks in enumerate(rows):
                truth = toks[t + 1:t + 1 + k]
                if not truth:
                    continue
                for name, cap in (("newest", 1), ("majority", candidates)):
                    ix.max_candidates = cap
                    prop, _, support = ix.propose_with_support(g, r, k)
                    if not prop:
                        continue
                    m = 0
                    while m < min(len(prop), len(truth)) and prop[m] == truth[m]:
                        m += 1
                    accepted[name].append(m)
                    # as the engine's unused_history_observation: positions 0..m observed
                    if name == "majority":
                        classes.record_proposal(support, min(len(prop), len(truth)), m)
    return {
        "proposals": {n: len(v) for n, v in accepted.items()},
        "accepted_per_proposal": {n: round(sum(v) / max(1, len(v)), 3) for n, v in accepted.items()},
        "first_token_accepted": {
            n: round(sum(1 for x in v if x) / max(1, len(v)), 3) for n, v in accepted.items()
        },
        "support_classes": {
            f"{CLASS_NAMES[c // 2]}, {'first' if c % 2 == 0 else 'later'}": {
                "accepted": round(classes.accepted[c] / classes.tried[c], 3) if classes.tried[c] else None,
                "tried": int(classes.tried[c]),
            }
            for c in range(SUPPORT_CLASSES)
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="megatron-spec fetch-model name, HF folder or Hub id")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="answers per prompt (the GRPO group)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument(
        "--k", type=int, default=10, help="longest proposal (the engine's --history-max-draft-tokens)"
    )
    ap.add_argument(
        "--candidates", type=int, default=16, help="LiveIndex max_candidates of the majority proposals"
    )
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    if min(args.prompts, args.samples, args.new_tokens, args.k, args.candidates) < 1:
        ap.error("--prompts, --samples, --new-tokens, --k and --candidates must be >= 1")
    groups = generate(args.model, args.work_dir, args.prompts, args.samples, args.new_tokens, args.seed)
    res = replay(groups, args.k, args.candidates)
    print(f"{'proposal':<10}{'count':>8}{'accepted / proposal':>22}{'first accepted':>16}")
    for n in ("newest", "majority"):
        print(f"{n:<10}{res['proposals'][n]:>8}{res['accepted_per_proposal'][n]:>22.3f}{res['first_token_accepted'][n]:>16.3f}")
    print(f"\n{'support class (majority proposals)':<36}{'accepted':>10}{'tried':>8}")
    for name, v in res["support_classes"].items():
        print(
            f"{name:<36}{'-' if v['accepted'] is None else format(v['accepted'], '.3f'):>10}{v['tried']:>8}"
        )
    res.update(
        model=args.model,
        prompts=args.prompts,
        samples=args.samples,
        new_tokens=args.new_tokens,
        k=args.k,
        majority_over_newest=round(
            res["accepted_per_proposal"]["majority"] / max(1e-9, res["accepted_per_proposal"]["newest"]), 3
        ),
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
