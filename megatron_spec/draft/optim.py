"""What every online draft trainer shares: its config, its optimizer group, its data selection.

* :class:`DraftTrainerConfig`: optimizer, schedule, clipping, TTT unroll, loss and row budget
  of the online draft (one RL step = one optimizer step).
* :class:`DraftOptimizer`: AdamW + LR schedule + gradient clipping + data-parallel all-reduce over
  an explicit group, separate from the policy's (the detached-draft contract).
* :func:`choose_segments` / :func:`reduce_metric_sums`: row budget and metric reductions.

It knows no draft architecture (``trainer.Eagle3Trainer``, ``mtp.MtpTrainer`` use it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache, micro_batches

HOST = torch.device("cpu")
"""Where the trainers keep what they read on the host: metric sums, per-row evaluation results."""


@dataclasses.dataclass(frozen=True)
class DraftTrainerConfig:
    """Online draft training (one optimizer step per RL step). CLI: ``--spec-draft-*``."""

    ttt_steps: int = 3
    """Training-time-test unroll of the EAGLE-3 head (``--spec-draft-ttt-steps``; ModelOpt's
    ``eagle_ttt_steps``)."""
    loss: str = "soft"
    """``soft``: cross-entropy against the teacher distribution; ``hard``: against the sampled next tokens."""
    tv_weight: float = 0.0
    """``soft`` loss only: add ``tv_weight`` times the total variation ``1 - sum min(p, q)`` on the teacher's
    entries (``losses.tv_loss_rows``), the acceptance itself as a loss (``--spec-draft-tv-weight``); EAGLE-3
    only."""
    loss_decay: float = 0.9
    """Weight ``loss_decay ** s`` of TTT step s (MTP: of depth s); ModelOpt's ``eagle_loss_decay_factor``."""
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    """Cosine schedule floor, as a fraction of ``lr``."""
    lr_schedule: str = "constant"
    """``constant`` or ``cosine`` (after ``warmup_steps`` of linear warm-up)."""
    warmup_steps: int = 0
    total_steps: int = 1000
    """Length of the cosine schedule (steps after it stay at the floor)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    """Clip the draft's global gradient norm (its own group; None = off)."""
    micro_batch_rows: int = 4096
    """Padded rows (segments x longest segment) per forward/backward; bounds activation memory."""
    max_rows_per_step: int | None = None
    """Train on at most this many rows per rank and step (whole segments, drawn at random); None = all."""
    freeze_input_layernorm: bool = True
    """Keep EAGLE-3 ``layers.0.input_layernorm`` fixed (ModelOpt's and SGLang's math then agree)."""
    export_dtype: str | None = None
    """dtype of exported/streamed tensors (``bfloat16`` | ``float32``); None = the master dtype."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"draft ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.loss not in ("soft", "hard"):
            raise ValueError(f"draft loss must be 'soft' or 'hard', got {self.loss!r}")
        if not (self.tv_weight >= 0 and math.isfinite(self.tv_weight)):
            raise ValueError(f"draft tv_weight must be >= 0 and finite, got {self.tv_weight}")
        if self.tv_weight and self.loss != "soft":
            raise ValueError(
                "draft tv_weight needs the soft loss (the teacher's distribution), got loss='hard'"
            )
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"draft lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"draft lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}"
            )
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("draft warmup_steps must be >= 0 and total_steps >= 1")
        if self.micro_batch_rows < 1:
            raise ValueError(f"draft micro_batch_rows must be >= 1, got {self.micro_batch_rows}")
        if self.max_rows_per_step is not None and self.max_rows_per_step < 1:
            raise ValueError(f"draft max_rows_per_step must be >= 1 or None, got {self.max_rows_per_step}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"draft grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.export_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(
                f"draft export_dtype must be bfloat16, float32 or None, got {self.export_dtype!r}"
            )

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class DraftOptimizer:
    """AdamW + LR schedule + gradient clipping + data-parallel gradient all-reduce for draft weights.

    Gradients are summed over ``dp_group`` (the losses are pre-normalised by global counts).
    Under tensor parallelism (MTP), ``tp_partial`` parameters hold per-rank partial gradients
    that are first summed over ``tp_group`` (megatron-core's rule for q/k layernorms, which each
    rank applies to its own heads only); the gradient norm counts each TP shard once and each
    replicated parameter once (parameters with ``tensor_model_parallel=True`` are shards).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        config: DraftTrainerConfig,
        *,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        tp_partial: Sequence[torch.nn.Parameter] = (),
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("draft optimizer has no trainable parameters")
        self.config = config
        self.dp_group, self.tp_group = dp_group, tp_group
        partial = {id(p) for p in tp_partial}
        self._partial = [i for i, p in enumerate(self.params) if id(p) in partial]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_factor)

    @property
    def device(self) -> torch.device:
        """The draft's device: its gradients, and what its collectives reduce, live there."""
        return self.params[0].device

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> dict[str, float]:
        """Reduce, clip and apply the accumulated gradients; returns ``grad_norm`` and ``lr`` (pre-step)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._partial and group_info(self.tp_group)[1] > 1:
            part = [grads[i] for i in self._partial]
            flat = torch._utils._flatten_dense_tensors(part)
            dist.all_reduce(flat, group=self.tp_group)
            for i, g in zip(self._partial, torch._utils._unflatten_dense_tensors(flat, part)):
                grads[i] = g
        if group_info(self.dp_group)[1] > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_group)
            grads = list(torch._utils._unflatten_dense_tensors(flat, grads))
        for p, g in zip(self.params, grads):
            p.grad = g
        sharded = sum(
            (
                g.double().pow(2).sum()
                for p, g in zip(self.params, grads)
                if getattr(p, "tensor_model_parallel", False)
            ),
            torch.zeros((), dtype=torch.float64, device=self.device),
        )
        replicated = sum(
            (
                g.double().pow(2).sum()
                for p, g in zip(self.params, grads)
                if not getattr(p, "tensor_model_parallel", False)
            ),
            torch.zeros((), dtype=torch.float64, device=self.device),
        )
        if group_info(self.tp_group)[1] > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        norm = float((sharded + replicated).sqrt())
        if not math.isfinite(norm):
            self.zero_grad()
            raise FloatingPointError(f"draft gradient norm is {norm}; the draft step was skipped")
        clip = self.config.grad_clip
        if clip is not None and norm > clip:
            scale = clip / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        return {"grad_norm": norm, "lr": lr}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def reduce_metric_sums(
    sums: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Sum a small metric tensor over the draft group (a copy on ``device``, the draft's: NCCL
    reduces device tensors only; float64 for exact counts)."""
    out = sums.detach().to(device=device, dtype=torch.float64, copy=True)
    if group_info(group)[1] > 1:
        dist.all_reduce(out, group=group)
    return out


def scored_rows_per_step(cache, segments: list[int], lens: list[int], steps: int,
                         label_ok: torch.Tensor | None) -> torch.Tensor:
    """Rows scored at each of ``steps`` unrolled draft steps (``[steps]`` float64): step s of a
    segment of n rows scores its rows s..n-1 that are scored rows of the cache (``cache.scored``;
    context rows never are) and, for the hard loss, have a valid label (``label_ok [rows]`` bool).
    Shared by the EAGLE-3 and MTP trainers."""
    local = torch.zeros(steps, dtype=torch.float64, device=HOST)
    scored = getattr(cache, "scored", None) if cache is not None else None
    if label_ok is None and scored is None:
        for s_i in range(steps):
            local[s_i] = sum(max(0, n - s_i) for n in lens)
        return local
    ok = label_ok if label_ok is not None else scored
    if label_ok is not None and scored is not None:
        ok = label_ok & scored
    ok = ok.to(HOST)  # one copy: the loop below reads it segment by segment
    for s_i in range(steps):
        for seg, n in zip(segments, lens):
            start = int(cache.cu_seqlens[seg])
            local[s_i] += int(ok[start + s_i:start + n].sum()) if n > s_i else 0
    return local


class DraftUpdate:
    """The update loop shared by the EAGLE-3 and MTP trainers (mixed into both). A trainer has
    ``optimizer``, ``step``, ``export_dir`` and ``export(dir)``, and a
    ``_micro_batch(cache, segs, weights, counts, label_ok) -> (loss, loss_sums[n], agree_sums[n])``."""

    def _update(
        self,
        cache,
        segments: list[int],
        lens: list[int],
        weights: Sequence[float],
        label_ok: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        tag: str,
        t0: float,
    ) -> dict[str, float]:
        """Global scored-row counts per unrolled step (the loss normaliser), backward over
        micro-batches of ``segments`` (gradient accumulation), one optimizer step, then the
        metrics: ``draft/loss_{tag}{s}``, ``draft/acc_{tag}{s}`` (means over the group), their
        ``weights``-weighted sum ``draft/loss``, ``draft/rows``, ``draft/grad_norm``, ``draft/lr``,
        ``draft/step``, ``draft/train_seconds`` (since ``t0``) and, when exporting,
        ``draft/export_seconds``."""
        n = len(weights)
        dev = self.optimizer.device
        local_counts = scored_rows_per_step(cache, segments, lens, n, label_ok)
        counts = reduce_metric_sums(local_counts, group, dev).clamp(min=1.0)
        loss_sums = torch.zeros(n, dtype=torch.float64, device=HOST)  # float()s of the micro-batches' sums
        agree = torch.zeros(n, dtype=torch.float64, device=HOST)
        for mb in micro_batches(lens, self.config.micro_batch_rows):
            loss, l_s, a_s = self._micro_batch(cache, [segments[i] for i in mb], weights, counts, label_ok)
            loss.backward()
            loss_sums += l_s
            agree += a_s
        opt = self.optimizer.step()
        self.step += 1
        rows = torch.tensor([float(sum(lens))], dtype=torch.float64, device=HOST)
        totals = reduce_metric_sums(torch.cat([loss_sums, agree, rows]), group, dev)
        out = {
            "draft/step": float(self.step),
            "draft/rows": float(totals[-1]),
            "draft/grad_norm": opt["grad_norm"],
            "draft/lr": opt["lr"],
        }
        total_loss = 0.0
        for s_i in range(n):
            mean = float(totals[s_i] / counts[s_i])
            out[f"draft/loss_{tag}{s_i}"] = mean
            out[f"draft/acc_{tag}{s_i}"] = float(totals[n + s_i] / counts[s_i])
            total_loss += weights[s_i] * mean
        out["draft/loss"] = total_loss
        out["draft/train_seconds"] = time.perf_counter() - t0
        if self.export_dir is not None:
            t1 = time.perf_counter()
            self.export(self.export_dir)
            out["draft/export_seconds"] = time.perf_counter() - t1
        return out


def choose_segments(cache: DraftCache, max_rows: int | None, generator: torch.Generator) -> list[int]:
    """All segments, or whole segments in random order until ``max_rows`` rows are reached."""
    if max_rows is None or cache.num_rows <= max_rows:
        return list(range(cache.num_segments))
    order = torch.randperm(cache.num_segments, generator=generator).tolist()
    lens = cache.seqlens.tolist()
    chosen, rows = [], 0
    for s in order:
        if rows + lens[s] > max_rows and chosen:
            continue
        chosen.append(s)
        rows += lens[s]
        if rows >= max_rows:
            break
    return sorted(chosen)


STATE_FILE = "draft_trainer.pt"


def atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


__all__ = [
    "HOST",
    "STATE_FILE",
    "DraftOptimizer",
    "DraftTrainerConfig",
    "atomic_save",
    "choose_segments",
    "group_info",
    "reduce_metric_sums",
]
