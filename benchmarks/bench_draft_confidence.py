"""Could each row's draft length follow the draft's own confidence? What it would give at batch B (issue 30).

    python benchmarks/bench_draft_confidence.py [--model smollm2] [--draft DIR] [--batch-size 16]
        [--prompts 48] [--new-tokens 64] [--temperatures 0,1]

The engine runs EAGLE-3 at k=3 on ``--prompts`` chat prompts (batch B); from outside (wrapping the
drafter's ``draw`` and the speculative worker's ``_account``) it records, for every row of every verify step,
the
draft's probability of each token it drafted (its softmax, before any sampling processing: what a
policy could read before verifying) and how many drafts the target accepted. Then, under costs timed
on the same model (forwards of B x t tokens, t = 1..4, ``bench_vs_vllm.verify_seconds``; the
proposal's seconds per k from the engine's own timing), it replays the same steps under each policy:

* fixed k = 0..3 (k = 0: plain decoding, the reference);
* a per-row cut: row b keeps drafts 1..j while the product of its confidences stays >= a threshold
  (truncating a chain by the draft's own numbers is exact: the length depends only on the draft);
  the draft runs until every row's chain is cut (one pass past the longest kept chain, up to k);
* the oracle: each row verifies exactly the drafts the target will accept (the ceiling of any
  per-row length policy with this draft).

A step costs ``V(B + kept drafts) + P_K`` (K the longest kept chain; a line through the timed
forwards) and emits ``sum(1 + min(a, kept))``. Rates are over plain decoding's ``B / V(B)``. Prints the
calibration (acceptance per confidence bin and position) and the policies' ratios; ends with one JSON
line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

BINS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0001)
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def record_steps(srv, reqs, seed: int) -> tuple[list[list[tuple[list[float], int]]], float]:
    """Per verify step that drafted, per row: (the draft's confidence in each drafted token, drafts
    accepted); and the mean seconds of the drafter's proposal of k tokens."""
    from megatron_spec.rollout.native import drafters, spec_worker

    confs: list[list[float]] = []
    steps: list[list[tuple[list[float], int]]] = []
    propose_s: list[float] = []
    orig_draw, orig_account = drafters.draw, spec_worker.SpeculativeWorker._account

    def draw(logits, sampling, generator):
        d, q = orig_draw(logits, sampling, generator)
        confs.append(torch.softmax(logits.float(), -1).gather(1, d.view(-1, 1))[:, 0].tolist())
        return d, q

    def account(self, rows, prop, ver, emitted, accepted, stats, t0, **kw):
        k = prop.k
        if k > 0 and prop.main_ran and len(confs) >= k:
            c = confs[-k:]
            steps.append([([c[j][i] for j in range(k)], a) for i, a in enumerate(accepted)])
            propose_s.append(prop.t_main)
        confs.clear()
        return orig_account(self, rows, prop, ver, emitted, accepted, stats, t0, **kw)

    drafters.draw, spec_worker.SpeculativeWorker._account = draw, account
    try:
        srv.core.generate(reqs, seed=seed)
    finally:
        drafters.draw, spec_worker.SpeculativeWorker._account = orig_draw, orig_account
    return steps, float(np.median(propose_s)) if propose_s else 0.0


def replay(steps, keep_fn, line, proposal, k: int | None = None) -> float:
    """Tokens per second of the recorded steps when row i of a step keeps ``keep_fn(conf, a)`` drafts.
    The draft runs as many passes as the longest kept chain, or, with ``k`` (a policy reading the
    draft's confidences), one more, up to k: a chain is cut only once its next token's confidence is known."""
    tokens = seconds = 0.0
    for rows in steps:
        keep = [keep_fn(c, a) for c, a in rows]
        tokens += sum(1 + min(a, n) for (_, a), n in zip(rows, keep))
        passes = max(keep) if k is None else min(k, max(keep) + 1)
        seconds += line(len(rows) + sum(keep)) + proposal(passes)
    return tokens / seconds


def analyse(steps, line, proposal, k: int) -> dict:
    plain = sum(len(r) for r in steps) / sum(line(len(r)) for r in steps)
    out: dict = {"row_steps": sum(len(r) for r in steps)}
    out["fixed_over_ar"] = {j: round(replay(steps, lambda c, a, j=j: j, line, proposal) / plain, 3)
                            for j in range(k + 1)}
    out["oracle_over_ar"] = round(replay(steps, lambda c, a: a, line, proposal) / plain, 3)

    def cut(th):
        def keep(c, a):
            n, p = 0, 1.0
            for x in c:
                p *= x
                if p < th:
                    break
                n += 1
            return n
        return keep

    out["cut_over_ar"] = {
        th: round(replay(steps, cut(th), line, proposal, k) / plain, 3) for th in THRESHOLDS
    }
    conf = np.array([c for rows in steps for c, _ in rows])
    acc = np.array([a for rows in steps for _, a in rows])
    cum = np.cumprod(conf, axis=1)
    calib = {}
    for j in range(k):
        row = {}
        for lo, hi in itertools.pairwise(BINS):
            m = (cum[:, j] >= lo) & (cum[:, j] < hi)
            row[f"{lo:.1f}-{min(hi, 1.0):.1f}"] = (
                int(m.sum()),
                round(float((acc[m] > j).mean()), 3) if m.any() else None,
            )
        calib[j + 1] = row
    out["calibration"] = calib
    out["accept_at_least"] = [round(float((acc > j).mean()), 3) for j in range(k)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--draft", default=os.path.join(ROOT, "runs", "bench_rollout", "smollm2-135m-instruct", "eagle3")
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from _real_model import chat_prompts
    from bench_rollout import cost_line
    from bench_vs_vllm import OurEngine, verify_seconds
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    model = resolve_model(args.model)
    b, k = args.batch_size, args.k
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model), args.work_dir, args.prompts, seed=11)
    max_len = max(map(len, prompts)) + args.new_tokens + 2 * k + 2
    t0 = time.perf_counter()
    plain = OurEngine(model, "float32", b, max_len, "none", None, args.threads)
    spec = OurEngine(model, "float32", b, max_len, "eagle3", args.draft, args.threads, num_draft_tokens=k)
    result: dict = {"model": args.model, "batch": b, "k": k, "prompts": args.prompts, "per_temperature": {}}
    for temp in (float(x) for x in args.temperatures.split(",")):
        sp = SamplingParams(temperature=temp, max_new_tokens=args.new_tokens, ignore_eos=True)
        reqs = [GenerateRequest(str(i), p, sp) for i, p in enumerate(prompts)]
        spec.srv.core.generate(reqs[:2], seed=1)  # warm-up
        steps, p_k = record_steps(spec.srv, reqs, seed=0)
        points = verify_seconds(plain, b, list(range(1, k + 2)))
        line = cost_line(points)
        per_pass = p_k / k

        def proposal(n, d=per_pass):
            return d * n

        r = analyse(steps, line, proposal, k)
        r["verify_ms"] = {n: round(1e3 * v, 1) for n, v in points.items()}
        r["proposal_ms_k"] = round(1e3 * p_k, 2)
        result["per_temperature"][temp] = r
        print(f"\nT={temp}: {r['row_steps']} row-steps, accepted >= j: {r['accept_at_least']}, verify ms "
              f"{r['verify_ms']}, proposal of {k} {r['proposal_ms_k']} ms", file=sys.stderr)
        print(f"\n### T={temp}, B={b}\n\n| policy | over plain decoding |\n|---|---|")
        for j, v in r["fixed_over_ar"].items():
            print(f"| fixed k={j} | {v} |")
        for th, v in r["cut_over_ar"].items():
            print(f"| cut at confidence product {th} | {v} |")
        print(f"| oracle (verifies exactly the accepted drafts) | {r['oracle_over_ar']} |")
        print("\n| position | " + " | ".join(r["calibration"][1]) + " |\n" + "|---" * len(BINS) + "|")
        for j, row in r["calibration"].items():
            print(
                f"| {j} | "
                + " | ".join(f"{a} (n={n})" if a is not None else "-" for n, a in row.values())
                + " |"
            )
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
