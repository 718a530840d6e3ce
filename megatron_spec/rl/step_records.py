"""The records one GRPO step passes between its stages, and the metrics read from them.

A generate round (:class:`Round`) goes to the engines; each engine's part comes back as a
:class:`Shard` (its owner generates and scores it, every rank receives it); the step's
rollouts, assembled in request order with their advantages, are a :class:`Batch`. In async
mode a round in flight is :class:`Pending`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from typing import Any

import torch

from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rollout.types import GenerateRequest, GenerateStats
from megatron_spec.telemetry import current_rss_mb


@dataclasses.dataclass
class Shard:
    """One engine's part of a generate round, as its owner sends it to every rank."""

    engine: int
    samples: list | None
    stats: GenerateStats | None
    seconds: float
    end: float
    """``perf_counter`` when the engine call returned (meaningful on the owner only)."""
    error: str | None = None
    rollouts: list[Rollout] | None = None
    request_ids: list[str] | None = None


@dataclasses.dataclass
class Batch:
    """A step's rollouts, the same on every rank."""

    rollouts: list[Rollout]
    stats: GenerateStats
    prompts: list[str]
    version: int
    """The policy version that generated them."""
    gen_seconds: float
    shards: list[Shard] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Round:
    """The prompts of one generate round: requests in order and what scoring needs of each."""

    requests: list[GenerateRequest]
    indices: list[int]
    prompts: list[str]
    answers: list
    seed: int
    metadata: list = dataclasses.field(default_factory=list)
    """Each prompt's dataset metadata (``rl.data.PromptExample.metadata``; empty: none)."""

    def meta(self) -> dict[str, tuple[int, str, Any, tuple[int, ...], dict]]:
        """request id -> (prompt index, prompt text, answer, prompt ids, metadata)."""
        metadata = self.metadata or [{}] * len(self.requests)
        return {q.request_id: (i, p, a, q.input_ids, m)
                for q, i, p, a, m in zip(self.requests, self.indices, self.prompts, self.answers, metadata)}


@dataclasses.dataclass
class Pending:
    """A batch in flight (async mode): its round, the policy version generating it, the owner's
    engine call, and the data position before it (a checkpoint taken meanwhile resumes there)."""

    round: Round
    version: int
    future: concurrent.futures.Future | None
    sampler_state: dict[str, int]


def step_metrics(batch: Batch, exposed: float, *, policy_version: int, speculative: bool) -> dict[str, Any]:
    """Rewards, lengths, generation and speculation of a step, and this process's memory (docs/metrics.md)."""
    st = batch.stats
    rewards = torch.tensor([ro.reward for ro in batch.rollouts])
    lengths = torch.tensor([len(ro.response_ids) for ro in batch.rollouts], dtype=torch.float32)
    out = {
        "policy_version": policy_version,
        "rollout/policy_version": batch.version,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(ro.finish_reason == "length" for ro in batch.rollouts)
        / len(batch.rollouts),
        "gen/tokens_per_s": st.tokens_per_s,
        "gen/seconds": batch.gen_seconds,
        "gen/exposed_s": exposed,
        "spec/num_draft_tokens": st.num_draft_tokens if speculative else 0,
        "spec/accept_length": st.spec_accept_length if st.spec_steps else 1.0,
        "spec/tokens_per_verify": st.mean_accept_length,
        "mem/rss_mb": current_rss_mb(),
    }
    for i, rate in enumerate(st.accept_rate_per_position):
        out[f"spec/accept_rate_pos{i}"] = rate
    if st.k_mean is not None:  # draft length per request and step (adaptive k: its histogram)
        out["spec/k_mean"] = st.k_mean
        total = sum(st.k_counts)
        out.update({f"spec/k_frac{k}": c / total for k, c in enumerate(st.k_counts)})
    for src in ("history", "live"):  # finished responses of earlier steps and siblings; live group index
        if st.source_accept_length(src) is not None:
            out[f"spec/{src}_accept_length"] = st.source_accept_length(src)
            out[f"spec/{src}_frac"] = st.source_steps[src] / max(1, sum(st.source_steps.values()))
    for src, n in st.source_steps.items():  # per source: request-steps it drafted, drafts the target accepted
        out[f"spec/source_steps/{src}"] = n
        out[f"spec/source_tokens/{src}"] = st.source_accepted.get(src, 0)
    if st.source_steps.get("tree"):
        out["spec/tree_frac"] = st.source_steps["tree"] / sum(st.source_steps.values())
    out.update(dashboard_spec_metrics(st))
    return out


def dashboard_spec_metrics(st) -> dict[str, float]:
    """The step's speculation counters, ours and under the names NeMo-RL's and SkyRL's dashboards read (both
    derive them from vLLM's counters: drafts = request-steps that drafted, positions 1-based; NeMo-RL's
    ``vllm/spec_*``, SkyRL's training window ``vllm/train/draft_*``): {} for a step without drafts."""
    if not st.spec_steps:
        return {}
    drafts, drafted, accepted = st.spec_steps, st.drafted_tokens, st.accepted_tokens
    rate = accepted / drafted if drafted else 0.0
    length = 1.0 + accepted / drafts
    out: dict[str, float] = {
        "spec/num_drafts": drafts, "spec/drafted_tokens": drafted, "spec/accepted_tokens": accepted,
        "spec/acceptance_rate": rate,
        "vllm/spec_num_drafts": drafts, "vllm/spec_num_draft_tokens": drafted,
        "vllm/spec_num_accepted_tokens": accepted, "vllm/spec_acceptance_length": length,
        "vllm/spec_acceptance_rate": rate,
        "vllm/train/draft_num_draft_tokens": drafted, "vllm/train/draft_num_accepted_tokens": accepted,
        "vllm/train/draft_acceptance_rate": rate, "vllm/train/draft_mean_acceptance_length": length,
    }
    for pos, r in enumerate(st.accept_rate_per_position, 1):
        out[f"vllm/spec_acceptance_rate-pos-{pos}"] = r
        out[f"vllm/train/draft_acceptance_rate_pos_{pos}"] = r
    return out


def engine_metrics(batch: Batch, num_engines: int, restarts: int) -> dict[str, Any]:
    """Per-engine work and speculation (docs/metrics.md, "rollout engines")."""
    from megatron_spec.rollout.fleet import imbalance

    out: dict[str, Any] = {"rollout/num_engines": num_engines,
                           "rollout/engine_restarts": restarts}
    by_engine = {sh.engine: sh for sh in batch.shards}
    for e in range(num_engines):
        sh = by_engine.get(e)
        st = sh.stats if sh is not None else None
        out[f"rollout/engine{e}/samples"] = len(sh.rollouts) if sh is not None else 0
        out[f"rollout/engine{e}/gen_s"] = sh.seconds if sh is not None else 0.0
        out[f"rollout/engine{e}/accept_length"] = (st.spec_accept_length if st is not None and st.spec_steps
                                                   else 1.0)
    out["rollout/imbalance"] = imbalance([sh.seconds for sh in batch.shards])
    return out


def dump_rollouts(batch: Batch, path: str) -> None:
    """The step's rollouts as JSON lines (``--dump-rollouts``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for ro in batch.rollouts:
            f.write(json.dumps({"prompt_index": ro.prompt_index, "sample": ro.sample_index,
                                "prompt_ids": ro.prompt_ids, "response_ids": ro.response_ids,
                                "reward": ro.reward, "advantage": ro.advantage,
                                "policy_version": ro.policy_version, "finish_reason": ro.finish_reason,
                                "engine_logprobs": ro.engine_logprobs}) + "\n")
