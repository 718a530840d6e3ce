"""The CPU shim for megatron-core (see the package docstring).

How it works:

* Every loaded ``megatron.core.*`` module whose global ``torch`` is the real torch gets a
  *proxy* ``torch`` module instead: identical to ``torch`` except that its ``cuda``
  attribute is :class:`CpuCudaShim`, which answers ``current_device()`` with ``"cpu"``,
  maps the CUDA RNG onto the CPU default generator, and turns events, streams,
  synchronisation and NVTX ranges into host-side equivalents or no-ops.
* Functions that hard-code ``device="cuda"`` are replaced by CPU versions in their
  module and in every megatron-core module that imported them by name.

Idempotent: call :func:`ensure_megatron_compat` before building megatron-core objects
(this package's builders do); it re-scans ``sys.modules`` so modules imported since the
last call are covered too. On a machine where ``torch.cuda.is_available()`` is true it
returns ``False`` and touches nothing.

The CUDA RNG tracker on CPU: megatron-core forks "CUDA" RNG states around dropout and
weight init. Here the "CUDA" generator *is* the CPU default generator, so a fork really
switches the generator CPU ops draw from, as the CUDA one does on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

CPU_SHIMMED_MODULE_PREFIX = "megatron.core"

_PATCHED: dict[str, types.ModuleType] = {}  # module name -> module that got the proxy
_FUNCTION_PATCHES_DONE: set[str] = set()


# --------------------------------------------------------------------------------------
# torch.cuda stand-ins
# --------------------------------------------------------------------------------------
class _Event:
    """Host-side ``torch.cuda.Event``: CPU work is synchronous, so recording is a timestamp."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: _Event) -> float:
        """Milliseconds between two recorded events, like the CUDA event API."""
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time() needs both events to be recorded first")
        return (end_event._t - self._t) * 1000.0


class _Stream:
    """Host-side ``torch.cuda.Stream``: there is one in-order CPU 'stream'."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


_THE_STREAM = _Stream()


class _Nvtx(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch.cuda.nvtx(cpu-shim)")

    @staticmethod
    def range_push(msg: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    def mark(msg: str) -> None:
        return None

    @staticmethod
    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any):
        yield


class _Random(types.ModuleType):
    """``torch.cuda.random`` mapped onto the CPU default generator."""

    def __init__(self) -> None:
        super().__init__("torch.cuda.random(cpu-shim)")

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def initial_seed() -> int:
        return torch.initial_seed()


class CpuCudaShim(types.ModuleType):
    """What megatron-core modules see as ``torch.cuda`` on a machine without CUDA.

    Anything not defined here falls through to the real ``torch.cuda`` (so exception types
    and dtype aliases still resolve, and a call that truly needs a GPU still fails loudly).
    """

    Event = _Event
    Stream = _Stream

    def __init__(self) -> None:
        super().__init__("torch.cuda(cpu-shim)")
        self.nvtx = _Nvtx()
        self.random = _Random()
        self.get_rng_state = self.random.get_rng_state
        self.set_rng_state = self.random.set_rng_state
        self.manual_seed = self.random.manual_seed
        self.manual_seed_all = self.random.manual_seed_all
        self.initial_seed = self.random.initial_seed

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.default_generator,)

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def is_initialized() -> bool:
        return False

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> _Stream:
        return _THE_STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _Stream:
        return _THE_STREAM

    @staticmethod
    def set_stream(stream: Any) -> None:
        return None

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _make_torch_proxy(shim: CpuCudaShim) -> types.ModuleType:
    """A module that is ``torch`` in every respect but ``.cuda``."""

    class _TorchProxy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:  # attributes torch creates lazily
            return getattr(torch, name)

    proxy = _TorchProxy("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if k not in ("__getattr__",)})
    proxy.cuda = shim
    proxy.__megatron_spec_cpu_proxy__ = True
    return proxy


# --------------------------------------------------------------------------------------
# CPU versions of functions that hard-code device="cuda"
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Causal upper-triangular mask, on CPU (megatron: transformer.utils.get_default_causal_mask)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


# (module, attribute) -> replacement. Every megatron-core module that imported the
# original by name is patched too (see _patch_functions).
_FUNCTION_REPLACEMENTS: dict[tuple[str, str], Callable] = {
    ("megatron.core.transformer.utils", "get_default_causal_mask"): _cpu_default_causal_mask,
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"): _cpu_sliding_window_causal_mask,
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _cpu_get_rng_state,
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _cpu_set_rng_state,
}

# Modules this package builds on; imported up front so they are patched in one pass.
_MODULES_TO_IMPORT = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
)

_SHIM: CpuCudaShim | None = None
_PROXY: types.ModuleType | None = None


def compat_active() -> bool:
    """True when the shim is needed: torch has no usable CUDA device."""
    return not torch.cuda.is_available()


def patched_modules() -> list[str]:
    """Names of the megatron-core modules that currently see the CPU ``torch`` proxy."""
    return sorted(_PATCHED)


def _patch_torch_globals() -> None:
    global _SHIM, _PROXY
    if _PROXY is None:
        _SHIM = CpuCudaShim()
        _PROXY = _make_torch_proxy(_SHIM)
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(CPU_SHIMMED_MODULE_PREFIX):
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _PROXY
            _PATCHED[name] = module


def _patch_functions() -> None:
    for (mod_name, attr), replacement in _FUNCTION_REPLACEMENTS.items():
        module = sys.modules.get(mod_name)
        if module is None:
            continue
        original = getattr(module, attr, None)
        if original is None or original is replacement:
            continue
        for name, other in list(sys.modules.items()):
            if other is None or not name.startswith(CPU_SHIMMED_MODULE_PREFIX):
                continue
            for key, value in list(vars(other).items()):
                if value is original:
                    setattr(other, key, replacement)
        _FUNCTION_PATCHES_DONE.add(f"{mod_name}.{attr}")


def ensure_megatron_compat() -> bool:
    """Make megatron-core runnable on CPU; a no-op when CUDA is available.

    Returns:
        True if the CPU shim is (now) active, False on a CUDA machine.
    """
    if not compat_active():
        return False
    import importlib
    import warnings

    with warnings.catch_warnings():
        # megatron-core warns once per module that TE/apex are absent; that is expected here.
        warnings.simplefilter("ignore")
        for name in _MODULES_TO_IMPORT:
            importlib.import_module(name)
    first = not _PATCHED
    _patch_torch_globals()
    _patch_functions()
    if first:
        logger.debug("megatron-core CPU compatibility layer active (%d modules shimmed)", len(_PATCHED))
    return True
