"""Atomic, resumable checkpoints of a GRPO run.

Layout under ``--save``::

    latest_checkpointed_iteration.txt     # the last *complete* iteration (replaced atomically)
    iter_0000010/
        metadata.json, common.pt,         # megatron-core dist_checkpointing (torch_dist): the policy
        __*_*.distcp, .metadata           # ("embedding.word_embeddings.weight", ...), its AdamW state
                                          # ("optimizer.state.exp_avg.<key>"), each rank's generators
        trainer_state.json                # step, policy version, data position, world layout, settings
        draft/                            # draft trainer state + its ModelOpt-format export
        COMPLETE

Every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 marks it COMPLETE,
renames it into place and only then moves the ``latest`` pointer. A process killed at any
moment (``kill -9`` included) leaves the previous checkpoint and pointer intact; the stale
``.tmp`` directory is removed by the next save. The tensors are saved by their global shapes and
offsets, so a checkpoint saved at one TP x DP layout resumes at another (megatron-core reshards on
load); the generators resume only on the layout they were saved with (another layout starts from the
seed), an MTP draft's trainer state only at its TP size.

A run goes into ``--save`` (default ``runs/grpo-<date>-<time>``) and is saved every ``--save-interval``
steps and after the last; started again with the same ``--save`` it resumes from the latest complete
checkpoint there (:func:`plan_resume`; ``--no-resume`` starts over, :func:`clear_run`); ``--save-keep N``
keeps the newest N (:func:`prune`).
"""

from __future__ import annotations

import json
import os
import queue
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

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = state.get("cuda")  # absent in checkpoints written before it was saved
    if cuda is not None and len(cuda) != torch.cuda.device_count():
        raise CheckpointLoadError(
            f"the checkpoint holds CUDA generator states for {len(cuda)} GPUs, this process "
            f"sees {torch.cuda.device_count()}: resume with as many GPUs visible per process"
        )
    torch.set_rng_state(state["torch"])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def dist_checkpointing():
    """megatron-core's ``dist_checkpointing``, its save strategy's modules loaded and the CPU shim applied to
    them (the torch_dist writer synchronises CUDA after staging tensors; ``megatron_spec.compat``)."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async, state_dict_saver  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy  # noqa: F401

    from megatron_spec.compat import ensure_megatron_compat

    ensure_megatron_compat()
    if filesystem_async._results_queue is None:
        # megatron-core makes this queue a multiprocessing Manager's, for saves that finish in a background
        # process: a server process spawned per rank, which a killed run leaves behind. These saves are
        # synchronous (the writer puts its results and the caller takes them in this process): a plain queue.
        filesystem_async._results_queue = queue.Queue()
    return dc


def per_rank(key: str, data: Any, rank: int, world_size: int):
    """A value every rank holds its own of (generator states, a draft trainer's state) as a
    ``ShardedObject``: one per rank of a world of ``world_size``; :func:`load_checkpoint` reads rank
    ``rank``'s."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, data, (world_size,), (rank,), replica_id=0)


def save_checkpoint(root: str, step: int, *, rank: int, sharded_state: dict[str, Any],
                    trainer_state: dict[str, Any], draft_saver=None) -> str:
    """Collective: every rank calls it, ``draft_saver(dir)`` too (a draft trainer's ``export``: it
    gathers over TP and writes on its first rank). ``sharded_state``: this rank's part of the checkpoint
    for ``megatron.core.dist_checkpointing`` (model and optimizer as ``ShardedTensor``s, the rest as
    :func:`per_rank` objects). Returns the final directory."""
    dc = dist_checkpointing()
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # leftovers of a save that was killed
            if stale.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dc.save(sharded_state, tmp)
    from megatron_spec import faults

    if faults.should_fire("kill_in_save", step):
        faults.kill_self()
    if rank == 0:
        _atomic_write(os.path.join(tmp, "trainer_state.json"),
                      lambda p: open(p, "w").write(json.dumps(trainer_state, indent=2)))
    # collective (the draft trainers gather and sync), written by their first rank
    if draft_saver is not None:
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


def unreadable(path: str) -> str | None:
    """Why the iteration folder ``path`` cannot be read back (an interrupted save, the format before
    dist_checkpointing), or None."""
    if not os.path.isfile(os.path.join(path, "COMPLETE")):
        return f"{path} is not a complete checkpoint (no COMPLETE marker: its save was interrupted)"
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return (
            f"{path} was written by megatron-spec before its checkpoints were megatron-core "
            "dist_checkpointing "
            f"ones (per-rank pickles)"
        )
    return None


def latest_checkpoint(root: str) -> tuple[str, dict[str, Any]]:
    """(iteration dir, trainer state) of the latest complete checkpoint of ``root``."""
    step = latest_step(root)
    if step is None:
        raise CheckpointLoadError(f"no {LATEST} in {root}: nothing to resume")
    path = _iter_dir(root, step)
    problem = unreadable(path)
    if problem:
        raise CheckpointLoadError(f"{problem}: resume another, or with the version that wrote it")
    with open(os.path.join(path, "trainer_state.json")) as f:
        return path, json.load(f)


def load_checkpoint(path: str, sharded_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: this rank's state of the checkpoint folder ``path``, in the structure of ``sharded_state``
    (what :func:`save_checkpoint` got, built for *this* run's layout: megatron-core reshards the tensors)."""
    return dist_checkpointing().load(sharded_state, path)


def resume_line(path: str, saved: dict[str, Any], info, total_steps: int) -> str:
    """What a resumed run says: where from, the step, and the layouts when it was resharded."""
    world, tp = saved["world_size"], saved["tp_size"]
    moved = "" if (world, tp) == (info.world_size, info.tp_size) else \
        f", saved at TP {tp} x DP {world // tp}, resharded to TP {info.tp_size} x DP {info.dp_size}"
    return f"resuming from {path} (step {saved['step']} of {total_steps}{moved})"


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder ``path`` whole (the policy's and its AdamW state's, by their
    megatron-core keys; layers stacked as megatron-core saves them), read in this process without a process
    group: for inspection and tests (torch's ``dcp_to_torch_save``)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        state = torch.load(os.path.join(tmp, "all.pt"), weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


RUN_FILES = (
    "metrics.jsonl",
    "tensorboard",
    "wandb",
    "rollouts",
    "hf",
    "draft_export",
    "report",
    "config.yaml",
)
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
        raise ConfigError(
            f"--save {save} holds a run with no complete checkpoint to resume ({', '.join(used)}); "
            f"--no-resume starts over there (removing them), or choose another --save"
        )
    return None, False


LOCK = ".run.lock"
"""The run folder's lock file: held (``flock``, exclusive) by the run's rank 0 while it lives."""


def _in_use(save: str, fd: int):
    """The ``ConfigError`` for a ``save`` whose lock (open as ``fd``) a live run holds, naming the holder."""
    from megatron_spec.config import ConfigError

    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ConfigError(
        f"--save {save} is in use by a live run{f' ({holder})' if holder else ''}: stop it first "
        f"(its workers too), or choose another --save"
    )


def check_run_folder_free(save: str | None) -> None:
    """``ConfigError`` when a live run holds ``save``'s lock: a second run there would write into the same
    checkpoints and metrics (a run whose launcher was killed alone leaves its workers running, each in a
    process group of its own). Rank 0 tests it (a shared lock, let go at once) before the folder is judged,
    then holds it (:func:`hold_run_folder`); the other ranks do not test it: they would find their own rank 0
    there."""
    if not save or not os.path.isfile(os.path.join(save, LOCK)):
        return
    import fcntl

    fd = os.open(os.path.join(save, LOCK), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise _in_use(save, fd) from None
    finally:
        os.close(fd)


def hold_run_folder(save: str, wait_s: float = 10.0) -> int:
    """Take ``save``'s lock for the life of this process (rank 0; the fd is returned, kept open, and not
    inherited by the engines' processes). A test by another launcher (:func:`check_run_folder_free`) may hold
    it shared for a moment: waited for up to ``wait_s``, then ``ConfigError``."""
    import fcntl
    import socket
    import time

    os.makedirs(save, exist_ok=True)
    fd = os.open(os.path.join(save, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                error = _in_use(save, fd)
                os.close(fd)
                raise error from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd


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
    """The run's folder, ready (collective): ``--save``, or ``runs/grpo-<date>-<time>`` by rank 0's clock;
    where it resumes from (:func:`plan_resume`: ``cfg.checkpoint.load`` is set), the previous run's files
    removed first under ``--no-resume``."""
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
        logging.getLogger(__name__).warning(
            "--no-resume: removed the previous run's checkpoints and files from %s", c.save
        )
    if info.world_size > 1:
        dist.barrier(group=info.wait_group)
    os.makedirs(c.save, exist_ok=True)
    return c.save
