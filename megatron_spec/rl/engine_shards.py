"""The parts of a generate round over several engines that need no process group.

The shard plan (whole GRPO groups per engine, balanced by expected work), each engine's sampling
seed, one owner's engine call as a :class:`~megatron_spec.rl.step_records.Shard` and its scoring,
the shards' rollouts back in request order, the step's batch assembled from them (group-relative
advantages, merged statistics) and the held-out evaluation's metrics. It knows no process group,
restart or weight push: the rollout manager (``rl/rollout_manager.py``) sends every shard to every
rank and restarts the engines that fail.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from megatron_spec.config import GRPOConfig
from megatron_spec.interfaces import RolloutEngine
from megatron_spec.rl.advantages import grpo_advantages
from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rl.step_records import Batch, Shard
from megatron_spec.rollout.types import GenerateRequest, GenerateStats
from megatron_spec.telemetry import generation_bar

if TYPE_CHECKING:
    from megatron_spec.rl.task import PromptTask


def shard_plan(reqs: list[GenerateRequest], num_engines: int) -> list[list[int]]:
    """Request positions per engine: whole requests (GRPO groups), balanced by expected work."""
    from megatron_spec.rollout.fleet import request_work, shard_requests

    work = [request_work(q.n, len(q.input_ids), q.sampling.max_new_tokens) for q in reqs]
    return shard_requests(work, num_engines)


def engine_seed(seed: int, engine: int) -> int:
    """Engine e's sampling seed for a call (engine 0 keeps the job's seed: one engine runs as before)."""
    return seed + 1_000_003 * engine


def generate_shard(
    engine: RolloutEngine, index: int, reqs: list[GenerateRequest], seed: int, *, progress: bool
) -> Shard:
    """Engine ``index``'s call on ``reqs`` (``progress``: show the generation bar). A dead or stuck
    engine is reported in the shard's ``error``, not restarted here: restarting needs the weights
    again, which every feeding rank streams together. Every backend raises the same two errors for an
    engine that is gone or stuck (``megatron_spec.interfaces``)."""
    from megatron_spec.interfaces import EngineDiedError, EngineTimeoutError

    t0 = time.perf_counter()
    if not reqs:
        return Shard(index, [], GenerateStats(), 0.0, t0)
    try:
        with generation_bar(sum(q.n for q in reqs), enabled=progress) as on_progress:
            samples, stats = engine.generate(reqs, seed=seed, on_progress=on_progress)
    except (EngineDiedError, EngineTimeoutError) as exc:
        end = time.perf_counter()
        return Shard(index, None, None, end - t0, end, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return Shard(index, samples, stats, end - t0, end)


def scored(shard: Shard, task: PromptTask, meta: dict[str, Any], version: int) -> Shard:
    """A generated shard with its samples scored into rollouts of policy ``version`` (the owner scores
    its own: the reward work is spread over the owners); ``meta``: the round's ``Round.meta()``."""
    return dataclasses.replace(
        shard,
        samples=None,
        rollouts=task.score(shard.samples, meta, version),
        request_ids=[s.request_id for s in shard.samples],
    )


def in_request_order(reqs: list[GenerateRequest], shards: Iterable[Shard]) -> list[Rollout]:
    """The scored shards' rollouts in the order of ``reqs``, then by sample index."""
    order = {q.request_id: i for i, q in enumerate(reqs)}
    keyed = [(order[q], ro.sample_index, ro) for sh in shards for ro, q in zip(sh.rollouts, sh.request_ids)]
    return [ro for _, _, ro in sorted(keyed, key=lambda t: (t[0], t[1]))]


def assemble_batch(
    rollouts: list[Rollout],
    shards: list[Shard],
    prompts: list[str],
    version: int,
    gen_s: float,
    g: GRPOConfig,
) -> Batch:
    """The step's batch: group-relative advantages over the assembled rollouts (every rank, the same
    result) and the engines' statistics merged."""
    adv = grpo_advantages(
        torch.tensor([ro.reward for ro in rollouts]),
        g.grpo_group_size,
        baseline=g.advantage_baseline,
        normalize_std=g.advantage_normalize_std,
    )
    for ro, a in zip(rollouts, adv.tolist()):
        ro.advantage = a
    stats = GenerateStats()
    for sh in shards:
        stats.merge(sh.stats)
    stats.wall_s = max((sh.seconds for sh in shards), default=0.0)  # the engines ran side by side
    return Batch(rollouts, stats, prompts, version, gen_s, shards)


def eval_metrics(rollouts: list[Rollout], version: int) -> dict[str, float]:
    """The held-out evaluation's mean reward, its standard error and size, of policy ``version``."""
    rewards = [ro.reward for ro in rollouts]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)
    return {
        "eval/reward": mean,
        "eval/reward_se": math.sqrt(var / len(rewards)),
        "eval/prompts": len(rewards),
        "eval/policy_version": version,
    }
