"""``megatron-spec report RUN_DIR``: PNG plots and a Markdown summary of a GRPO run."""

from __future__ import annotations

import argparse
import sys

HELP = "plot a GRPO run's metrics (reward, acceptance, stage times, step time) and summarise it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's --save directory (holds metrics.jsonl)")
    p.add_argument("--baseline", default=None, help="a run of the same job without speculation, for comparison")


def run(args: argparse.Namespace) -> int:
    from megatron_spec.rl.report import write_report

    try:
        files = write_report(args.run_dir, args.baseline)
    except (FileNotFoundError, ValueError) as exc:
        print(f"megatron-spec report: error: {exc}", file=sys.stderr)
        return 2
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
