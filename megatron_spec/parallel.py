"""Process groups for a torchrun job: init, seed, tear down.

Reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), picks NCCL on GPU and
gloo on CPU, initialises megatron-core's model-parallel groups (tensor parallel x data
parallel; pipeline parallel is 1) and seeds the model-parallel RNG tracker. Single-process
runs without torchrun get a world of one. Groups are passed on explicitly where this
package needs them (see :class:`ParallelInfo`).

It does not know about models or training.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os

import torch
import torch.distributed as dist

from megatron_spec.compat import ensure_megatron_compat


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device
    wait_group: dist.ProcessGroup | None = None
    """Every rank, gloo, with the long ``wait_timeout_s``: the waits around generation (a rank
    that trains nothing while the engines generate must not hit the training timeout)."""
    wait_timeout_s: float = 0.0


def init_parallel(tp_size: int = 1, seed: int = 1234, timeout_s: float = 600.0,
                  wait_timeout_s: float = 10800.0) -> ParallelInfo:
    """Initialise torch.distributed and megatron-core's parallel state.

    Args:
        tp_size: tensor-parallel size; must divide the world size (the rest is data parallel).
        seed: base seed for megatron-core's model-parallel RNG tracker.
        timeout_s: timeout of the default group and megatron-core's groups (training collectives).
        wait_timeout_s: timeout of :attr:`ParallelInfo.wait_group` (waits for rollouts).
    """
    ensure_megatron_compat()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        store = None
        if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
            # plain `python script.py` (or a second init in it): a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            # an in-process store: no rendezvous port (a "free" port can be taken by another process
            # between finding it and binding it: EADDRINUSE under a busy machine)
            store = dist.HashStore()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tensor-model-parallel-size {tp_size} does not divide the world size {world} "
                         f"(torchrun --nproc_per_node)")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1,
                                     distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    elif ps.get_tensor_model_parallel_world_size() != tp_size:
        raise RuntimeError(f"model parallel already initialised with TP="
                           f"{ps.get_tensor_model_parallel_world_size()}, asked for {tp_size}")
    model_parallel_cuda_manual_seed(seed)
    wait_group = None
    if world > 1:  # collective: every rank creates it, in the same order
        wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout_s))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return ParallelInfo(
        rank=dist.get_rank(), world_size=world,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp_size,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
        device=device, wait_group=wait_group, wait_timeout_s=wait_timeout_s,
    )


def destroy_parallel() -> None:
    """Destroy megatron-core's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
