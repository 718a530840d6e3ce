"""``megatron-spec export-hf CHECKPOINT --out DIR``: a GRPO checkpoint's policy as an HF folder beside its
draft (``megatron_spec.rl.export``): what transformers, vLLM, SGLang and lm-eval load."""

from __future__ import annotations

import argparse
import sys

HELP = "write a GRPO checkpoint's policy as an HF folder (DIR/policy) beside its draft"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a run's --save folder (its latest complete checkpoint) or one iter_* folder"
    )
    parser.add_argument(
        "--out", required=True, help="the export folder: OUT/policy, OUT/<draft>, OUT/export.json"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the exported weights' dtype (default: the policy's own, fp32 unless trained with --bf16)",
    )


def run(args: argparse.Namespace) -> int:
    import os

    from megatron_spec.rl.export import ExportError, export_checkpoint

    try:
        it = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    except ExportError as exc:
        print(f"megatron-spec export-hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"megatron-spec export-hf: {it} -> {os.path.abspath(args.out)}", file=sys.stderr)
    print(os.path.join(os.path.abspath(args.out), "policy"))
    return 0
