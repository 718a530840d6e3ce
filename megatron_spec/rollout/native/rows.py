"""The engine's rows (:class:`Row`: one sample being generated; :class:`Admission`: prompts taken
into the batch), and token rows of different lengths as one padded tensor on the engine's device.

Every drafter and the scheduler turn Python lists of token ids (prompts, pending tokens, proposals) into
``[B, width]`` int64 tensors; :func:`pad_rows` builds them on the host and moves them once, so a GPU
engine pays one copy per tensor rather than one per row. It knows nothing about models or drafting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_spec.layers.linear import SMALL_MAX_ROWS
from megatron_spec.rollout.native.measures import AcceptanceStats
from megatron_spec.rollout.native.model import Segment
from megatron_spec.rollout.types import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from megatron_spec.speculative import SamplingTensors


def pad_rows(
    rows: Sequence[Sequence[int]], width: int, fill: int, device: torch.device | str
) -> torch.Tensor:
    """``[len(rows), width]`` int64: row i's ids, then ``fill`` (each row at most ``width`` long)."""
    out = torch.full((len(rows), width), fill, dtype=torch.long, device="cpu")  # filled on the host
    for i, row in enumerate(rows):
        if len(row):
            out[i, :len(row)] = torch.tensor(list(row), dtype=torch.long, device="cpu")
    return out.to(device)


def sampling_of(rows: Sequence[Row], device: torch.device) -> SamplingTensors:
    """The sampling parameters of ``rows`` (one entry each) as tensors on ``device``."""
    if not rows:
        return SamplingTensors.from_values(1.0, 0, 1.0, 0.0, batch_size=0, device=device)
    sp = [r.req.sampling for r in rows]
    return SamplingTensors.from_values([s.temperature for s in sp], [s.top_k for s in sp],
                                       [s.top_p for s in sp], [s.min_p for s in sp], device=device)


@dataclasses.dataclass
class Row:
    """One sample being generated: its request, tokens so far, what it emitted and how."""

    req: GenerateRequest
    sample_index: int
    tokens: list[int]
    stop_ids: frozenset[int]
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    draft_lengths: list[int] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)
    verify_steps: int = 1  # the prefill produced the first token
    finish: str | None = None
    acc: dict[str, AcceptanceStats] = dataclasses.field(default_factory=dict)
    """This request's acceptance per position, per draft source (adaptive k)."""

    def emit(self, token: int, logprob: float) -> bool:
        """Append one token; returns True when the row is finished."""
        self.tokens.append(token)
        self.out.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish = FINISH_STOP
        elif len(self.out) >= self.req.sampling.max_new_tokens:
            self.finish = FINISH_LENGTH
        return self.finish is not None


@dataclasses.dataclass
class Admission:
    """Requests taken from the queue and their prefill (into slots ``segment.slot_offset..``,
    prompt lengths ``segment.kv_lens``; see ``_take``).

    With ``shared`` > 0 the prompts begin with the same ``shared`` tokens (``prefix_share.py``): those
    run once, in a forward of their own (:meth:`prefix_segment`) whose cache is copied into every
    prompt's slot, and ``segment`` holds the rest of each prompt (positions ``shared..``)."""

    batch: list[GenerateRequest]
    segment: Segment
    lens: list[int]
    """Prompt lengths (on the host: read per prompt while spreading the prefill)."""
    counts: list[int]
    """The samples each prompt starts now: its ``n``, but for a last one whose other samples park
    (``admission.plan_admission``)."""
    shared: int = 0
    """How many first tokens all the prompts share and ``segment`` leaves out."""
    prefix_aux: torch.Tensor | None = None
    """``[1, shared, A]``: the aux states of the shared tokens' forward, once it ran (None: no aux asked)."""

    @classmethod
    def of(cls, batch: list[GenerateRequest], base: int, device: torch.device,
           counts: list[int] | None = None, shared: int = 0) -> Admission:
        """``batch``'s prompts (past their first ``shared`` tokens) as one prefill segment into slots
        ``base..``, padded to the longest; packed (the prompts' tokens, not the padding) where the forward
        runs its layers in Python anyway: beside running rows (``base > 0``), or too many rows for the C++
        layers (``layers.fused_layers.fused_input``)."""
        p, n = len(batch), [len(r.input_ids) for r in batch]
        if not 0 <= shared < min(n):
            raise ValueError(f"a shared prefix of {shared} tokens must leave every prompt a token to run "
                             f"(shortest prompt: {min(n)})")
        t = max(n) - shared
        ids = pad_rows([r.input_ids[shared:] for r in batch], t, 0, device)
        lens = torch.tensor(n, device=device)
        pos = torch.arange(shared, shared + t, device=device).expand(p, t)
        pack = (pos < lens.unsqueeze(1) if sum(n) - p * shared < p * t and (base or p * t > SMALL_MAX_ROWS)
                else None)
        segment = Segment(ids, pos, lens, base, (lens - 1 - shared).unsqueeze(1), pack=pack)
        return cls(batch, segment, n, counts if counts is not None else [r.n for r in batch], shared)

    def prefix_segment(self) -> Segment:
        """The shared tokens as a segment of one row, into the first prompt's slot (only the last position's
        logits asked: nothing reads them)."""
        c, device = self.shared, self.segment.input_ids.device
        ids = torch.tensor([self.batch[0].input_ids[:c]], dtype=torch.long, device=device)
        pos = torch.arange(c, device=device).unsqueeze(0)
        return Segment(ids, pos, torch.tensor([c], device=device), self.segment.slot_offset,
                       torch.tensor([[c - 1]], device=device))

    def whole_aux(self, aux: torch.Tensor | None) -> torch.Tensor | None:
        """The prefill's aux states over whole prompts, ``[P, T, A]`` (``aux``: ``segment``'s), the shared
        tokens' in front."""
        if aux is None or not self.shared:
            return aux
        return torch.cat([self.prefix_aux.expand(aux.shape[0], -1, -1), aux], 1)
