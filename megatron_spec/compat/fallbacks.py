"""What megatron-core runs instead of TransformerEngine and Apex here, said once.

megatron-core warns in every process, once per module, that TransformerEngine or Apex is missing and which
local implementation it takes instead ("Apex is not installed. Falling back to Torch Norm", ...), and that
``CUDA_DEVICE_MAX_CONNECTIONS`` is unset. Eight ranks print forty such lines and a user cannot tell which
matter. :func:`quiet_fallback_warnings` silences exactly these warnings (by their text, from megatron-core's
modules), and :func:`fallback_line` is the one line the launcher's rank 0 prints in their place.
"""

from __future__ import annotations

import os
import warnings
from importlib import metadata

FALLBACK_WARNINGS = (r".*is not installed", r".*[Ff]alling back to", r".*CUDA_DEVICE_MAX_CONNECTIONS")
"""The texts of megatron-core's warnings that :func:`fallback_line` says in one line."""


def quiet_fallback_warnings() -> None:
    """Ignore megatron-core's fallback warnings in this process (call it before megatron-core is imported)."""
    for text in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=text, module=r"megatron\.core")


def installed_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` (distribution names) that is installed, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fallback_line(gpu: bool | None = None) -> str:
    """Which implementations megatron-core runs: TransformerEngine's layers or its local ones, Apex's fused
    norms or torch's, and on a GPU whether ``CUDA_DEVICE_MAX_CONNECTIONS`` is the 1 megatron-core asks for."""
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    te, apex = installed_version("transformer-engine", "transformer_engine"), installed_version("apex")
    if gpu and te:
        layers = f"TransformerEngine {te} layers"
    else:
        layers = "its local layers (" + ("TransformerEngine not installed" if not te else "no GPU") + ")"
    parts = [layers]
    if not (gpu and te):
        parts.append(f"Apex {apex} fused norms" if apex else "torch's norms (Apex not installed)")
    if not gpu:
        parts.append("on CPU through megatron_spec.compat's shim")
    elif os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        parts.append(
            "CUDA_DEVICE_MAX_CONNECTIONS is not 1 (megatron-core asks for 1 to overlap tensor-parallel "
            "communication)"
        )
    return "megatron-core: " + "; ".join(parts)
