"""The draft-training cache: what the verifier's forward leaves behind for the draft, packed by row.

One *row* per captured token ``x_t`` (t >= 1) of a sequence, in the draft's own convention
(EAGLE-3 and MTP alike; see ``megatron_spec.draft.eagle3``): the draft pair at row t is
(target features at position ``t - 1``, embedding of ``x_t``) at RoPE position ``t - 1``, and it
predicts ``x_{t+1}``, whose target distribution is the teacher::

    aux[r]        = cat(output of decoder layer i at position t-1 for i in aux_layer_ids)   EAGLE-3
    hidden[r]     = final-normed decoder output at position t-1                              MTP
    embeds[r]     = embedding of x_t                                                          both
    positions[r]  = t - 1
    teacher[r]    = target log-probs at position t (restricted to the draft vocabulary)
    teacher_log_mass[r] = log of the target's mass on the draft vocabulary at position t
    next_tokens[r]= x_{t+1} (-1 when x_{t+1} is not captured: end of the response)

Rows are packed with no padding; ``cu_seqlens`` delimits *segments*, maximal runs of consecutive
captured positions of one sequence (a training-time-test unroll never crosses a segment).
Everything is detached; features may be stored in bf16.

Devices: the row fields stay where capture made them, on the model's device (a GPU run keeps
the cache in GPU memory, bounded by ``CaptureConfig.max_bytes``, from the logprob forward to the
draft's update, which reads it on the same device: docs/memory_plan.md). ``cu_seqlens`` is host
bookkeeping on the CPU: segment lengths are read one by one to batch segments, and a device
copy would sync for each. Indices into the row fields are made on the row fields' device.

This module holds data and its arithmetic (bytes, segment selection, padding into batches);
it knows nothing of models, hooks or process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

_ROW_FIELDS = (
    "tokens",
    "positions",
    "embeds",
    "aux",
    "hidden",
    "next_tokens",
    "next_logprobs",
    "teacher_ids",
    "teacher_logprobs",
    "teacher_log_mass",
    "scored",
)


@dataclasses.dataclass
class DraftCache:
    """Packed captured rows (``N`` rows in ``S`` segments). Tensor fields may be None when not captured."""

    tokens: torch.Tensor
    """``[N]`` int64 ``x_t``."""
    positions: torch.Tensor
    """``[N]`` int64 ``t - 1`` (the draft row's RoPE position)."""
    next_tokens: torch.Tensor
    """``[N]`` int64 ``x_{t+1}``, -1 where it is not part of the capture."""
    next_logprobs: torch.Tensor
    """``[N]`` float32 target log-prob of ``x_{t+1}`` at T=1 (0 where ``next_tokens`` is -1)."""
    teacher_logprobs: torch.Tensor
    """``[N, k]`` (top-k) or ``[N, Vd]`` (full draft vocabulary) float32 target log-probs at position t,
    normalised over the draft vocabulary."""
    cu_seqlens: torch.Tensor
    """``[S + 1]`` int64 segment boundaries (on the CPU, whatever the row fields' device)."""
    teacher_ids: torch.Tensor | None = None
    """``[N, k]`` int64 draft-vocabulary ids of ``teacher_logprobs`` (descending); None = full vocabulary."""
    teacher_log_mass: torch.Tensor | None = None
    """``[N]`` float32 log of the target's T=1 probability mass on the draft vocabulary at position t
    (what the renormalised teacher leaves out: ``capture.teacher.draft_vocab_log_mass``); None = 0,
    a full-vocabulary teacher or a cache captured without it."""
    embeds: torch.Tensor | None = None
    """``[N, H]`` embedding of ``x_t``."""
    aux: torch.Tensor | None = None
    """``[N, n_aux * H]`` EAGLE-3 features (outputs of the aux layers at ``t - 1``)."""
    hidden: torch.Tensor | None = None
    """``[N, H]`` final-normed decoder output at ``t - 1`` (MTP)."""
    scored: torch.Tensor | None = None
    """``[N]`` bool: rows the draft is trained and evaluated on (the response); None = every row.
    Unscored rows are context only (the prompt): the draft attends to them, as the engine's draft
    does after its prompt prefill, but they carry no loss."""
    dropped_rows: int = 0
    """Rows the memory budget turned away."""

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in _ROW_FIELDS:
            t = getattr(self, name)
            if t is not None and t.shape[0] != n:
                raise ValueError(f"DraftCache.{name} has {t.shape[0]} rows, tokens has {n}")
        if self.cu_seqlens.dim() != 1 or int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != n:
            raise ValueError(
                f"DraftCache.cu_seqlens must run from 0 to {n}, got {self.cu_seqlens.tolist()[:8]}..."
            )

    # ------------------------------------------------------------------ size
    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_scored(self) -> int:
        return self.num_rows if self.scored is None else int(self.scored.sum())

    def scored_mask(self) -> torch.Tensor:
        """``[N]`` bool, all True when every row is scored."""
        if self.scored is None:
            return torch.ones(self.num_rows, dtype=torch.bool, device=self.tokens.device)
        return self.scored

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors()) + self.cu_seqlens.numel() * 8

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in _ROW_FIELDS if getattr(self, n) is not None]

    @property
    def full_vocab_teacher(self) -> bool:
        return self.teacher_ids is None

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty_like(cls, template: DraftCache) -> DraftCache:
        return template.select_segments([])

    @classmethod
    def concat(cls, parts: Sequence[DraftCache]) -> DraftCache:
        """Rows of ``parts`` one after the other (all parts must hold the same fields)."""
        if not parts:
            raise ValueError("DraftCache.concat needs at least one part")
        fields = {}
        for name in _ROW_FIELDS:
            present = [getattr(p, name) is not None for p in parts]
            if any(present) and not all(present):
                raise ValueError(f"DraftCache.concat: field {name} captured in some parts only")
            fields[name] = torch.cat([getattr(p, name) for p in parts]) if all(present) else None
        offsets, cu = 0, [torch.zeros(1, dtype=torch.long, device=parts[0].cu_seqlens.device)]
        for p in parts:
            cu.append(p.cu_seqlens[1:] + offsets)
            offsets += p.num_rows
        return cls(cu_seqlens=torch.cat(cu), dropped_rows=sum(p.dropped_rows for p in parts), **fields)

    def select_segments(self, indices: Sequence[int] | torch.Tensor) -> DraftCache:
        """A cache holding only the given segments (in the given order)."""
        host = self.cu_seqlens.device
        idx = torch.as_tensor(indices, dtype=torch.long, device=host).reshape(-1)
        starts, lens = self.cu_seqlens[:-1][idx], self.seqlens[idx]
        out_starts = torch.cumsum(lens, 0) - lens  # where each segment begins in the result
        rows = torch.repeat_interleave(starts - out_starts, lens) + torch.arange(int(lens.sum()), device=host)
        rows = rows.to(self.tokens.device)  # indexes the row fields
        fields = {n: (getattr(self, n)[rows] if getattr(self, n) is not None else None) for n in _ROW_FIELDS}
        cu = torch.cat([torch.zeros(1, dtype=torch.long, device=host), torch.cumsum(lens, 0)])
        return DraftCache(cu_seqlens=cu, dropped_rows=self.dropped_rows, **fields)

    # ------------------------------------------------------------------ batching
    def padded(self, field: str, segments: Sequence[int], pad_value: float | int = 0) -> torch.Tensor:
        """``field`` of ``segments`` right-padded into ``[B, S_max, ...]`` (S_max = longest segment)."""
        src = getattr(self, field)
        if src is None:
            raise ValueError(f"DraftCache has no {field} (not captured for this draft kind)")
        return self.pad_rows(src, segments, pad_value)

    def pad_rows(
        self, src: torch.Tensor, segments: Sequence[int], pad_value: float | int = 0
    ) -> torch.Tensor:
        """Any per-row tensor ``src [N, ...]`` right-padded by segment into ``[B, S_max, ...]``."""
        lens = [int(self.seqlens[s]) for s in segments]
        out = src.new_full((len(segments), max(lens, default=0), *src.shape[1:]), pad_value)
        for b, (s, n) in enumerate(zip(segments, lens)):
            start = int(self.cu_seqlens[s])
            out[b, :n] = src[start : start + n]
        return out

    def to(self, device: torch.device | str) -> DraftCache:
        fields = {
            n: (getattr(self, n).to(device) if getattr(self, n) is not None else None) for n in _ROW_FIELDS
        }
        return DraftCache(cu_seqlens=self.cu_seqlens, dropped_rows=self.dropped_rows, **fields)


def segment_runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of True in each row of ``mask [B, S]``: ``(b, start, length)`` in row-major order."""
    m = mask.to(torch.int8)
    pad = torch.zeros(m.shape[0], 1, dtype=torch.int8, device=m.device)
    edges = torch.diff(torch.cat([pad, m, pad], dim=1), dim=1)  # [B, S+1]: +1 at starts, -1 past ends
    starts = (edges == 1).nonzero().tolist()
    ends = (edges == -1).nonzero().tolist()
    return [(b, s, e - s) for (b, s), (_, e) in zip(starts, ends)]


def micro_batches(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """Group segment indices into padded micro-batches of at most ``max_rows`` padded rows
    (``B * S_max``); segments are taken longest first so padding stays small. A segment longer
    than ``max_rows`` gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_rows:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


__all__ = ["DraftCache", "micro_batches", "segment_runs"]
