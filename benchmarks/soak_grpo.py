"""Soak: a long GRPO run of the demo, checking that resident memory stays flat.

    python benchmarks/soak_grpo.py --base DIR --draft DIR [--steps 200] [--warmup 20]

Runs ``launch/pretrain_grpo_spec.py`` with the demo's config (speculative rollouts, online draft
training, checkpoints every 50 steps) for ``--steps`` steps and reads ``mem/rss_mb`` (the
trainer's resident set, sampled at the end of every step) from its metrics. Growth is measured
from the end of the warm-up (allocator pools, oneDNN primitive caches and optimizer state are
filled during the first steps) to the end of the run; the target is under 10%. Ends with one
JSON line: ``rss_after_warmup_mb``, ``rss_end_mb``, ``rss_max_mb``, ``growth_frac`` and the
least-squares slope in MiB per 100 steps after warm-up, and the engine's ``dtype`` and
``cpu_capability``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rollout_dtype(run_dir: str) -> str:
    """The engine dtype the run asked for (its saved config.yaml), before isa.resolve_dtype."""
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f) or {}
    return (cfg.get("rollout") or {}).get("rollout_dtype", "auto")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="policy HF checkpoint (e.g. runs/demo_tiny/base)")
    ap.add_argument("--draft", required=True, help="EAGLE-3 draft (e.g. runs/demo_tiny/eagle3)")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "soak"))
    ap.add_argument("--config", default=os.path.join(ROOT, "launch", "configs", "demo.yaml"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--port", type=int, default=29631)
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    if os.path.isdir(args.work_dir):
        shutil.rmtree(args.work_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={args.port}",
           os.path.join(ROOT, "launch", "pretrain_grpo_spec.py"), "--config", args.config,
           "--hf-checkpoint", args.base, "--spec-draft-kind", "eagle3", "--spec-draft-path", args.draft,
           "--spec-online-draft-training", "--train-iters", str(args.steps), "--save", args.work_dir,
           "--save-interval", "50", "--quiet"]
    print("[soak] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)

    import numpy as np

    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.telemetry import read_metrics, start_end_means

    rows = read_metrics(os.path.join(args.work_dir, "metrics.jsonl"))
    rss = [(r["step"], r["mem/rss_mb"]) for r in rows if r.get("mem/rss_mb") is not None]
    after = [(s, m) for s, m in rss if s >= args.warmup]
    if len(after) < 2:
        raise SystemExit(f"soak: only {len(after)} steps with mem/rss_mb after warm-up")
    start, end = after[0][1], after[-1][1]
    slope = float(np.polyfit([s for s, _ in after], [m for _, m in after], 1)[0])  # MiB per step
    reward_start, reward_end, _ = start_end_means(rows, "reward/mean")
    summary = {"steps": len(rows), "warmup": args.warmup, "rss_first_mb": round(rss[0][1], 1),
               "rss_after_warmup_mb": round(start, 1), "rss_end_mb": round(end, 1),
               "rss_max_mb": round(max(m for _, m in after), 1), "growth_frac": round(end / start - 1.0, 4),
               "slope_mb_per_100_steps": round(100 * slope, 2),
               "reward_first_fifth": round(reward_start, 3), "reward_last_fifth": round(reward_end, 3),
               "accept_length": round(sum(r["spec/accept_length"] for r in rows) / len(rows), 3),
               "dtype": resolve_dtype(_rollout_dtype(args.work_dir)), **cpu_facts()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
