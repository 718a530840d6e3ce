"""What the SGLang backend checks and writes before it launches ``sglang.Engine`` (SGLang 0.5.23): the GPUs of
the engine's TP ranks, whether an FP8 target's loader can read block-FP8 scales, the target's block-FP8
``config.json``, and SGLang's own ``ServerArgs`` run through the lossless guard.

This module does not launch anything, nor know about weights, versions or generation; the ``ServerArgs``
fields themselves come from ``sglang_protocol.server_kwargs``. It imports SGLang only when
:func:`checked_server_args` is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_spec.rollout import sglang_protocol as proto

# Targets whose SGLang 0.5.23 loader takes block-FP8 ``*.weight_scale_inv`` (checked by running the
# loaders in tests/sync/test_sglang_backend.py). LlamaForCausalLM's loaders rename it to
# ``*.weight_scale``, which a block-FP8 layer does not have, and go on after a log warning.
FP8_TARGETS = frozenset({"Qwen3ForCausalLM", "Qwen2ForCausalLM"})


def check_fp8_target(model_path: str) -> None:
    """Raise unless the checkpoint's architecture is one of :data:`FP8_TARGETS`."""
    from megatron_spec.models import HFCheckpoint

    arch = HFCheckpoint(model_path).decoder_config.architecture
    if arch not in FP8_TARGETS:
        raise ValueError(
            f"FP8 rollout weights on SGLang need a target whose loader reads *.weight_scale_inv; "
            f"{arch}'s loader (SGLang 0.5.23) renames it to *.weight_scale and drops it. "
            f"Supported: {sorted(FP8_TARGETS)}; use --rollout-weight-dtype bf16"
        )


def engine_gpu_ids(gpu_ids: Sequence[int] | None, tp_size: int) -> tuple[int, ...]:
    """The local CUDA device of each of the engine's ``tp_size`` TP ranks: ``gpu_ids`` checked, or by
    default ``tp_size`` consecutive devices from this process's current one (``0 ..`` without CUDA)."""
    if gpu_ids is None:
        base = torch.cuda.current_device() if torch.cuda.is_available() else 0
        gpu_ids = range(base, base + tp_size)
    ids = tuple(int(g) for g in gpu_ids)
    proto.gpu_placement(ids, tp_size)  # raises for ids SGLang cannot place
    if torch.cuda.is_available() and max(ids) >= torch.cuda.device_count():
        raise ValueError(
            f"SGLang engine GPUs {list(ids)}: only {torch.cuda.device_count()} CUDA devices are "
            f"visible to this process"
        )
    return ids


def write_fp8_config(owner: object, model_path: str) -> str:
    """The target's block-FP8 ``config.json`` in a directory that lives as long as ``owner``; its path."""
    import json
    import os
    import shutil
    import tempfile
    import weakref

    tmp = tempfile.mkdtemp(prefix="megatron-spec-sglang-")
    weakref.finalize(owner, shutil.rmtree, tmp, True)
    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(proto.fp8_target_config(model_path), f, indent=2)
    return path


def checked_server_args(kwargs: dict[str, Any]):
    """Construct SGLang's ``ServerArgs`` (unknown fields raise) and run the lossless guard on it."""
    from sglang.srt.server_args import ServerArgs

    from megatron_spec.speculative import check_lossless

    args = ServerArgs(**kwargs)
    check_lossless(args)
    return args
