"""Forward hooks on a megatron-core ``GPTModel`` that fill the draft-training cache.

Usage, around the verifier forward the GRPO loop runs anyway::

    capture = Capture(trainer.capture_config(CaptureConfig(...)))
    with capture.record(policy, response_mask):          # one forward per block
        logits = policy(input_ids, position_ids, attention_mask=None)
    ...
    metrics = trainer.train_step(capture.take())

What is recorded, per captured token ``x_t`` (``response_mask[b, t]`` True, t >= 1, and with
``prompt_context`` the positions before the response as unscored context rows; see
:mod:`megatron_spec.capture.cache` for the row convention):

* outputs of the aux decoder layers at ``t - 1`` (EAGLE-3; forward hooks on
  ``decoder.layers[i]``: "output of layer i", which is transformers' ``hidden_states[i + 1]``),
  or the final-normed decoder output at ``t - 1`` (MTP; hook on ``decoder.final_layernorm``);
* the embedding of ``x_t`` (hook on ``embedding``: the draft needs the target's embedding and
  this avoids a vocab-parallel lookup later);
* the teacher at ``t`` and the target log-prob of ``x_{t+1}`` (hook on ``output_layer``; computed
  from the vocab-parallel logits, see :mod:`megatron_spec.capture.teacher`).

Every hook reads ``.detach()``ed tensors under ``no_grad``, gathers only the selected rows and
returns None: the model's outputs, its autograd graph and its RNG are untouched. Hooks exist only
inside ``record``; with capture off the model carries no hook at all.

:class:`Capture` owns this rank's cache and its budget; the hooks themselves, and how they treat
tensor, sequence and pipeline parallelism and devices, are :mod:`megatron_spec.capture.recorder`'s;
what to record is a :class:`~megatron_spec.capture.config.CaptureConfig`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache
from megatron_spec.capture.config import FORWARDS, CaptureConfig
from megatron_spec.capture.recorder import Recorder


class Capture:
    """Owns the cache this rank fills; ``record`` attaches hooks around one forward."""

    def __init__(self, config: CaptureConfig, *, tp_group: dist.ProcessGroup | None = None):
        self.config = config
        self._tp_group = tp_group
        self._parts: list[DraftCache] = []
        self.bytes = 0
        """Bytes held now."""
        self.peak_bytes = 0
        """Largest cache held since the last ``reset_metrics`` (what ``take`` handed out)."""
        self.dropped_rows = 0
        self.rows = 0
        self.seconds = 0.0
        self._segments_seen = 0  # round-robin position for TP sharding (same on all TP ranks)

    @classmethod
    def for_trainer(
        cls, trainer: Any, base: CaptureConfig | None = None, *, tp_group: dist.ProcessGroup | None = None
    ) -> Capture:
        """A capture recording what ``trainer`` (``Eagle3Trainer`` / ``MtpTrainer``) trains on;
        ``base`` sets the rest (top-k, dtype, budget, which forward)."""
        return cls(trainer.capture_config(base), tp_group=tp_group)

    def wants(self, forward: str) -> bool:
        """True when the GRPO loop should wrap ``forward`` (``logprob`` or ``train``) in :meth:`record`."""
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
        return forward == self.config.forward

    @contextlib.contextmanager
    def record(self, model: torch.nn.Module, response_mask: torch.Tensor) -> Iterator[Recorder]:
        """Capture the next forward of ``model`` (a GPTModel, possibly DDP/Float16-wrapped).

        Args:
            response_mask: ``[B, S]`` bool, True where ``input_ids[b, t]`` is a token whose draft
                row should be kept (the response tokens). Position 0 is never captured.

        Keep the backward pass outside the block: hooks are removed on exit, so activation
        recomputation in backward never records twice.
        """
        rec = Recorder(self, model, response_mask)
        rec.attach()
        try:
            yield rec
        finally:
            rec.detach()
        rec.check_complete()

    def take(self) -> DraftCache | None:
        """The rows captured since the last ``take`` (None if nothing was), and reset the cache."""
        parts, self._parts = self._parts, []
        self.bytes = 0
        if not parts:
            return None
        return DraftCache.concat(parts)

    def metrics(self) -> dict[str, float]:
        """Since the last :meth:`reset_metrics`: ``capture/bytes`` (peak cache size), ``capture/rows``
        (rows captured), ``capture/dropped_rows`` (turned away by the budget), ``capture/seconds``
        (time spent inside the hooks)."""
        return {
            "capture/bytes": float(max(self.peak_bytes, self.bytes)),
            "capture/rows": float(self.rows),
            "capture/dropped_rows": float(self.dropped_rows),
            "capture/seconds": self.seconds,
        }

    def reset_metrics(self) -> None:
        self.dropped_rows, self.seconds, self.rows, self.peak_bytes = 0, 0.0, 0, self.bytes

    def _append(self, part: DraftCache) -> None:
        self._parts.append(part)
        self.bytes += part.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.rows += part.num_rows
        self.dropped_rows += part.dropped_rows

    def tp_group(self) -> dist.ProcessGroup | None:
        if self._tp_group is not None:
            return self._tp_group
        from megatron.core import parallel_state as ps

        if dist.is_initialized() and ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_group()
        return None


def response_mask_from_targets(target_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` token-aligned response mask from a ``[B, S-1]`` mask aligned with the targets
    ``input_ids[:, 1:]`` (the layout of GRPO's per-token log-prob masks)."""
    out = torch.zeros(
        target_mask.shape[0], target_mask.shape[1] + 1, dtype=torch.bool, device=target_mask.device
    )
    out[:, 1:] = target_mask > 0
    return out


__all__ = ["Capture", "response_mask_from_targets"]
