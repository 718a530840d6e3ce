"""Rollout engines over the job: which rank owns which engine, which ranks feed it, and how a
step's prompts are shared out.

A job of W ranks runs N engines (``--rollout-num-engines``, default one per node). The ranks
form N consecutive blocks of G = W / N; engine e is owned by the first rank of block e (the only
process that holds its handle) and is colocated with the block: an SGLang engine of tensor
parallelism T (``--rollout-tensor-parallel-size``) runs on the GPUs of ranks
``owner(e) .. owner(e) + T - 1``, the engine's *senders*. The native engine runs T = 1 (one
process per engine, on CPU).

Weights reach engine e from its own block: every sender packs the full (all-gathered over its
trainer TP group) tensors on its own device and hands engine TP rank i the payload of sender i
(CUDA IPC on a GPU, shared memory on CPU; ``megatron_spec.sync.forward``). Trainer TP groups are
consecutive blocks of ranks (megatron-core's order with pipeline parallelism 1): a rank that is no
sender but shares a TP group with one takes part in the gathers only.

Each step, the prompts are split over the engines by :func:`shard_requests`: whole GRPO groups
(a request of n samples) stay on one engine, so siblings share their prefix cache, and the split
balances the expected work (samples x (prompt + max new tokens) tokens). The rollouts come back
in request order, whatever the split, so a run's batches do not depend on how many engines
made them (token for token under greedy decoding).

It knows nothing about models or training; the rollout manager (``megatron_spec.rl.rollout_manager``)
drives it.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

from megatron_spec.config_values import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """The engines of a job of ``world_size`` ranks (see the module docstring)."""

    world_size: int
    num_engines: int
    engine_tp_size: int
    trainer_tp_size: int

    @classmethod
    def resolve(cls, *, world_size: int, trainer_tp_size: int, num_engines: int | None,
                engine_tp_size: int | None, ranks_per_node: int, backend: str) -> EngineLayout:
        """The layout the flags ask for, checked.

        Args:
            num_engines: ``--rollout-num-engines`` (None: one engine per node).
            engine_tp_size: ``--rollout-tensor-parallel-size`` (None: 1 for the native engine,
                every rank of the engine's block for SGLang).
            ranks_per_node: ranks on one machine (torchrun's ``LOCAL_WORLD_SIZE``).
            backend: ``native``, ``sglang`` or ``vllm``.
        """
        if ranks_per_node < 1 or world_size % ranks_per_node:
            ranks_per_node = world_size  # a ragged launch: treat the job as one node
        n = num_engines if num_engines is not None else max(1, world_size // ranks_per_node)
        if n < 1 or world_size % n:
            raise ConfigError(
                f"--rollout-num-engines {n} does not divide the world size {world_size}: every engine "
                f"is owned by a block of world/N ranks"
            )
        block = world_size // n
        t = engine_tp_size if engine_tp_size is not None else (block if backend == "sglang" else 1)
        if backend != "sglang" and t != 1:
            raise ConfigError(
                f"--rollout-tensor-parallel-size {t}: the {backend} engine runs on one device (1)"
            )
        if t < 1 or t > block:
            raise ConfigError(
                f"--rollout-tensor-parallel-size {t} must be in 1..{block}: an engine runs on the "
                f"devices of its own block of {block} ranks (world {world_size} / {n} engines)"
            )
        if t > ranks_per_node:
            raise ConfigError(
                f"--rollout-tensor-parallel-size {t} exceeds the {ranks_per_node} ranks of a node: an "
                f"engine's GPUs and the trainer ranks that feed them must share a machine"
            )
        if block % ranks_per_node and ranks_per_node % block:
            raise ConfigError(f"{n} engines make blocks of {block} ranks, which do not tile nodes of "
                              f"{ranks_per_node} ranks")
        if trainer_tp_size < 1 or world_size % trainer_tp_size:
            raise ConfigError(
                f"--tensor-model-parallel-size {trainer_tp_size} does not divide the world size {world_size}"
            )
        return cls(world_size, n, t, trainer_tp_size)

    # ------------------------------------------------------------------ ranks
    @property
    def block(self) -> int:
        """Ranks per engine block."""
        return self.world_size // self.num_engines

    def engine_of(self, rank: int) -> int:
        """The engine whose block holds ``rank``."""
        return rank // self.block

    def owner(self, engine: int) -> int:
        """The rank that holds engine ``engine``'s handle."""
        return engine * self.block

    def is_owner(self, rank: int) -> bool:
        return rank % self.block == 0

    def senders(self, engine: int) -> range:
        """The ranks that pack engine ``engine``'s payloads: sender i feeds engine TP rank i."""
        first = self.owner(engine)
        return range(first, first + self.engine_tp_size)

    def sender_engine(self, rank: int) -> int | None:
        """The engine ``rank`` packs payloads for, or None."""
        e = self.engine_of(rank)
        return e if rank in self.senders(e) else None

    def tp_group_ranks(self, rank: int) -> range:
        """The trainer tensor-parallel group of ``rank`` (consecutive ranks)."""
        first = rank - rank % self.trainer_tp_size
        return range(first, first + self.trainer_tp_size)

    def gathers(self, rank: int, engines: Iterable[int]) -> bool:
        """Whether ``rank`` takes part in the weight gathers when ``engines`` are being fed: its TP
        group holds a sender of one of them (the gathers are collective over the TP group)."""
        mine = set(self.tp_group_ranks(rank))
        return any(mine.intersection(self.senders(e)) for e in engines)

    def describe(self) -> str:
        owners = ", ".join(str(self.owner(e)) for e in range(self.num_engines))
        return (
            f"{self.num_engines} rollout engine(s) x TP {self.engine_tp_size} over {self.world_size} ranks "
            f"(blocks of {self.block}; owners: ranks {owners})"
        )


def request_work(num_samples: int, prompt_tokens: int, max_new_tokens: int) -> float:
    """Expected work of a request: its samples x (prompt + longest response) tokens."""
    return float(num_samples) * float(prompt_tokens + max_new_tokens)


def shard_requests(work: Sequence[float], num_engines: int) -> list[list[int]]:
    """Request positions per engine, balancing ``work`` (longest-processing-time first).

    Deterministic: requests are placed in decreasing work (ties: request order) on the least
    loaded engine (ties: the lowest index), and each engine's list is in request order. A request
    is never split, so a GRPO group stays on one engine.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if any(w < 0 for w in work):
        raise ValueError("request work must be >= 0")
    heap = [(0.0, e) for e in range(num_engines)]
    shards: list[list[int]] = [[] for _ in range(num_engines)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        load, e = heapq.heappop(heap)
        shards[e].append(i)
        heapq.heappush(heap, (load + work[i], e))
    return [sorted(s) for s in shards]


def imbalance(seconds: Sequence[float]) -> float:
    """The slowest engine's time over the mean (1.0 = perfectly balanced; engines with no work excluded)."""
    busy = [s for s in seconds if s > 0]
    if not busy:
        return 1.0
    return max(busy) / (sum(busy) / len(busy))
