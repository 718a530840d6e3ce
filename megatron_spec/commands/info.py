"""``megatron-spec info``: what this installation can do (versions, kernels, CPU shim) and what this
CPU can do (its model, the ISA torch and the compiled kernels run, and the engine dtype ``auto`` picks:
``megatron_spec.isa``)."""

from __future__ import annotations

import argparse
import json

HELP = "print versions, the CPU and the dtype auto picks on it, the active op implementation and the CPU shim"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_spec import __version__, _ext
    from megatron_spec.compat import compat_active
    from megatron_spec.compat.fallbacks import fallback_line
    from megatron_spec.compat.fallbacks import installed_version as _version
    from megatron_spec.host_memory import huge_pages, setting
    from megatron_spec.isa import probe, resolve_dtype

    cpu = probe()
    kernel_isa = getattr(_ext, "kernel_isa", None)

    facts = {
        "megatron_spec": __version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "megatron_core": _version("megatron-core"),
        "nvidia_modelopt": _version("nvidia-modelopt"),
        "transformers": _version("transformers"),
        "sglang": _version("sglang"),
        "transformer_engine": _version("transformer-engine", "transformer_engine"),
        "compiled_ops": _ext.compiled_ops_available(),
        "megatron_cpu_shim": compat_active(),
        "megatron_core_runs": fallback_line(torch.cuda.is_available()),
        "cpu_model": cpu.model,
        "cpu_capability": cpu.capability,
        "native_bf16": cpu.native_bf16,
        "native_bf16_why_not": cpu.why_not_bf16() or None,
        "kernel_isa": kernel_isa() if kernel_isa is not None else None,
        "fp32_linear_tiles": _ext.fp32_linear_tiles(),
        "cpu_kind": cpu.kind,
        "amx_bf16": cpu.amx_bf16,
        "bf16_linear_kernel": _ext.bf16_linear_kernel() if cpu.native_bf16 else None,
        "rollout_dtype_auto": resolve_dtype("auto"),
        "host_heap": setting(),  # the engines' and trainer's allocator setting (megatron_spec.host_memory)
        "huge_pages": huge_pages(),  # whether the engines' panels go to huge pages (host_memory.huge_pages)
    }
    if args.json:
        print(json.dumps(facts))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 0
