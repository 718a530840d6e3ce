"""``megatron-spec report RUN_DIR``: PNG plots and a Markdown summary of a GRPO run."""

from __future__ import annotations

import argparse
import sys

HELP = "plot a GRPO run's metrics (reward, acceptance, stage times, step time) and summarise it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's --save directory (holds metrics.jsonl)")
    p.add_argument(
        "--baseline", default=None, help="a run of the same job without speculation, for comparison"
    )
    p.add_argument("--compare", default=None, metavar="RUN_DIR",
                   help="another speculative run of the same job (e.g. frozen vs online draft): both runs' "
                        "acceptance length per step on one figure, report/acceptance_compare.png")
    p.add_argument(
        "--labels",
        default=None,
        metavar="THIS,OTHER",
        help="legend names of RUN_DIR and the --compare run (default: online draft / frozen draft, "
        "from their metrics)",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_spec.rl.report import write_report

    labels = None
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if args.compare is None or len(labels) != 2 or not all(labels):
            print("megatron-spec report: error: --labels takes two names, THIS,OTHER, and needs --compare",
                  file=sys.stderr)
            return 2
    try:
        files = write_report(args.run_dir, args.baseline, compare_dir=args.compare, labels=labels)
    except (FileNotFoundError, ValueError) as exc:
        print(f"megatron-spec report: error: {exc}", file=sys.stderr)
        return 2
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
