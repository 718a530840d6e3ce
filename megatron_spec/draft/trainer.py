"""Online draft training on the capture cache: the EAGLE-3 head with a training-time-test unroll.

:class:`Eagle3Trainer` owns the head (float32 master weights), its optimizer (AdamW), learning-rate
schedule, gradient-clipping group and checkpoint; nothing of it is shared with the policy. One
:meth:`Eagle3Trainer.train_step` is one optimizer step on the rows captured by
``megatron_spec.capture`` since the previous step:

1. segments (optionally subsampled to ``max_rows_per_step``) are right-padded into micro-batches;
2. per micro-batch, ``h0 = fc(aux)`` and ``ttt_steps`` forwards of the head (training-time test,
   ModelOpt's recipe): step s attends to the verified rows ``<= q - s`` and to its own chain's
   earlier steps (``ttt_attention_mask``), takes the previous step's hidden state shifted by one row,
   and is scored on rows ``q >= s`` against the teacher (soft cross-entropy, or hard
   cross-entropy on the sampled tokens), weighted ``loss_decay ** s``;
3. gradients are summed over the draft's data-parallel group (losses are normalised by the
   *global* row count, so DP=N equals DP=1 on the concatenated rows), clipped, applied.

The unroll of step 2 and the held-out acceptance (:meth:`Eagle3Trainer.evaluate`) are
:mod:`megatron_spec.draft.eagle3_ttt`'s.

:class:`DraftTrainerConfig` and :class:`DraftOptimizer` (optimizer, schedule, clipping, DP
all-reduce) live in :mod:`megatron_spec.draft.optim`, shared with the MTP trainer
(``megatron_spec.draft.mtp``), and are re-exported here. :func:`build_draft_trainer` builds the
trainer a run's draft section asks for.

Initialisation is a ModelOpt export (:meth:`Eagle3Trainer.from_modelopt`); after each update the
head can be exported back in the same format (``export_dir``) and streamed by export name
(:meth:`Eagle3Trainer.named_update_tensors`). The head is trained with the serving engines' math
(``hidden_norm(h)``); ``input_layernorm`` stays frozen at its initial value by default so the
export also means the same thing under ModelOpt's trainer (see ``megatron_spec.draft.eagle3``).

This module does not know the policy, hooks or the rollout engine.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache
from megatron_spec.draft.eagle3 import Eagle3Head
from megatron_spec.draft.eagle3_ttt import (
    RowAcceptance,
    TttStep,
    acceptance_metrics,
    eagle3_acceptance,
    ttt_unroll,
)
from megatron_spec.draft.losses import (
    hard_cross_entropy_sum,
    soft_cross_entropy_sum,
    top1_agreement_sum,
    ttt_step_weights,
    tv_loss_sum,
)
from megatron_spec.draft.optim import (
    HOST,
    STATE_FILE,
    DraftOptimizer,
    DraftTrainerConfig,
    DraftUpdate,
    atomic_save,
    choose_segments,
    group_info,
    reduce_metric_sums,
)
from megatron_spec.interfaces import DraftLearner


class Eagle3Trainer(DraftUpdate, DraftLearner):
    """The EAGLE-3 head, trained online on captured verifier states."""

    def __init__(
        self,
        head: Eagle3Head,
        config: DraftTrainerConfig = DraftTrainerConfig(),
        *,
        group: dist.ProcessGroup | None = None,
        export_dir: str | os.PathLike | None = None,
    ):
        if head.cfg.double_hidden_norm:
            raise ValueError(
                "Eagle3Trainer trains the serving engines' math; load the head with double_hidden_norm=False"
            )
        self.head = head.float().train()
        self.config = config
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank, self.world = group_info(group)
        if config.freeze_input_layernorm:
            head.input_layernorm.weight.requires_grad_(False)
        self.optimizer = DraftOptimizer(list(head.parameters()), config, dp_group=group)
        self.export_dir = os.fspath(export_dir) if export_dir is not None else None
        self.generator = torch.Generator().manual_seed(config.seed * 1000003 + self.rank)
        self.step = 0
        cfg = head.cfg
        # target id -> draft id (hard CE), on the head's device: it maps the cache's next tokens there
        dev = head.lm_head.weight.device
        self._t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=dev)
        self._t2d[head.target_ids.to(dev)] = torch.arange(cfg.draft_vocab_size, device=dev)

    @classmethod
    def from_modelopt(
        cls,
        path: str | os.PathLike,
        target_cfg,
        config: DraftTrainerConfig = DraftTrainerConfig(),
        *,
        load_overrides: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
        **kwargs: Any,
    ) -> Eagle3Trainer:
        """Start from a ModelOpt export directory (``config.json`` + ``model.safetensors``).

        ``load_overrides``: :class:`Eagle3Config` fields to replace (e.g. ``rope_scaling=None``,
        see :func:`megatron_spec.draft.modelopt_io.read_eagle3_config`); ``device``: where the head
        trains (the policy's device in a GRPO run: the cache it reads is there); ``kwargs`` go to
        the constructor.
        """
        from megatron_spec.draft.modelopt_io import load_eagle3

        head = load_eagle3(path, target_cfg, dtype=torch.float32, **(load_overrides or {}))
        return cls(head.to(device), config, **kwargs)

    # ------------------------------------------------------------------ wiring
    def capture_config(self, base=None):
        """``base`` (a :class:`~megatron_spec.capture.CaptureConfig`) with this head's feature
        layers and draft vocabulary filled in."""
        from megatron_spec.capture.config import CaptureConfig

        base = base or CaptureConfig()
        cfg = self.head.cfg
        return dataclasses.replace(
            base,
            draft_kind="eagle3",
            aux_layer_ids=tuple(cfg.aux_layer_ids),
            draft_target_ids=self.head.target_ids.cpu() if cfg.reduced_vocab else None,
            shard_across_tp=base.shard_across_tp if base.draft_kind == "eagle3" else None,
            # the engine's draft attends to the prompt (its prefill): train with it as context
            prompt_context=True if base.prompt_context is None else base.prompt_context,
        )

    # ------------------------------------------------------------------ training
    def _check(self, cache: DraftCache) -> None:
        cfg = self.head.cfg
        if cache.aux is None or cache.embeds is None:
            raise ValueError("Eagle3Trainer needs a cache captured with draft_kind='eagle3' (aux and embeds)")
        if cache.aux.shape[1] != cfg.num_aux * cfg.hidden_size:
            raise ValueError(
                f"cache aux width {cache.aux.shape[1]} != {cfg.num_aux} aux layers x hidden "
                f"{cfg.hidden_size}: captured with other aux_layer_ids?"
            )
        if cache.teacher_ids is None and cache.teacher_logprobs.shape[1] != cfg.draft_vocab_size:
            raise ValueError(
                f"cache teacher covers {cache.teacher_logprobs.shape[1]} ids, the draft vocabulary "
                f"has {cfg.draft_vocab_size}"
            )

    def train_step(self, cache: DraftCache | None) -> dict[str, float]:
        """One optimizer step on ``cache`` (this rank's rows; None or empty = no rows here).

        Collective over the draft group: every rank calls it once per RL step.

        Returns:
            ``draft/loss`` (weighted sum over TTT steps), ``draft/loss_ttt{s}`` and
            ``draft/acc_ttt{s}`` (top-1 agreement with the teacher) per step, ``draft/rows``,
            ``draft/grad_norm``, ``draft/lr``, ``draft/step``, ``draft/train_seconds`` (and
            ``draft/export_seconds`` when exporting).
        """
        t0 = time.perf_counter()
        cfg = self.config
        steps = cfg.ttt_steps
        weights = ttt_step_weights(steps, cfg.loss_decay)
        segments: list[int] = []
        if cache is not None and cache.num_rows:
            self._check(cache)
            segments = choose_segments(cache, cfg.max_rows_per_step, self.generator)
        lens = [int(cache.seqlens[s]) for s in segments] if segments else []
        label_ok = None
        if cfg.loss == "hard" and segments:
            nxt = cache.next_tokens
            label_ok = (nxt >= 0) & (self._t2d.to(nxt.device)[nxt.clamp(min=0)] >= 0)
        return self._update(cache, segments, lens, weights, label_ok, self.group, "ttt", t0)

    def _unroll(self, cache: DraftCache, segs: list[int], steps: int) -> Iterator[TttStep]:
        """The training-time-test unroll of the head over ``segs`` (:func:`ttt_unroll`)."""
        return ttt_unroll(self.head, cache, segs, steps)

    def _micro_batch(
        self,
        cache: DraftCache,
        segs: list[int],
        weights: list[float],
        counts: torch.Tensor,
        label_ok: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head, cfg = self.head, self.config
        dev = head.lm_head.weight.device
        teacher_lp = cache.padded("teacher_logprobs", segs).to(dev)  # [B, S, k | Vd]
        teacher_ids = cache.padded("teacher_ids", segs).to(dev) if cache.teacher_ids is not None else None
        teacher_top1 = teacher_ids[..., 0] if teacher_ids is not None else teacher_lp.argmax(-1)
        if cfg.loss == "hard":  # draft-vocabulary id of x_{t+1}; rows without one are not scored
            labels = self._t2d[cache.padded("next_tokens", segs).clamp(min=0).to(dev)]
            ok = cache.pad_rows(label_ok, segs, False).to(dev)
        log_mass = (cache.padded("teacher_log_mass", segs).to(dev)
                    if cfg.tv_weight and cache.teacher_log_mass is not None else None)  # [B, S]

        loss = torch.zeros((), device=dev)
        l_sums = torch.zeros(len(weights), dtype=torch.float64, device=HOST)  # metrics, read on the host
        a_sums = torch.zeros(len(weights), dtype=torch.float64, device=HOST)
        for s_i, out, valid in self._unroll(cache, segs, len(weights)):
            lse = out.logits.logsumexp(dim=-1, keepdim=True)  # [B, S, 1]
            if cfg.loss == "soft":
                logq = (out.logits.gather(-1, teacher_ids) if teacher_ids is not None else out.logits) - lse
                l_sum, _ = soft_cross_entropy_sum(logq, teacher_lp, valid)
                if cfg.tv_weight:
                    l_sum = l_sum + cfg.tv_weight * tv_loss_sum(logq, teacher_lp, valid, log_mass)
            else:
                valid = valid & ok
                logq = out.logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1)
                l_sum, _ = hard_cross_entropy_sum(logq, valid)
            loss = loss + weights[s_i] * l_sum / counts[s_i].to(l_sum.dtype)
            l_sums[s_i] = float(l_sum.detach())  # host sync per TTT step: metrics only, a handful per step
            a_sums[s_i] = float(top1_agreement_sum(out.logits.detach().argmax(-1), teacher_top1, valid))
        return loss, l_sums, a_sums

    def acceptance(self, cache: DraftCache, steps: int | None = None) -> RowAcceptance:
        """Per-row expected acceptance of the current head on ``cache`` (no update, no collective):
        ``alpha [steps, N]``, ``ce [steps, N]`` and ``tau [N]`` of :func:`eagle3_acceptance`.
        ``steps`` defaults to the trainer's ``ttt_steps`` (use the engine's k)."""
        steps = steps or self.config.ttt_steps
        return eagle3_acceptance(self.head, cache, steps, self.config.micro_batch_rows)

    @property
    def module(self) -> torch.nn.Module:
        """The EAGLE-3 head being trained."""
        return self.head

    def evaluate(self, cache: DraftCache, steps: int | None = None) -> dict[str, float]:
        """Means of :meth:`acceptance` on ``cache`` (held-out rows): ``draft/eval_accept{s}`` (expected
        acceptance ``1 - TV`` at unrolled step s), ``draft/eval_ce{s}``, ``draft/eval_tau`` (expected
        tokens per verify step of the chains: what the engine's acceptance length estimates when it
        samples at the teacher's temperature) and ``draft/eval_rows``. Local to this rank."""
        return acceptance_metrics(self.acceptance(cache, steps))

    # ------------------------------------------------------------------ weights out
    def _export_dtype(self) -> torch.dtype | None:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[self.config.export_dtype]

    def named_update_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(export name, tensor)`` for a draft weight update: exactly the names the engines'
        draft loads (``Eagle3Head.expected_hf_names()``; ``d2t`` is never resent). Copies."""
        names = self.head.expected_hf_names()
        dtype = self._export_dtype()
        for name, t in self.head.named_export_tensors():
            if name in names:
                yield name, t.detach().to(dtype or t.dtype).contiguous().clone()

    def export(self, path: str | os.PathLike) -> None:
        """Write the head in ModelOpt's export layout (rank 0 of the draft group writes)."""
        from megatron_spec.draft.modelopt_io import save_eagle3

        if self.rank == 0:
            save_eagle3(self.head, path, dtype=self._export_dtype())
        if self.world > 1:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])

    def save(self, path: str | os.PathLike) -> None:
        """Checkpoint into directory ``path``: ``draft_trainer.pt`` (head, optimizer, schedule, step,
        RNG) and ``export/`` (ModelOpt format). Not collective: the head is replicated."""
        from megatron_spec.draft.modelopt_io import save_eagle3

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        atomic_save(self.state_dict(), os.path.join(path, STATE_FILE))
        save_eagle3(self.head, os.path.join(path, "export"), dtype=self._export_dtype())

    def load(self, path: str | os.PathLike) -> None:
        self.load_state_dict(torch.load(os.path.join(os.fspath(path), STATE_FILE), weights_only=False))


class DraftSettings(Protocol):
    """The run's draft section (``megatron_spec.config.DraftConfig``): what :func:`build_draft_trainer`
    reads."""

    spec_draft_kind: str
    spec_draft_path: str | None
    spec_draft_ttt_steps: int
    spec_draft_lr: float
    spec_draft_tv_weight: float
    spec_mtp_num_layers: int


def build_draft_trainer(
    draft: DraftSettings,
    policy: torch.nn.Module,
    target_cfg,
    info: Any = None,
    *,
    export_dir: str | os.PathLike | None = None,
    config: DraftTrainerConfig | None = None,
):
    """The online draft trainer a run's draft section asks for.

    Args:
        draft: the run's ``DraftConfig``: ``spec_draft_kind`` (``eagle3`` | ``mtp``), ``spec_draft_path``
            (ModelOpt export / MTP export to start from), ``spec_draft_ttt_steps``, ``spec_draft_lr``,
            ``spec_draft_tv_weight`` and, for MTP, ``spec_mtp_num_layers``.
        policy: the policy GPTModel (MTP layers are built beside it; an EAGLE-3 head is put on
            its device, where capture leaves the cache).
        info: ``megatron_spec.parallel.ParallelInfo`` (groups); None = megatron-core's current groups.
        config: full trainer settings; the draft fields above override its ``ttt_steps``, ``lr`` and
            ``tv_weight``.
        export_dir: exported to at once (the initial weights) and after every update.

    Collective (MTP gathers its TP shards to export): call it on every rank.
    """
    kind = draft.spec_draft_kind
    # 5 steps of warm-up: Adam's first steps move every weight by ~lr whatever the gradient, which
    # shakes a converged draft (docs/draft_training.md, "Why online training lowered acceptance")
    tc = dataclasses.replace(
        config or DraftTrainerConfig(warmup_steps=5), ttt_steps=int(draft.spec_draft_ttt_steps),
        lr=float(draft.spec_draft_lr), tv_weight=float(draft.spec_draft_tv_weight)
    )
    if kind == "eagle3":
        if not draft.spec_draft_path:
            raise ValueError("online EAGLE-3 training starts from a ModelOpt export: set --spec-draft-path")
        device = next(policy.parameters()).device
        trainer = Eagle3Trainer.from_modelopt(draft.spec_draft_path, target_cfg, tc, export_dir=export_dir,
                                              device=device)
        if export_dir is not None:  # the engine can start from export_dir before the first update
            trainer.export(export_dir)
        return trainer
    if kind == "mtp":
        from megatron_spec.draft.mtp import MtpTrainer, load_mtp_tensors, read_mtp_config

        layers = int(draft.spec_mtp_num_layers)
        groups = {} if info is None else {"dp_group": info.dp_group, "tp_group": info.tp_group}
        trainer = MtpTrainer(policy, layers, tc, export_dir=export_dir, **groups)
        if draft.spec_draft_path:
            if read_mtp_config(draft.spec_draft_path, target_cfg) != layers:
                raise ValueError(f"MTP export {draft.spec_draft_path} does not have {layers} layers")
            trainer.load_hf(load_mtp_tensors(draft.spec_draft_path))
        if export_dir is not None:
            trainer.export(export_dir)  # collective over TP: build_draft_trainer runs on every rank
        return trainer
    raise ValueError(f"online draft training supports spec_draft_kind eagle3 or mtp, got {kind!r}")


__all__ = [
    "DraftOptimizer",
    "DraftTrainerConfig",
    "Eagle3Trainer",
    "build_draft_trainer",
    "choose_segments",
    "reduce_metric_sums",
]
