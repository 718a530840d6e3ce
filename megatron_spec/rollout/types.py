"""Requests, outputs and statistics shared by every rollout backend (native and SGLang).

Both backends take :class:`GenerateRequest` and return :class:`SampleOutput` records plus a
:class:`GenerateStats`; the trainer and ``megatron-spec generate`` never see which backend
produced them. Acceptance is counted the way SGLang reports it: ``accept_length`` = emitted
tokens / verify steps (so plain decoding has 1.0).

This module holds plain data and the arithmetic on it, nothing that runs a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one prompt is sampled (the same fields SGLang's sampling_params take)."""

    temperature: float = 1.0
    """0 = greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off; -1 (SGLang's and vLLM's off) is read as 0."""
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (the EOS ids are added unless ignore_eos)."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def to_sglang(self) -> dict[str, Any]:
        """SGLang ``sampling_params`` dict with the same meaning."""
        d: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                             "top_k": self.top_k if self.top_k > 0 else -1, "min_p": self.min_p,
                             "max_new_tokens": self.max_new_tokens, "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        return d


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    """Samples drawn for this prompt (they share its prefill)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if not self.input_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.n < 1:
            raise ValueError(f"request {self.request_id}: n must be >= 1, got {self.n}")


@dataclasses.dataclass
class SampleOutput:
    request_id: str
    sample_index: int
    output_ids: list[int]
    logprobs: list[float]
    """The target's log-prob of each output token under the processed distribution sampled
    from (for greedy rows: under the unscaled policy)."""
    finish_reason: str
    num_verify_steps: int
    """Target forwards that produced tokens for this sample (prefill counts as one)."""
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)
    """Drafts accepted at each speculative verify step (empty for plain decoding)."""
    weight_version: str | None = None
    draft_weight_version: str | None = None
    draft_lengths: list[int] = dataclasses.field(default_factory=list)
    """Drafts proposed at each verify step after the prefill (the k chosen for this request at that
    step, fewer where a history proposal was shorter; 0 = a plain step); empty without a drafter."""
    draft_sources: list[str] = dataclasses.field(default_factory=list)
    """Where each step's drafts came from: the drafter's kind, or ``history``."""

    @property
    def accept_length(self) -> float:
        return len(self.output_ids) / max(1, self.num_verify_steps)

    def draft_starts(self) -> list[tuple[int, int]]:
        """``(i, a)`` per speculative verify step: the index in ``output_ids`` of the token its first draft
        proposed (token 0 came from the prefill) and how many of its drafts were accepted; steps past the
        output are left out. Needs every step after the prefill to have drafted (a fixed k): a plain step
        moves the position without an ``accepted_per_step`` entry.

        Raises:
            ValueError: a step drafted nothing (``draft_lengths`` holds a 0).
        """
        if 0 in self.draft_lengths:
            raise ValueError("draft_starts: a step drafted nothing, so the drafts' positions are not known")
        out, i = [], 1
        for a in self.accepted_per_step:
            if i >= len(self.output_ids):
                break
            out.append((i, a))
            i += 1 + a
        return out

    def to_json(self) -> dict[str, Any]:
        return {"id": self.request_id, "sample": self.sample_index, "output_ids": self.output_ids,
                "logprobs": self.logprobs, "finish_reason": self.finish_reason,
                "num_verify_steps": self.num_verify_steps}


@dataclasses.dataclass
class GenerateStats:
    """Aggregate statistics of one ``generate`` call."""

    num_tokens: int = 0
    num_verify_steps: int = 0
    wall_s: float = 0.0
    num_draft_tokens: int = 0
    spec_steps: int = 0
    """Verify steps that checked drafts (excludes prefill's first token and plain steps)."""
    accepted_at_least: list[int] = dataclasses.field(default_factory=list)
    """accepted_at_least[i]: spec steps that accepted more than i drafts."""
    k_counts: list[int] = dataclasses.field(default_factory=list)
    """k_counts[k]: row-steps (one request, one verify step) that drafted k tokens (histogram of k)."""
    source_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Spec row-steps per draft source (the drafter's kind, ``history``)."""
    source_accepted: dict[str, int] = dataclasses.field(default_factory=dict)
    """Drafts accepted per draft source."""
    tree_second: int = 0
    """Tree row-steps (source ``tree``: the drafter's and the history's proposals as two branches of one
    verify) that kept the history branch past the drafter's tokens."""

    def add_spec_step(self, num_accepted: int, k: int, source: str | None = None) -> None:
        if len(self.accepted_at_least) < k:
            self.accepted_at_least.extend([0] * (k - len(self.accepted_at_least)))
        self.spec_steps += 1
        for i in range(num_accepted):
            self.accepted_at_least[i] += 1
        if source is not None:
            self.source_steps[source] = self.source_steps.get(source, 0) + 1
            self.source_accepted[source] = self.source_accepted.get(source, 0) + num_accepted

    def add_step_k(self, k: int, rows: int = 1) -> None:
        """``rows`` row-steps that drafted ``k`` tokens each."""
        if len(self.k_counts) <= k:
            self.k_counts.extend([0] * (k + 1 - len(self.k_counts)))
        self.k_counts[k] += rows

    @property
    def k_mean(self) -> float | None:
        """Mean drafts per row-step (None: no speculative engine)."""
        n = sum(self.k_counts)
        return sum(k * c for k, c in enumerate(self.k_counts)) / n if n else None

    def source_accept_length(self, source: str) -> float | None:
        """1 + mean drafts accepted over the spec row-steps that drafted from ``source``."""
        n = self.source_steps.get(source, 0)
        return 1.0 + self.source_accepted.get(source, 0) / n if n else None

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accept_length(self) -> float:
        return self.num_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def accept_rate_per_position(self) -> list[float]:
        """P(draft i accepted) over spec steps; position i is accepted only if 0..i-1 were."""
        return [c / self.spec_steps for c in self.accepted_at_least] if self.spec_steps else []

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens proposed over the spec steps (vLLM's ``num_draft_tokens`` counter): from the
        per-row-step draft lengths where the engine reports them, else k per spec step."""
        if self.k_counts:
            return sum(k * c for k, c in enumerate(self.k_counts))
        return self.spec_steps * self.num_draft_tokens

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens the target accepted (vLLM's ``num_accepted_tokens`` counter)."""
        return sum(self.accepted_at_least)

    @property
    def spec_accept_length(self) -> float:
        """Emitted tokens per speculative verify step: 1 + mean accepted drafts."""
        if not self.spec_steps:
            return 0.0
        return 1.0 + sum(self.accepted_at_least) / self.spec_steps

    def merge(self, other: GenerateStats) -> None:
        self.num_tokens += other.num_tokens
        self.num_verify_steps += other.num_verify_steps
        self.wall_s += other.wall_s
        self.num_draft_tokens = max(self.num_draft_tokens, other.num_draft_tokens)
        self.spec_steps += other.spec_steps
        k = max(len(self.accepted_at_least), len(other.accepted_at_least))
        a = self.accepted_at_least + [0] * (k - len(self.accepted_at_least))
        b = other.accepted_at_least + [0] * (k - len(other.accepted_at_least))
        self.accepted_at_least = [x + y for x, y in zip(a, b)]
        self.k_counts.extend([0] * (len(other.k_counts) - len(self.k_counts)))
        for k, c in enumerate(other.k_counts):
            self.k_counts[k] += c
        self.tree_second += other.tree_second
        for src, n in other.source_steps.items():
            self.source_steps[src] = self.source_steps.get(src, 0) + n
            self.source_accepted[src] = self.source_accepted.get(src, 0) + other.source_accepted.get(src, 0)

    def summary(self) -> dict[str, Any]:
        """The JSON summary line of ``megatron-spec generate`` (docs/design.md, "megatron-spec generate")."""
        return {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "num_tokens": self.num_tokens,
            "mean_accept_length": round(self.mean_accept_length, 4),
            "accept_rate_per_position": [round(r, 4) for r in self.accept_rate_per_position],
            "wall_s": round(self.wall_s, 4),
            "num_verify_steps": self.num_verify_steps,
            "spec_accept_length": round(self.spec_accept_length, 4),
            "num_draft_tokens": self.num_draft_tokens,
            "k_mean": None if self.k_mean is None else round(self.k_mean, 4),
            "k_hist": list(self.k_counts),
            "source_steps": dict(self.source_steps),
            "tree_second_steps": self.tree_second,
            "source_accept_length": {s: round(self.source_accept_length(s), 4) for s in self.source_steps},
        }


def stats_from_samples(samples: Sequence[SampleOutput], wall_s: float, k: int) -> GenerateStats:
    """Statistics recomputed from per-sample records (what the SGLang backend reports)."""
    st = GenerateStats(wall_s=wall_s, num_draft_tokens=k)
    for s in samples:
        st.num_tokens += len(s.output_ids)
        st.num_verify_steps += s.num_verify_steps
        for a in s.accepted_per_step:
            st.add_spec_step(a, k)
        for d in s.draft_lengths:
            st.add_step_k(d)
    return st


def check_ready_to_generate(
    *, updating: bool, released: set[str] | frozenset[str], missing: list[str]
) -> None:
    """The engines' one refusal of a ``generate`` they cannot serve (every backend: native, SGLang, vLLM):
    during a weight update, with the KV cache released, or without the weights of ``missing`` groups."""
    if updating:
        raise RuntimeError("generate called during a weight update (call end_weight_update first)")
    if "kv_cache" in released:
        raise RuntimeError("generate called while memory is released (call resume_memory first)")
    if missing:
        raise RuntimeError(
            f"generate refused: no weights loaded for {missing} (released, dummy-initialised or "
            f"never sent); push them with update_weights_from_tensor"
        )
