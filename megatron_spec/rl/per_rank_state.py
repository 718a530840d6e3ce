"""The per-rank objects of a training checkpoint: this rank's generators and its online draft
learner's state, as megatron-core ``ShardedObject`` entries (``rl/checkpoint.py`` writes and reads
them), with the rules for resuming them on another layout than they were saved with.

On the same world and TP sizes each rank gets its own back. On another layout the generators are
left out (they start from the seed) and every rank reads DP rank 0's draft learner state (an EAGLE-3
head is the same on every rank; an MTP learner's is tensor-parallel: refused at another TP). It
knows no model or optimizer: the policy's sharded state is the actor's (``rl/actor.py``).
"""

from __future__ import annotations

from typing import Any

from megatron_spec.interfaces import DraftLearner
from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl import checkpoint as ckpt_io


def per_rank_state(
    info: ParallelInfo, saved: dict[str, Any] | None, *, draft: DraftLearner | None, draft_kind: str
) -> dict[str, Any]:
    """``rng`` (on the saved layout only) and ``draft`` (with an online ``draft`` learner) entries of
    the sharded state. To save: ``saved`` is None. To load: ``saved`` is the checkpoint's trainer state;
    a checkpoint without the draft learner's state, or an MTP learner's at another TP, is refused."""
    state = {}
    same = saved is None or (saved["world_size"], saved["tp_size"]) == (info.world_size, info.tp_size)
    world, rank = (
        (info.world_size, info.rank) if same else (saved["world_size"], info.tp_rank % saved["world_size"])
    )
    if same:
        state["rng"] = ckpt_io.per_rank("rng_state", ckpt_io.rng_state(), rank, world)
    if draft is not None:
        if saved is not None and not saved.get("draft_state", True):
            raise ckpt_io.CheckpointLoadError(
                "the checkpoint has no draft trainer state; it was saved without --spec-online-draft-training"
            )
        if not same and draft_kind == "mtp" and saved["tp_size"] != info.tp_size:
            raise ckpt_io.CheckpointLoadError(
                "the MTP draft learner's state is tensor-parallel: it resumes at the TP size it was "
                "saved with "
                f"({saved['tp_size']}), this run has TP {info.tp_size}"
            )
        state["draft"] = ckpt_io.per_rank(
            "draft_state", draft.state_dict() if saved is None else None, rank, world
        )
    return state
