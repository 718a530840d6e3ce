"""How many intra-op threads a small draft model's proposal runs with: 1 or the engine's, whichever
:class:`ThreadChooser` measured faster for the batch size.

This module does not know what runs inside the measured block (a draft model's forwards, in
``drafters.py``) nor where the engine's thread count comes from; it only reads and sets
``torch``'s intra-op thread count around the block.
"""

from __future__ import annotations

import contextlib
import time

import torch


class ThreadChooser:
    """Runs a draft's proposal with 1 intra-op thread or with the engine's, whichever it measured faster
    (per batch size, an EMA per choice; the other choice is re-tried every ``retry_every`` calls).

    Why: a small draft's matrix products are too small to split, and with several threads every
    one of its many small kernels waits at an OpenMP barrier; when other processes share the cores a
    descheduled thread holds that barrier for a time slice. Measured here (0.8M-parameter draft model,
    batch 1, 2 threads on a loaded 2-core host): 2.3-3.4 s per proposal of 3 tokens with 2 threads,
    29-56 ms with 1. Which is faster depends on the draft, the batch and the machine's load, so it
    is measured, not configured."""

    def __init__(self, retry_every: int = 32, ema: float = 0.3):
        self.retry_every, self.ema = retry_every, ema
        self.seconds: dict[tuple[int, int], float] = {}
        self.calls = 0
        self.enabled = True
        """False on a GPU: the host's threads only launch its kernels (``allocate`` sets it)."""

    def choose(self, batch: int) -> int:
        n = torch.get_num_threads()
        if n == 1:
            return 1
        self.calls += 1
        for t in (1, n):
            if (batch, t) not in self.seconds:
                return t
        best = min((1, n), key=lambda t: self.seconds[(batch, t)])
        if self.calls % self.retry_every == 0:
            return n if best == 1 else 1
        return best

    @contextlib.contextmanager
    def run(self, batch: int):
        if not self.enabled:
            yield
            return
        n = torch.get_num_threads()
        t = self.choose(batch)
        if t != n:
            torch.set_num_threads(t)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if t != n:
                torch.set_num_threads(n)
            old = self.seconds.get((batch, t))
            self.seconds[(batch, t)] = dt if old is None else old + self.ema * (dt - old)
