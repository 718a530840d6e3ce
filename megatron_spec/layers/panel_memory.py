"""The packed linears' panels moved into one huge-page mapping (``host_memory.huge_page_memory``).

Why: the extension's decode kernels read every panel once per step, and at a few rows that read is the step.
Packed where :meth:`Linear.pack` allocates them, the panels lie on 4 KiB pages, in the engine built first in a
process on heap memory its loading had already touched; moved here, SmolLM2's bf16 engine decoded one row ~10%
faster, and identical engines built one after the other in a process decode at the same speed
(docs/benchmark_log.md, "Huge pages"). A weight update re-packs into the panels it has (``Linear._pack_as``),
so they stay here until they are released (``pack_linears(enable=False)``): a later pack takes the heap again,
until the next :func:`place_panels`.

This module does not know about engines; it reads and sets the panels of :class:`Linear` as
``fused_layers`` reads them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from megatron_spec.host_memory import huge_page_memory
from megatron_spec.layers import linear

ALIGN = 4096  # each layer's panels start on a page of their own, as a fresh allocation's would


def placeable(module: nn.Module) -> list[linear.Linear]:
    """The linears of ``module`` whose panels are their own memory: packed, and not a lent bucket's
    (:meth:`Linear.hold_panels`), nor placed already."""
    return [m for m in module.modules()
            if isinstance(m, linear.Linear) and m._small is not None and m._small.device.type == "cpu"
            and not m.holds_panels and not getattr(m._small, "placed", False)]


def place_panels(modules: Iterable[nn.Module | None]) -> int:
    """Copy the panels of every :func:`placeable` linear in ``modules`` into one new huge-page mapping and
    compute from there; returns the bytes moved (0 where ``huge_page_memory`` gives none: the panels stay)."""
    layers = [m for module in modules if module is not None for m in placeable(module)]
    sizes = [-(-m._small.nbytes // ALIGN) * ALIGN for m in layers]
    memory = huge_page_memory(sum(sizes))
    if memory is None:
        return 0
    offset = 0
    for m, size in zip(layers, sizes):
        old = m._small
        new = memory[offset:offset + old.nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        new.placed = True  # a weight update re-packs into this very tensor
        m._small, m._packed = new, (new if m._packed is old else m._packed)
        offset += size
    linear.PACK_EPOCH += 1  # lists of the old panels (fused_layers.fused_stack's, cached) are stale
    return offset


def placed_bytes(modules: Iterable[nn.Module | None]) -> int:
    """Bytes of the panels of ``modules`` that lie on huge pages now (a release and a later pack put them back
    on the heap)."""
    return sum(m._small.nbytes for module in modules if module is not None for m in module.modules()
               if isinstance(m, linear.Linear) and getattr(m._small, "placed", False))
