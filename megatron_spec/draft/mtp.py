"""MTP heads trained online on the verifier's detached states, with their own optimizer.

:class:`MtpTrainer` owns an :class:`~megatron_spec.draft.mtp_draft.MtpDraft` (megatron-core's MTP
layers beside the policy, run on cached, detached inputs: see that module for why and how) and a
:class:`~megatron_spec.draft.optim.DraftOptimizer`; the policy never sees their loss.

Depth k (0-based) at row q predicts ``x_{t+k+1}`` for the cache row of ``x_t``; its teacher is the
teacher of cache row ``q + k``. Losses per depth are weighted ``loss_decay ** k``.

Weights are streamed under DeepSeek-V3's HF names (``model.layers.{L+k}.*``, see
``megatron_spec.draft.mtp_head`` and ``megatron_spec.draft.mtp_convert``), gathered over TP one
parameter at a time like the policy.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache, micro_batches
from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.teacher import (
    vocab_parallel_argmax,
    vocab_parallel_log_softmax,
    vocab_parallel_logprobs_at,
)
from megatron_spec.draft.losses import hard_cross_entropy_sum, soft_cross_entropy_sum, top1_agreement_sum
from megatron_spec.draft.mtp_convert import canonical_mtp_name, mtp_param_rules
from megatron_spec.draft.mtp_draft import MtpDraft
from megatron_spec.draft.mtp_io import load_mtp_head, load_mtp_tensors, read_mtp_config, save_mtp
from megatron_spec.draft.optim import (
    HOST,
    DraftOptimizer,
    DraftTrainerConfig,
    DraftUpdate,
    choose_segments,
    group_info,
    scored_rows_per_step,
)
from megatron_spec.interfaces import DraftLearner
from megatron_spec.models.convert import shard


class MtpTrainer(DraftUpdate, DraftLearner):
    """MTP depths trained online with their own optimizer; the policy never sees their loss."""

    def __init__(
        self,
        policy: torch.nn.Module,
        num_layers: int,
        config: DraftTrainerConfig = DraftTrainerConfig(),
        *,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        export_dir: str | os.PathLike | None = None,
        use_te: bool | None = None,
    ):
        from megatron.core import parallel_state as ps

        if config.tv_weight:  # its heads are vocabulary-parallel: min(p, q) would need the whole vocabulary
            raise ValueError(
                "tv_weight is for the EAGLE-3 draft; the MTP trainer takes the soft or hard loss"
            )
        self.draft = MtpDraft(policy, num_layers, use_te=use_te).train()
        self.config = config
        if ps.model_parallel_is_initialized():
            dp_group = dp_group or ps.get_data_parallel_group()
            tp_group = tp_group or ps.get_tensor_model_parallel_group()
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_rank, self.dp_size = group_info(dp_group)
        self.tp_rank, self.tp_size = group_info(tp_group)
        # q/k layernorms act on this rank's heads only: their gradients are partial sums over TP
        partial = [p for n, p in self.draft.named_parameters() if "q_layernorm" in n or "k_layernorm" in n]
        self.optimizer = DraftOptimizer(
            list(self.draft.parameters()), config, dp_group=dp_group, tp_group=tp_group, tp_partial=partial
        )
        self.export_dir = os.fspath(export_dir) if export_dir is not None else None
        self.generator = torch.Generator().manual_seed(
            config.seed * 1000003 + self.dp_rank
        )  # same on TP ranks
        self.step = 0
        self.rules = mtp_param_rules(self.draft.decoder_config, num_layers, self.tp_size)

    def capture_config(self, base=None):
        """``base`` with what MTP needs: final hidden states, full-vocabulary teacher, no TP sharding."""
        from megatron_spec.capture.config import CaptureConfig

        base = base or CaptureConfig()
        return dataclasses.replace(
            base, draft_kind="mtp", aux_layer_ids=None, draft_target_ids=None, shard_across_tp=False
        )

    # ------------------------------------------------------------------ training
    def train_step(self, cache: DraftCache | None) -> dict[str, float]:
        """One optimizer step on ``cache``; collective over the DP and TP groups.

        Returns ``draft/loss``, ``draft/loss_mtp{k}`` / ``draft/acc_mtp{k}`` per depth, ``draft/rows``,
        ``draft/grad_norm``, ``draft/lr``, ``draft/step``, ``draft/train_seconds``.
        """
        t0 = time.perf_counter()
        cfg = self.config
        depth = self.draft.num_layers
        weights = [cfg.loss_decay**k for k in range(depth)]
        segments: list[int] = []
        if cache is not None and cache.num_rows:
            if cache.hidden is None or cache.embeds is None:
                raise ValueError(
                    "MtpTrainer needs a cache captured with draft_kind='mtp' (hidden and embeds)"
                )
            if cache.teacher_ids is None and cache.teacher_logprobs.shape[1] != self.draft.vocab_size:
                raise ValueError(
                    f"MTP teacher must cover the full vocabulary ({self.draft.vocab_size}), got "
                    f"{cache.teacher_logprobs.shape[1]} columns (captured with a reduced draft vocabulary?)"
                )
            segments = choose_segments(cache, cfg.max_rows_per_step, self.generator)
        self._check_same_rows_across_tp(cache.num_rows if cache is not None else 0, len(segments))
        lens = [int(cache.seqlens[s]) for s in segments]
        label_ok = (cache.next_tokens >= 0) if cfg.loss == "hard" and segments else None
        return self._update(cache, segments, lens, weights, label_ok, self.dp_group, "mtp", t0)

    @property
    def module(self) -> torch.nn.Module:
        """The MTP layers being trained (:class:`MtpDraft`)."""
        return self.draft

    @torch.no_grad()
    def evaluate(self, cache: DraftCache, steps: int | None = None) -> dict[str, float]:
        """The current depths on every segment of ``cache`` (held out: before training on it), no
        update: ``draft/eval_ce{k}`` (the training loss at depth k, per scored row) and
        ``draft/eval_top1_{k}`` (how often the depth's argmax is the teacher's), ``draft/eval_rows``.
        ``steps`` (the engine's k) is ignored: an MTP draft proposes one token per depth. Collective
        over the TP group (vocabulary-parallel heads), local to the DP rank."""
        depth = self.draft.num_layers
        lens = [int(n) for n in cache.seqlens]
        segments = list(range(len(lens)))  # every segment
        label_ok = (cache.next_tokens >= 0) if self.config.loss == "hard" else None
        counts = scored_rows_per_step(cache, segments, lens, depth, label_ok)
        loss_sums = torch.zeros(depth, dtype=torch.float64, device=HOST)
        agree = torch.zeros(depth, dtype=torch.float64, device=HOST)
        ones = torch.ones(depth, dtype=torch.float64, device=self.optimizer.device)
        was_training = self.draft.training
        self.draft.eval()
        try:
            for mb in micro_batches(lens, self.config.micro_batch_rows):
                # mb: segment indices
                _, l_s, a_s = self._micro_batch(cache, mb, [1.0] * depth, ones, label_ok)
                loss_sums += l_s
                agree += a_s
        finally:
            self.draft.train(was_training)
        out = {}
        for k in range(depth):
            n = float(counts[k])
            out[f"draft/eval_ce{k}"] = float(loss_sums[k]) / n if n else float("nan")
            out[f"draft/eval_top1_{k}"] = float(agree[k]) / n if n else float("nan")
        out["draft/eval_rows"] = float(counts[0])
        return out

    def _check_same_rows_across_tp(self, rows: int, segments: int) -> None:
        if self.tp_size == 1:
            return
        mine = torch.tensor([rows, segments, -rows, -segments], dtype=torch.float64,
                            device=self.optimizer.device)
        both = mine.clone()
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.tp_group)
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                f"MTP training needs the same cache rows on every TP rank (rank {self.tp_rank} has "
                f"{rows} rows in {segments} segments); capture with shard_across_tp=False"
            )

    def _micro_batch(
        self, cache: DraftCache, segs: list[int], weights: list[float], counts: torch.Tensor,
        label_ok: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``label_ok`` is unused: the MTP losses mask invalid labels themselves."""
        cfg, draft = self.config, self.draft
        w_dev = draft.output_weight().device
        dtype = draft.config.params_dtype
        hidden = cache.padded("hidden", segs).to(w_dev, dtype).transpose(0, 1)  # [S, B, H]
        embeds = cache.padded("embeds", segs).to(w_dev, dtype).transpose(0, 1)
        lens = torch.tensor([int(cache.seqlens[s]) for s in segs], device=w_dev)
        b, t = hidden.shape[1], hidden.shape[0]
        teacher_lp = cache.padded("teacher_logprobs", segs).to(w_dev)  # [B, S, k | V]
        teacher_ids = cache.padded("teacher_ids", segs).to(w_dev) if cache.teacher_ids is not None else None
        next_tokens = cache.padded("next_tokens", segs, pad_value=-1).to(w_dev)
        # [B, S]: context rows carry no loss
        scored = cache.pad_rows(cache.scored_mask(), segs, False).to(w_dev)
        teacher_top1 = teacher_ids[..., 0] if teacher_ids is not None else teacher_lp.argmax(-1)
        group = self.tp_group if self.tp_size > 1 else None
        outs = draft(hidden, embeds)
        loss = torch.zeros((), device=w_dev)
        l_sums = torch.zeros(len(weights), dtype=torch.float64, device=HOST)  # metrics, read on the host
        a_sums = torch.zeros(len(weights), dtype=torch.float64, device=HOST)
        q = torch.arange(t, device=w_dev).unsqueeze(0)
        for k, (h, w) in enumerate(zip(outs, weights)):
            logits = draft.logits(h)[:, : t - k]  # [B, S-k, V/tp]; row q scores against cache row q + k
            valid = q[:, : t - k] + k < lens.unsqueeze(1)  # [B, S-k]
            n = valid.shape[1]
            valid = valid & scored[:, k : k + n]
            flat = logits.reshape(b * n, -1)
            if cfg.loss == "soft":
                if teacher_ids is not None:
                    ids = teacher_ids[:, k : k + n].reshape(b * n, -1)
                    logq = vocab_parallel_logprobs_at(flat, ids, vocab_size=draft.vocab_size, tp_group=group)
                    l_sum, _ = soft_cross_entropy_sum(logq.view(b, n, -1), teacher_lp[:, k : k + n], valid)
                else:  # full teacher: each rank scores its own vocabulary slice, summed over TP
                    logq = vocab_parallel_log_softmax(flat, vocab_size=draft.vocab_size, tp_group=group)
                    v0 = self.tp_rank * flat.shape[1]
                    p_local = teacher_lp[:, k : k + n].reshape(b * n, -1)[:, v0 : v0 + flat.shape[1]].exp()
                    ce = -(p_local * logq[:, : p_local.shape[1]]).sum(-1)  # padded columns have no teacher
                    ce = _tp_sum(ce, group, self.tp_size).view(b, n)
                    l_sum = torch.where(valid, ce, torch.zeros_like(ce)).sum()
            else:
                labels = next_tokens[:, k : k + n]
                valid = valid & (labels >= 0)
                lp = vocab_parallel_token_logprobs(
                    logits, labels.clamp(min=0), vocab_size=draft.vocab_size, tp_group=group
                )
                l_sum, _ = hard_cross_entropy_sum(lp, valid)
            loss = loss + w * l_sum / counts[k].to(l_sum.dtype)
            l_sums[k] = float(l_sum.detach())  # host sync per depth: metrics only
            top1 = vocab_parallel_argmax(flat.detach(), vocab_size=draft.vocab_size, tp_group=group).view(
                b, n
            )
            a_sums[k] = float(top1_agreement_sum(top1, teacher_top1[:, k : k + n], valid))
        return loss, l_sums, a_sums

    # ------------------------------------------------------------------ weights
    def named_update_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` of every MTP weight, gathered over TP one parameter at a time.

        Collective over the TP group (every TP rank iterates to the end). The names are exactly
        ``MtpHead.expected_hf_names()`` of the engine's head."""
        from megatron_spec.models.gpt import _gather

        dtype = (
            dtype
            or {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[self.config.export_dtype]
        )
        big_l = self.draft.decoder_config.num_layers
        # No ``torch.no_grad()`` around the yields: a generator's grad mode leaks into its caller
        # (and stays off if the generator is abandoned); detached tensors build no graph anyway.
        for name, param in self.draft.megatron_named_parameters():
            rule = self.rules.get(canonical_mtp_name(name, big_l))
            if rule is None:
                raise KeyError(f"MTP parameter {name} has no HF counterpart")
            data = param.detach()
            full = (
                data
                if rule.partition_dim is None
                else _gather(data, rule.partition_dim, self.tp_group, self.tp_size)
            )
            for hf, t in rule.to_hf(full).items():
                yield hf, (t.to(dtype) if dtype is not None else t).contiguous().clone()

    def load_hf(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill this rank's MTP shards from HF-named full tensors (e.g. :func:`load_mtp_tensors`)."""
        big_l = self.draft.decoder_config.num_layers
        with torch.no_grad():
            for name, param in self.draft.megatron_named_parameters():
                rule = self.rules[canonical_mtp_name(name, big_l)]
                missing = [n for n in rule.hf_names if n not in tensors]
                if missing:
                    raise KeyError(f"MTP tensor {missing[0]} missing (for {name})")
                full = rule.from_hf({n: tensors[n] for n in rule.hf_names})
                if tuple(full.shape) != rule.full_shape:
                    raise ValueError(
                        f"MTP tensor for {name} has shape {tuple(full.shape)}, expected {rule.full_shape}"
                    )
                param.copy_(shard(full, rule, self.tp_rank, self.tp_size).to(param.dtype))

    def export(self, path: str | os.PathLike) -> None:
        """Write the heads (:func:`save_mtp`); collective over TP, written by the first rank."""
        named = dict(self.named_update_tensors())
        if self.tp_rank == 0 and self.dp_rank == 0:
            save_mtp(path, named, self.draft.decoder_config, self.draft.num_layers)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "mtp": {
                k: v.detach().clone()
                for k, v in self.draft.block.state_dict().items()
                if isinstance(v, torch.Tensor)
            },
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draft.block.load_state_dict(state["mtp"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])

    def _state_file(self, path: str | os.PathLike) -> str:
        return os.path.join(os.fspath(path), f"mtp_trainer_tp{self.tp_rank}.pt")

    def save(self, path: str | os.PathLike) -> None:
        """This TP rank's shards, optimizer state, step and RNG into directory ``path``. Not
        collective; data-parallel replicas hold the same state, so only DP rank 0 writes (every TP
        rank of it must call ``save`` to keep all shards)."""
        from megatron_spec.draft.optim import atomic_save

        if self.dp_rank != 0:
            return
        os.makedirs(os.fspath(path), exist_ok=True)
        atomic_save(self.state_dict(), self._state_file(path))

    def load(self, path: str | os.PathLike) -> None:
        self.load_state_dict(torch.load(self._state_file(path), weights_only=False))


def _tp_sum(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    from megatron_spec.capture.logprobs import _reduce

    return _reduce(x, group, tp_size)


__all__ = [
    "MtpTrainer",
    "load_mtp_head",
    "load_mtp_tensors",
    "read_mtp_config",
    "save_mtp",
]
