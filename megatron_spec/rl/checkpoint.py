"""Atomic, resumable checkpoints of a GRPO run.

Layout under ``--save``::

    latest_checkpointed_iteration.txt     # the last *complete* iteration (replaced atomically)
    iter_0000010/
        rank_00000.pt ...                 # per rank: policy shard, optimizer, RNG states
        trainer_state.json                # step, policy version, data position, world layout
        draft/                            # draft trainer state + its ModelOpt-format export
        COMPLETE

Every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 marks it COMPLETE,
renames it into place and only then moves the ``latest`` pointer. A process killed at any
moment (``kill -9`` included) leaves the previous checkpoint and pointer intact; the stale
``.tmp`` directory is removed by the next save. Loading checks the world layout it was saved
with (TP and DP sizes).

A run goes into ``--save`` (default ``runs/grpo-<date>-<time>``) and is saved every ``--save-interval``
steps and after the last; started again with the same ``--save`` it resumes from the latest complete
checkpoint there (:func:`plan_resume`; ``--no-resume`` starts over, :func:`clear_run`); ``--save-keep N``
keeps the newest N (:func:`prune`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be resumed into this run."""


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """Every generator a resumed step draws from: torch's CPU and CUDA default generators (one state per
    visible GPU; an empty list without one), Python's, numpy's and megatron-core's model-parallel tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all(), "python": random.getstate(),
            "numpy": np.random.get_state(), "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = state.get("cuda")  # absent in checkpoints written before it was saved
    if cuda is not None and len(cuda) != torch.cuda.device_count():
        raise CheckpointLoadError(f"the checkpoint holds CUDA generator states for {len(cuda)} GPUs, this process "
                                  f"sees {torch.cuda.device_count()}: resume with as many GPUs visible per process")
    torch.set_rng_state(state["torch"])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: str, step: int, *, rank: int, rank_state: dict[str, Any], trainer_state: dict[str, Any],
                    draft_saver=None) -> str:
    """Collective: every rank calls it, ``draft_saver(dir)`` too (a draft trainer's ``export``: it
    gathers over TP and writes on its first rank). Returns the final directory."""
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # leftovers of a save that was killed
            if stale.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    _atomic_write(os.path.join(tmp, f"rank_{rank:05d}.pt"), lambda p: torch.save(rank_state, p))
    from megatron_spec import faults

    if faults.should_fire("kill_in_save", step):
        faults.kill_self()
    if rank == 0:
        _atomic_write(os.path.join(tmp, "trainer_state.json"),
                      lambda p: open(p, "w").write(json.dumps(trainer_state, indent=2)))
    if draft_saver is not None:  # collective (the draft trainers gather and sync), written by their first rank
        draft_saver(os.path.join(tmp, "draft"))
    _barrier()
    if rank == 0:
        _atomic_write(os.path.join(tmp, "COMPLETE"), lambda p: open(p, "w").write("ok\n"))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(os.path.join(root, LATEST), lambda p: open(p, "w").write(f"{step}\n"))
    _barrier()
    return final


def latest_step(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def load_checkpoint(root: str, *, rank: int, world_size: int, tp_size: int) -> tuple[int, dict, dict, str]:
    """(step, this rank's state, trainer state, iteration dir) of the latest complete checkpoint."""
    step = latest_step(root)
    if step is None:
        raise CheckpointLoadError(f"no {LATEST} in {root}: nothing to resume")
    path = _iter_dir(root, step)
    if not os.path.isfile(os.path.join(path, "COMPLETE")):
        raise CheckpointLoadError(f"{path} is not a complete checkpoint")
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    saved = (trainer_state.get("world_size"), trainer_state.get("tp_size"))
    if saved != (world_size, tp_size):
        raise CheckpointLoadError(f"{path} was saved with world size {saved[0]} and TP {saved[1]}; this run has "
                                  f"world size {world_size} and TP {tp_size}")
    state = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), weights_only=False)
    return step, state, trainer_state, path


RUN_FILES = ("metrics.jsonl", "tensorboard", "rollouts", "hf", "draft_export", "report", "config.yaml")
"""What a run writes into its folder besides its checkpoints (what ``--no-resume`` removes)."""


def plan_resume(save: str | None, load: str | None, resume: bool) -> tuple[str | None, bool]:
    """``(checkpoint folder to resume from, whether to clear the previous run's files first)`` for a run into
    ``save``: ``--load`` as given; else the latest complete checkpoint of ``save`` (``resume``); a folder
    holding a run without one is refused (a fresh run would append to its metrics), unless ``--no-resume``
    starts over there. Raises ``ConfigError`` (the launcher's one ``error:`` line)."""
    from megatron_spec.config import ConfigError

    if load or not save or not os.path.isdir(save):
        return load, False
    step = latest_step(save)
    complete = step is not None and os.path.isfile(os.path.join(_iter_dir(save, step), "COMPLETE"))
    used = [n for n in RUN_FILES if os.path.exists(os.path.join(save, n))]
    used += sorted(n for n in os.listdir(save) if n.startswith("iter_"))[-1:]
    if not resume:
        return None, bool(used)
    if complete:
        return save, False
    if used:
        raise ConfigError(f"--save {save} holds a run with no complete checkpoint to resume ({', '.join(used)}); "
                          f"--no-resume starts over there (removing them), or choose another --save")
    return None, False


def clear_run(root: str) -> None:
    """Remove a previous run's checkpoints and files from ``root`` (``--no-resume``; rank 0)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name in RUN_FILES or name.startswith("iter_") or name == LATEST:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``root`` (``--save-keep``; rank 0, after a
    save moved the ``latest`` pointer); returns the removed folders."""
    if keep <= 0:
        return []
    done = sorted(n for n in os.listdir(root) if n.startswith("iter_") and not n.endswith(".tmp")
                  and os.path.isfile(os.path.join(root, n, "COMPLETE")))
    gone = done[:-keep]
    for n in gone:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return gone


def prepare_run_dir(cfg, info) -> str:
    """The run's folder, ready (collective): ``--save``, or ``runs/grpo-<date>-<time>`` by rank 0's clock; where
    it resumes from (:func:`plan_resume`: ``cfg.checkpoint.load`` is set), the previous run's files removed
    first under ``--no-resume``."""
    import logging
    import time

    c = cfg.checkpoint
    if not c.save:
        box = [os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S"))]
        if info.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=info.wait_group)
        c.save = box[0]
    c.load, clear = plan_resume(c.save, c.load, c.resume)
    if clear and info.rank == 0:
        clear_run(c.save)
        logging.getLogger(__name__).warning("--no-resume: removed the previous run's checkpoints and files from %s",
                                            c.save)
    if info.world_size > 1:
        dist.barrier(group=info.wait_group)
    os.makedirs(c.save, exist_ok=True)
    return c.save
