"""The C allocator's settings for a process that computes with large CPU tensors.

torch allocates CPU tensors through the C library's ``posix_memalign``. With glibc's defaults an
allocation above the *mmap threshold* (128 KiB at first, then raised to the largest block freed so far,
at most 32 MiB) is a fresh ``mmap``, and free memory at the top of the heap beyond the *trim threshold*
(twice the mmap threshold) goes back to the kernel. A forward's activations are such blocks (a 64-prompt
prefill of SmolLM2 allocates 14-28 MB buffers per layer), so every forward faults its output pages in
again, zeroed by the kernel, and a heap trimmed after one forward grows again in the next.

:func:`keep_heap` turns both off for this process (``mallopt(M_MMAP_MAX, 0)``: large blocks come from the
heap too, glibc falling back to ``mmap`` where a heap cannot hold one; ``mallopt(M_TRIM_THRESHOLD, INT_MAX)``:
freed memory stays with the process for its next forward), as jemalloc and tcmalloc behave (PyTorch's CPU
tuning guide and vLLM's CPU build preload one of those for this reason); mallopt is glibc's own switch, so
nothing is preloaded. The process then holds the most its forwards ever used. On the real model (fp32, 16
rows) a generate call took 85-123 thousand page faults and 0.21-0.27 s of kernel time with glibc's defaults,
8 and 0.02 s with the heap kept (docs/benchmark_log.md, "The heap kept").

The native engine calls it once its weights and KV cache are in place: they keep their own page-aligned
mappings, as every kernel was tuned with (taken from the heap too, bf16 decoding at 16 rows read 0.91 of the
default's speed in the one comparison made), and only what the forwards allocate moves. The policy actor
(``rl/actor.py``) calls it on the CPU once its policy, reference and optimizer exist: the main job's trainer
took 2-3.7 million page faults and 4.4-7.4 s of kernel time a step with glibc's defaults, 0-0.9 million and
0.8-7.0 s kept, and held 7.4-10.6 GB (mostly 10.1-10.6) against 5.9-8.3 GB (a micro-batch's fp32 logits alone,
16 x up to 160 x 49152, are up to 0.5 GB); its steps ran 1.13x as fast (train 1.17x, logprob 1.08x; 4 rounds
alternated, ``benchmarks/bench_host_memory.py --main-job``).

``MEGATRON_SPEC_DEFAULT_MALLOC=1`` keeps glibc's defaults (the benchmarks' comparison; the project's switch
rule, ``isa.switch_on``). Without glibc it does nothing.

:func:`huge_page_memory` gives memory for weights that are read whole at every step: a fresh anonymous
mapping, 2 MiB aligned and advised ``MADV_HUGEPAGE`` before it is first touched, so that the kernel backs it
with transparent huge pages where its setting is ``madvise`` (a common default, this VM's) as well as
``always``. Why: a decode step at one row reads every weight once and little else, and over 4 KiB pages its
reads miss the TLB (on a VM, a two-level page walk). The native engine's bf16 panels of SmolLM2 read 13%
faster at one row from huge pages than from fresh 4 KiB pages, and 20% faster than from heap memory the
engine's own loading had used before (an engine built first in a process read 7-18% slower than its identical
twins built after it, every round: docs/benchmark_log.md, "Huge pages"). Memory freed back to the heap keeps
its 4 KiB pages, so advising it later does nothing: the mapping must be new. ``MEGATRON_SPEC_NO_HUGE_PAGES=1``
turns it off (:func:`huge_page_memory` returns None and the caller keeps its own memory). This module does not
know about models or engines.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from megatron_spec.isa import switch_on

logger = logging.getLogger(__name__)

DEFAULT_MALLOC_ENV = "MEGATRON_SPEC_DEFAULT_MALLOC"
"""Set to 1 to keep the C library's allocator settings (:func:`keep_heap` does nothing)."""

NO_HUGE_PAGES_ENV = "MEGATRON_SPEC_NO_HUGE_PAGES"
"""Set to 1 to keep weights where they were allocated (:func:`huge_page_memory` returns None)."""

HUGE_PAGE = 2 << 20  # the x86-64 transparent huge page
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_INT_MAX = 2**31 - 1

_state: str | None = None  # what keep_heap did in this process ("kept", a reason it did not), once


def keep_heap() -> str:
    """Keep large blocks on the heap and freed memory in this process (module docstring), once per process.
    Returns what it did: ``kept``, or why not (``default asked``, ``not glibc``, ``mallopt refused``)."""
    global _state
    if _state is None:
        _state = _apply()
        logger.debug("host memory: %s", _state)
    return _state


def is_glibc() -> bool:
    """Whether this process runs on glibc (musl's ``mallopt``, for one, is a stub)."""
    try:
        return "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or "")
    except (AttributeError, ValueError, OSError):  # no confstr, or a C library without that name
        return False


def _apply() -> str:
    if switch_on(DEFAULT_MALLOC_ENV):
        return "default asked"
    if not is_glibc():
        return "not glibc"
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, _INT_MAX) != 1:
        return "mallopt refused"
    return "kept"


def state() -> str | None:
    """What :func:`keep_heap` did in this process (None: not called); for the benchmarks' reports."""
    return _state


def setting() -> str:
    """What :func:`keep_heap` did in this process or, not called yet, what it would do here and in the
    processes started with this environment (``kept``, ``default asked``, ``not glibc``): the benchmarks'
    JSON says which allocator setting their engines ran with."""
    if _state is not None:
        return _state
    if switch_on(DEFAULT_MALLOC_ENV):
        return "default asked"
    return "kept" if is_glibc() else "not glibc"


def huge_pages() -> str:
    """Whether :func:`huge_page_memory` gives huge pages here: ``advised`` (the kernel's setting is
    ``madvise`` or ``always``), ``off asked`` (:data:`NO_HUGE_PAGES_ENV`), ``never`` (the kernel's setting),
    ``no THP`` (no such setting, or no ``MADV_HUGEPAGE``: not Linux); for the benchmarks' reports too."""
    if switch_on(NO_HUGE_PAGES_ENV):
        return "off asked"
    try:
        with open(THP_SETTING) as f:
            chosen = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "no THP"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no THP"
    return "never" if chosen == "never" else "advised"


def huge_page_memory(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of new memory (uint8, 2 MiB aligned, untouched: zeros) advised to be backed by huge pages,
    or None where :func:`huge_pages` says it would not be (the caller keeps the memory it has). The tensor
    holds the mapping: it is unmapped when the last view of it goes."""
    if nbytes <= 0 or huge_pages() != "advised":
        return None
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    area = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps ``area`` alive
    start = -whole.data_ptr() % HUGE_PAGE  # mmap gives 4 KiB alignment: the first whole huge page
    area.madvise(mmap.MADV_HUGEPAGE, start, length)
    return whole[start:start + nbytes]
