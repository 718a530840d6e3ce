"""CPU compatibility layer for megatron-core.

megatron-core hard-codes CUDA in a few places (``torch.cuda.current_device()`` as a
device, the CUDA RNG tracker, CUDA events and streams, ``device="cuda"`` masks).
:func:`ensure_megatron_compat` makes those run on CPU. It is the *only* place in this
package that touches megatron-core internals, and it does nothing at all when CUDA is
available: on a GPU machine megatron-core runs unmodified.

What it does not know: anything about models. It patches megatron-core modules, not
ours, and it never changes ``torch`` itself (the shim is installed into megatron-core
modules' own globals, so other libraries still see the real ``torch.cuda``).
"""

from megatron_spec.compat.cpu import (
    CPU_SHIMMED_MODULE_PREFIX,
    compat_active,
    ensure_megatron_compat,
    patched_modules,
)

__all__ = [
    "CPU_SHIMMED_MODULE_PREFIX",
    "compat_active",
    "ensure_megatron_compat",
    "patched_modules",
]
