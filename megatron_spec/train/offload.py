"""The trainer's half of the colocated memory plan: what it keeps on the device in each phase.

Colocated, the rollout engine and the trainer share each GPU. SGLang takes
``mem_fraction_static`` of it for weights and KV cache while it generates and gives it back
(``release_memory_occupation``) while the trainer works; this module moves the trainer's
tensors out of the way in the other direction (docs/memory_plan.md). A step runs the phases
``prepare`` (stream the weights into the engine), ``gen``, ``logprob``, ``train``; ``PLAN``
says which of the trainer's three kinds of tensors are resident on the device in each, for
each ``--colocate-offload`` level:

* ``params``: the policy's weights (and the frozen reference's);
* ``grads``: megatron-core DDP's fp32 gradient buffers (zeroed before every accumulation, so
  they are dropped, not copied);
* ``optimizer``: fp32 main weights of bf16 training and the AdamW moments.

Moving keeps every tensor object (and every view, optimizer-state reference and
``param.main_grad`` into it) alive: the device storage is copied to host memory (pinned on
CUDA) and resized to zero bytes, and on the way back resized and refilled (what verl does for
megatron-core; SGLang's own process does the same for its side with torch_memory_saver). After
a move off the device ``torch.cuda.empty_cache()`` hands the freed blocks back to the driver,
where the engine's process can allocate them.

On a CPU-only machine the engine and the trainer share host memory and there is nothing to
move: the trainer builds this inactive and says so. The mechanics are the same on every
device and are tested on CPU (tests/models/test_offload.py).

What it does not know: the engine, the schedule of phases (the trainer calls :meth:`enter`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

PHASES = ("prepare", "gen", "logprob", "train")
KINDS = ("params", "grads", "optimizer")
LEVELS = ("none", "optimizer", "all")

_ALL = frozenset(KINDS)
# level -> phase -> the kinds resident on the device during that phase
PLAN: dict[str, dict[str, frozenset[str]]] = {
    "none": {phase: _ALL for phase in PHASES},
    # grads and optimizer state leave after the optimizer step and come back for the next one
    "optimizer": {"prepare": frozenset({"params"}), "gen": frozenset({"params"}),
                  "logprob": frozenset({"params"}), "train": _ALL},
    # and the weights leave once they are streamed into the engine, back for the logprob forward
    "all": {"prepare": frozenset({"params"}), "gen": frozenset(),
            "logprob": frozenset({"params"}), "train": _ALL},
}


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views and tied weights counted once)."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr(), st.device
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(st)
    return out


class ColocateOffload:
    """Moves the trainer's tensors between the device and host memory to follow ``PLAN[level]``.

    Args:
        level: ``none``, ``optimizer`` or ``all`` (``--colocate-offload``).
        kinds: for each of ``KINDS``, a function returning that kind's tensors now (the
            optimizer's moments appear at its first step, so they are asked for at each move).
        active: move at all; ``False`` makes :meth:`enter` only record the phase (CPU runs).
    """

    def __init__(
        self, level: str, kinds: dict[str, Callable[[], list[torch.Tensor]]], *, active: bool = True
    ):
        if level not in PLAN:
            raise ValueError(f"colocate-offload level must be one of {LEVELS}, got {level!r}")
        if set(kinds) != set(KINDS):
            raise ValueError(f"offload needs tensors for {KINDS}, got {sorted(kinds)}")
        self.level = level
        self.kinds = kinds
        self.active = active and level != "none"
        self.phase: str | None = None
        # per kind: (device storage, its host copy or None for dropped gradients, its size in bytes)
        self._away: dict[str, list[tuple[torch.UntypedStorage, torch.UntypedStorage | None, int]]] = \
            {k: [] for k in KINDS}

    def resident(self, phase: str) -> frozenset[str]:
        return PLAN[self.level][phase]

    def enter(self, phase: str) -> None:
        """Make the device hold exactly what ``PLAN[level][phase]`` says (moves in or out)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase
        if not self.active:
            return
        want = self.resident(phase)
        freed = False
        for kind in KINDS:
            if kind in want and self._away[kind]:
                self._reload(kind)
            elif kind not in want and not self._away[kind]:
                freed |= self._offload(kind)
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the engine is another process: give the blocks back to the driver

    def _offload(self, kind: str) -> bool:
        away = []
        for st in _storages(self.kinds[kind]()):
            if kind == "grads":
                host = None  # zeroed before the next accumulation: nothing to keep
            else:
                host = torch.UntypedStorage(st.nbytes(), device="cpu")
                if st.device.type == "cuda":
                    host = host.pin_memory()
                host.copy_(st, non_blocking=st.device.type == "cuda")
            away.append((st, host, st.nbytes()))
        if away and away[0][0].device.type == "cuda":
            torch.cuda.synchronize()  # the copies must land before the storage goes
        for st, _, _ in away:
            st.resize_(0)
        self._away[kind] = away
        return bool(away)

    def _reload(self, kind: str) -> None:
        for st, host, nbytes in self._away[kind]:
            st.resize_(nbytes)
            if host is not None:
                st.copy_(host, non_blocking=True)
            else:
                st.fill_(0)
        self._away[kind] = []

    def device_bytes(self) -> dict[str, int]:
        """Bytes each kind holds in its storages now (0 for a kind moved away)."""
        return {kind: sum(st.nbytes() for st in _storages(self.kinds[kind]())) for kind in KINDS}
