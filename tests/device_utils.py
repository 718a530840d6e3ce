"""Device-placement checks without a GPU: tensors the package makes without a device go to ``meta``.

On a GPU the model is on ``cuda`` while a tensor made without ``device=`` lands on the CPU, and the first
op mixing the two fails. On a CPU-only machine the model is on the CPU too, so :class:`OtherDefaultDevice`
sends every tensor that the package's own code makes without a device to ``meta`` instead: torch's own
device checks then fail exactly where a GPU run would. Tensors that torch or megatron-core make for
themselves are left alone; host tensors the package keeps on purpose say ``device="cpu"``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

import megatron_spec

PACKAGE = os.path.dirname(megatron_spec.__file__) + os.sep
COMPAT = os.path.join(PACKAGE, "compat") + os.sep
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}


class OtherDefaultDevice(TorchFunctionMode):
    """Factories called from megatron_spec code without ``device=`` make ``meta`` tensors."""

    def __init__(self):
        super().__init__()
        self.redirected: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)  # factories are builtins: frame 1 is the code that called them
            path = caller.f_code.co_filename
            if path.startswith(PACKAGE) and not path.startswith(COMPAT):
                kwargs["device"] = "meta"
                self.redirected.append(f"{os.path.relpath(path, PACKAGE)}:{caller.f_lineno}")
        return func(*args, **kwargs)
