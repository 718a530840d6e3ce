"""``megatron-spec info``: what this installation can do (versions, kernels, CPU shim)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json

HELP = "print versions, the active op implementation and whether the CPU shim is needed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_spec import __version__
    from megatron_spec._ext import compiled_ops_available
    from megatron_spec.compat import compat_active

    facts = {
        "megatron_spec": __version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "megatron_core": _version("megatron-core"),
        "nvidia_modelopt": _version("nvidia-modelopt"),
        "transformers": _version("transformers"),
        "sglang": _version("sglang"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "compiled_ops": compiled_ops_available(),
        "megatron_cpu_shim": compat_active(),
    }
    if args.json:
        print(json.dumps(facts))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 0
