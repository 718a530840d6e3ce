"""What the verifier's forward records for the draft, and how much of it: :class:`CaptureConfig`.

Also ModelOpt's default EAGLE-3 feature layers (:func:`default_aux_layer_ids`), the layers captured
when a draft names none. It knows no model, hooks or cache (``megatron_spec.capture.hooks`` and
``megatron_spec.capture.recorder`` act on it).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_spec.dtypes import torch_dtype

FORWARDS = ("logprob", "train")
"""The GRPO loop's forwards a capture can record."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """ModelOpt's default EAGLE-3 feature layers: ``sorted({1, L//2 - 1, L - 4})`` clamped at 0 (the layers
    captured when a draft names none; ``megatron_spec.draft.eagle3_config`` writes the same into its
    exports)."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What the verifier's forward records for the draft, and how much of it."""

    draft_kind: str = "eagle3"
    """``eagle3`` (aux layer outputs) or ``mtp`` (final-normed hidden states)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 feature layers in ``fc`` order (the draft's ``eagle_config``); None = ModelOpt's
    default ``sorted({1, L//2 - 1, L - 4})``."""
    teacher_topk: int | None = 32
    """Keep the teacher's k most likely draft-vocabulary entries per row; None = all of them."""
    draft_target_ids: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """``[Vd]`` target id of each draft id (``arange + d2t``) of a reduced draft vocabulary; None = full."""
    storage_dtype: str = "bfloat16"
    """dtype of the stored features (bfloat16 | float32 | float16); the teacher is float32."""
    max_bytes: int = 1 << 30
    """Bound on this rank's cache; segments beyond it are dropped (counted in ``capture/dropped_rows``)."""
    shard_across_tp: bool | None = None
    """Each TP rank keeps every tp-th segment (default: True for eagle3; mtp requires False)."""
    forward: str = "logprob"
    """Which forward the GRPO loop records: ``logprob`` (the old-log-prob recompute, default) or
    ``train`` (the policy's training forward)."""
    prompt_context: bool | None = None
    """Also capture every position before a sequence's last response token that is not a response
    token (the prompt) as a *context* row (``DraftCache.scored`` False: attended to, never scored).
    The engine's draft attends to the prompt after its prefill, so a draft trained without it
    learns a function it is never served with. None = False here; ``Eagle3Trainer.capture_config``
    turns it on (docs/draft_training.md, "Why online training lowered acceptance")."""

    def __post_init__(self) -> None:
        if self.draft_kind not in ("eagle3", "mtp"):
            raise ValueError(f"capture draft_kind must be 'eagle3' or 'mtp', got {self.draft_kind!r}")
        torch_dtype(self.storage_dtype, "capture storage_dtype")  # raises for an unknown name
        if self.teacher_topk is not None and self.teacher_topk < 1:
            raise ValueError(f"capture teacher_topk must be >= 1 or None, got {self.teacher_topk}")
        if self.max_bytes <= 0:
            raise ValueError(f"capture max_bytes must be positive, got {self.max_bytes}")
        if self.forward not in FORWARDS:
            raise ValueError(f"capture forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.shard_across_tp is None:
            object.__setattr__(self, "shard_across_tp", self.draft_kind == "eagle3")
        if self.draft_kind == "mtp" and self.shard_across_tp:
            raise ValueError(
                "capture shard_across_tp=True with draft_kind 'mtp': MTP layers are tensor-parallel, "
                "every TP rank must hold the same rows"
            )
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
            if self.draft_kind != "eagle3":
                raise ValueError("capture aux_layer_ids is an EAGLE-3 setting; draft_kind is 'mtp'")
        if self.draft_target_ids is not None:
            ids = torch.as_tensor(self.draft_target_ids, dtype=torch.long, device="cpu").reshape(-1)
            if torch.unique(ids).numel() != ids.numel():
                raise ValueError("capture draft_target_ids maps two draft ids to one target id")
            object.__setattr__(self, "draft_target_ids", ids)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.storage_dtype)


__all__ = ["FORWARDS", "CaptureConfig", "default_aux_layer_ids"]
