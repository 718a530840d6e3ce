"""The policy actor: the Megatron policy, its reference, optimizer and colocated offload, the
verifier-side log-probs, the GRPO training step, the online draft learner, and their checkpoint
state. It never talks to an engine: the rollout manager (``rl/rollout_manager.py``) reads the
weights it pushes from here (``model``, ``weights_of``, ``draft``).

Stages it runs (``rl/trainer.py`` times them):

* **logprob** (:meth:`PolicyActor.old_logprobs`): Megatron forward of the verifier on every
  rollout: the old log-probs (of the policy version that generated it), the reference log-probs
  (``--kl-coef``), and the captures the online draft learns from;
* **train** (:meth:`PolicyActor.train`, :meth:`PolicyActor.train_draft`): the GRPO loss,
  gradient accumulation over micro-batches, Megatron DDP reduction, clipping, AdamW; then the
  draft's own update (a detached branch: its loss never reaches the policy).

Its pieces: the verifier forward (``rl/verifier_logprobs.py``), the stages' statistics
(``rl/stage_stats.py``), the learning-rate schedule and gradient arithmetic (``rl/policy_optim.py``),
the per-rank objects of its checkpoint state (``rl/per_rank_state.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from megatron_spec.config import RunConfig
from megatron_spec.host_memory import keep_heap
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights, unwrap
from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl import checkpoint as ckpt_io
from megatron_spec.rl.loss import grpo_loss
from megatron_spec.rl.per_rank_state import per_rank_state
from megatron_spec.rl.policy_optim import clip_grads_, grad_norm, minibatch_normalizer, policy_lr
from megatron_spec.rl.rollouts import PackedBatch, Rollout, micro_batches, pack, select_for_training, split
from megatron_spec.rl.stage_stats import MismatchStats, TrainStats
from megatron_spec.rl.verifier_logprobs import MicroBatch, verifier_logprobs
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads
from megatron_spec.train.offload import ColocateOffload
from megatron_spec.train.optimizer import MixedPrecisionAdamW

logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient: the run stops before the optimizer step and any checkpoint."""


class PolicyActor:
    """The policy (and reference) of this rank, its optimizer, offload plan and online draft.

    ``policy_version`` counts the optimizer rounds taken (one per GRPO step); ``draft_version``
    the draft updates. In async mode (``--async-policy-lag``) the shards of older versions that
    still have batches to train on are kept in ``snapshots``.
    """

    def __init__(
        self, cfg: RunConfig, info: ParallelInfo, ckpt: HFCheckpoint, *, renormalise_engine_logprobs: bool
    ):
        self.cfg = cfg
        self.info = info
        self.device = info.device  # every tensor the actor makes for the model lives here
        m, g = cfg.model, cfg.grpo
        self.dcfg = ckpt.decoder_config
        self.rank0 = info.rank == 0
        dtype = torch.bfloat16 if m.bf16 else torch.float32
        if m.bf16 and not torch.cuda.is_available() and self.rank0:
            from megatron_spec.isa import probe

            if not probe().native_bf16:
                print(f"megatron-spec: warning: --bf16 training on a CPU where {probe().why_not_bf16()}: "
                      "bf16 matmuls run 30-130x slower than fp32 here; drop --bf16 on this machine",
                      file=sys.stderr, flush=True)
        self.model = build_gpt_model(
            self.dcfg,
            params_dtype=dtype,
            vocab_divisible_by=m.make_vocab_size_divisible_by,
            device=self.device,
        )
        load_hf_weights(self.model, ckpt)
        self.ddp = wrap_ddp(self.model)
        self.params = [p for p in self.ddp.parameters() if p.requires_grad]
        # fp32 main weights and AdamW moments; with --bf16 the model computes in bf16 (train/optimizer.py)
        self.optimizer = MixedPrecisionAdamW(
            self.params, lr=g.lr, weight_decay=g.weight_decay, betas=(0.9, 0.999)
        )
        self.ref = None
        if g.kl_coef > 0:
            self.ref = build_gpt_model(
                self.dcfg,
                params_dtype=dtype,
                vocab_divisible_by=m.make_vocab_size_divisible_by,
                device=self.device,
            )
            load_hf_weights(self.ref, ckpt)
            self.ref.eval().requires_grad_(False)
        self.offload = self._colocate_offload()
        if self.device.type == "cpu":  # the policy, its reference and optimizer in place: what the steps
            keep_heap()  # allocate stays on this process's heap (megatron_spec.host_memory)
        per_step = g.prompts_per_step * g.grpo_group_size  # the rollouts of a step, split over the DP ranks
        if per_step % info.dp_size:
            raise ValueError(f"prompts-per-step x grpo-group-size = {per_step} rollouts do not split over "
                             f"{info.dp_size} data-parallel ranks")
        if (per_step // info.dp_size) % g.grpo_num_minibatches:
            raise ValueError(f"{per_step // info.dp_size} rollouts per DP rank do not split into "
                             f"--grpo-num-minibatches {g.grpo_num_minibatches}")
        # an SGLang engine's log-probs are of the untruncated distribution: renormalised by log Z
        r = cfg.rollout
        truncating = r.rollout_temperature > 0 and (
            r.rollout_top_k > 0 or r.rollout_top_p < 1.0 or r.rollout_min_p > 0
        )
        self.renormalise = truncating and renormalise_engine_logprobs
        self.policy_version = 0
        self.oldest_version = 0  # the oldest policy this process can stream (after a resume: the loaded one)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.draft = None  # the online draft learner (megatron_spec.interfaces.DraftLearner), if any
        self.capture = None
        self.draft_version = 0

    def _colocate_offload(self) -> ColocateOffload:
        """The trainer's side of the colocated memory plan (docs/memory_plan.md)."""
        level = self.cfg.rollout.colocate_offload
        policy = unwrap(self.model)
        ref = list(self.ref.parameters()) if self.ref is not None else []
        kinds = {"params": lambda: list(policy.parameters()) + ref,
                 "grads": lambda: [buf.grad_data for buf in self.ddp.buffers],
                 "optimizer": self.optimizer.state_tensors}
        active = self.device.type == "cuda"
        if level != "none" and not active and self.rank0:
            print(
                f"megatron-spec: --colocate-offload {level} moves nothing on {self.device.type}: the engine "
                "and "
                f"the trainer share host memory",
                file=sys.stderr,
                flush=True,
            )
        return ColocateOffload(level, kinds, active=active)

    # ------------------------------------------------------------------ the online draft
    def init_online_draft(self, export_dir: str) -> None:
        """The draft learns from the verifier's own logprob forward (hooks on the policy);
        its loss never reaches the policy (detached captures, own optimizer)."""
        from megatron_spec.capture.hooks import Capture
        from megatron_spec.draft.trainer import build_draft_trainer

        self.draft = build_draft_trainer(self.cfg.draft, self.model, self.dcfg, self.info,
                                         export_dir=export_dir)
        self.capture = Capture.for_trainer(self.draft, tp_group=self.info.tp_group)

    def train_draft(self, step: int) -> dict[str, float]:
        """One draft update on what the logprob forward captured: the held-out evaluation of the
        draft that generated these rollouts, then its training step. ``step``: the GRPO step (0-based)."""
        metrics = {}
        cache = self.capture.take()
        if cache is not None and cache.num_rows:
            # held out: the draft that generated these rollouts, before it trains on them
            held = self.draft.evaluate(cache, steps=max(1, self.cfg.spec.spec_k_max))
            metrics.update({k.replace("draft/eval_", "draft/heldout_"): v for k, v in held.items()})
        metrics.update(self.draft.train_step(cache))
        from megatron_spec import faults

        if faults.should_fire("corrupt_draft", step + 1):  # a draft update gone wrong (the watchdog's test)
            faults.corrupt_weights(self.draft.module)
        metrics.update(self.capture.metrics())
        self.capture.reset_metrics()
        self.draft_version += 1
        return metrics

    # ------------------------------------------------------------------ versions
    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in unwrap(self.model).parameters()]

    def _swap_in(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        current = []
        with torch.no_grad():
            for p, t in zip(unwrap(self.model).parameters(), tensors):
                current.append(p.detach().clone())
                p.copy_(t)
        return current

    def keep_snapshot(self) -> None:
        """Async mode: keep this rank's shards of the current version while batches it generates
        are still to be trained on (their old log-probs are recomputed under exactly it)."""
        self.snapshots.setdefault(self.policy_version, self._snapshot())

    def drop_snapshots_before(self, version: int) -> None:
        for v in [v for v in self.snapshots if v < version]:
            del self.snapshots[v]

    @contextlib.contextmanager
    def weights_of(self, version: int) -> Iterator[torch.nn.Module]:
        """The model holding the weights of ``version`` (the current one, or a kept snapshot swapped
        in for the duration)."""
        swapped = self._swap_in(self.snapshots[version]) if version != self.policy_version else None
        try:
            yield self.model
        finally:
            if swapped is not None:
                self._swap_in(swapped)

    # ------------------------------------------------------------------ verifier forwards
    def _logprobs(self, model: torch.nn.Module, batch: PackedBatch, grad: bool, extras: bool = False,
                  log_mass: bool = False):
        """:func:`~megatron_spec.rl.verifier_logprobs.verifier_logprobs` with this run's sampling."""
        return verifier_logprobs(model, batch, self.cfg.rollout, vocab_size=self.dcfg.vocab_size,
                                 tp_group=self.info.tp_group, grad=grad, extras=extras, log_mass=log_mass)

    @torch.no_grad()
    def old_logprobs(
        self, rollouts: list[Rollout], pad_id: int
    ) -> tuple[list[list[MicroBatch]], dict[str, float]]:
        """This rank's rollouts as ``--grpo-num-minibatches`` minibatches, each a list of
        :class:`MicroBatch`; captures for the draft.

        Every rollout that enters the loss is in exactly one minibatch (rollouts/split). Dynamic
        sampling and ``--truncated-responses drop`` leave the others out first. Response tokens
        outside the old policy's support (a bf16 engine and the fp32 verifier disagree at a top-k /
        top-p boundary) leave the loss mask here, counted in ``mismatch/out_of_support_frac``. An
        SGLang engine reports log-probs of the untruncated distribution: they are renormalised by
        the verifier's support mass, ``log Z``, before the mismatch and the TIS weights read them
        (docs/metrics.md, "Train/rollout mismatch"). Metrics are reduced over the DP ranks.
        """
        g = self.cfg.grpo
        kept, groups_dropped, truncated_dropped = select_for_training(
            rollouts, g.grpo_group_size, drop_equal_reward_groups=g.dynamic_sampling,
            drop_truncated=g.truncated_responses == "drop")
        out = []
        stats = MismatchStats(self.device)
        version = rollouts[0].policy_version if rollouts else self.policy_version
        self.model.eval()
        with self.weights_of(version):  # async: recompute under the generating policy
            for minibatch in split(kept, g.grpo_num_minibatches):
                out.append([self._score(pack(mb, pad_id, device=self.device), stats)
                            for mb in micro_batches(minibatch, g.micro_batch_size)])
        counts = torch.tensor([groups_dropped, truncated_dropped], dtype=torch.float64, device=self.device)
        metrics = stats.reduce(self.info, counts)
        if g.dynamic_sampling:
            metrics["train/groups_filtered"] = int(counts[0])
        if g.truncated_responses == "drop":
            metrics["train/truncated_dropped"] = int(counts[1])
        return out, metrics

    def _score(self, batch: PackedBatch, stats: MismatchStats) -> MicroBatch:
        """One micro-batch of the logprob stage: the old log-probs (the draft's captures recorded on
        the way), the reference's; the response tokens outside the old policy's support leave
        ``batch.mask``, SGLang's log-probs are renormalised in ``batch``, the mismatch goes to ``stats``."""
        if self.capture is not None:
            response = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=self.device)
            response[:, 1:] = batch.mask > 0  # input position t holds target t-1
            with self.capture.record(self.model, response):
                old, log_mass = self._old_and_log_mass(batch)
        else:
            old, log_mass = self._old_and_log_mass(batch)
        ref = self._logprobs(self.ref, batch, grad=False) if self.ref is not None else None
        on = batch.mask > 0  # [B, L-1]
        inside = on & torch.isfinite(old)
        # SGLang's log p(t) + log Z -> log p(t) under the truncated distribution
        if self.renormalise:
            batch.engine_logprobs = torch.where(on, batch.engine_logprobs - log_mass, batch.engine_logprobs)
        # the out-of-support tokens leave the loss
        batch.mask = batch.mask * inside.to(batch.mask.dtype)
        old = torch.where(inside, old, torch.zeros_like(old))
        stats.add(old, batch.engine_logprobs, on, inside)
        return MicroBatch(batch, old, ref)

    def _old_and_log_mass(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, L-1]`` old log-probs, and ``log Z`` where SGLang's log-probs need it (else None)."""
        if not self.renormalise:
            return self._logprobs(self.model, batch, grad=False), None
        lp, _, log_z = self._logprobs(self.model, batch, grad=False, extras=True, log_mass=True)
        return lp, log_z

    # ------------------------------------------------------------------ the GRPO update
    def train(self, minibatches: list[list[MicroBatch]], step: int) -> dict[str, float]:
        """One optimizer step per minibatch of :meth:`old_logprobs`; ``step``: the GRPO step (0-based).

        A minibatch with no response token on any DP rank takes no optimizer step (AdamW would
        still move the weights through its moments and the weight decay). The statistics are sums
        over every DP rank's tokens (max for the ratio), so they describe the whole step.
        """
        lr = policy_lr(self.cfg.grpo, step)
        self.model.train()
        stats = TrainStats(self.device)
        largest_norm = 0.0
        for mbs in minibatches:
            masks = [mb.batch.mask for mb in mbs]
            normalizer = minibatch_normalizer(masks, self.cfg.grpo.loss_agg, self.info)
            if normalizer is None:  # no response token on any DP rank
                continue
            zero_grads(self.ddp)
            for mb in mbs:
                self._backward(mb, normalizer, step, stats)
            finalize_grads(self.ddp, as_param_grad=False)  # the optimizer reads the fp32 main_grad
            largest_norm = max(largest_norm, self._optimizer_step(lr, step))
            stats.count_optimizer_step(self.info.dp_size)
        return stats.reduce(self.info, grad_norm=largest_norm, lr=lr)

    def _backward(self, mb: MicroBatch, normalizer: float, step: int, stats: TrainStats) -> None:
        """The GRPO loss of one micro-batch, its backward (gradients accumulate), its statistics."""
        g = self.cfg.grpo
        batch, old, ref = mb.batch, mb.old_logprobs, mb.ref_logprobs
        lp, entropy, _ = self._logprobs(self.ddp, batch, grad=True, extras=True)
        is_w = None
        if g.tis_cap > 0:
            on = batch.mask > 0  # engine and old log-probs are finite here (old_logprobs)
            is_w = torch.where(on, torch.exp(old - batch.engine_logprobs).clamp(max=g.tis_cap),
                               torch.zeros_like(old))
        loss, st = grpo_loss(lp, old, batch.advantages, batch.mask, clip_eps_low=g.clip_eps_low,
                             clip_eps_high=g.clip_eps_high, ref_logprobs=ref, kl_coef=g.kl_coef,
                             agg=g.loss_agg, normalizer=max(normalizer, 1.0), is_weights=is_w)
        from megatron_spec import faults

        if faults.should_fire("nan_loss", step + 1):
            loss = loss * float("nan")
        if not torch.isfinite(loss):  # host sync: a non-finite loss must stop before backward
            raise TrainingDivergedError(f"non-finite GRPO loss ({float(loss)}) at step {step}; "
                                        f"stopping before the optimizer step and any checkpoint")
        loss.backward()
        stats.add(st, entropy, batch.mask)

    def _optimizer_step(self, lr: float, step: int) -> float:
        """Clip the reduced gradients to ``--clip-grad`` and step AdamW at ``lr``; returns the gradient
        norm before clipping. A non-finite norm stops the run before the step."""
        norm = grad_norm(self.params, self.optimizer.grads(), self.info)
        if not math.isfinite(norm):
            raise TrainingDivergedError(f"non-finite gradient norm at step {step}; stopping before the "
                                        f"optimizer step and any checkpoint")
        clip_grads_(self.optimizer, norm, self.cfg.grpo.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return norm

    # ------------------------------------------------------------------ checkpoint state
    def sharded_state(self, saved: dict[str, Any] | None = None) -> dict[str, Any]:
        """The policy, its AdamW state, this rank's generators and draft learner, for megatron-core's
        ``dist_checkpointing`` (``rl/checkpoint.py``). To save: ``saved`` is None. To load: ``saved`` is the
        checkpoint's trainer state; on another layout than it was saved with, the per-rank objects follow
        the rules of ``rl/per_rank_state.py``."""
        model = unwrap(self.model).sharded_state_dict()
        state = {"model": model, "optimizer": self.optimizer.sharded_state_dict(model)}
        kind = self.cfg.draft.spec_draft_kind
        state.update(per_rank_state(self.info, saved, draft=self.draft, draft_kind=kind))
        return state

    def load_state(
        self, loaded: dict[str, Any], path: str, *, policy_version: int, draft_version: int
    ) -> None:
        """What :meth:`sharded_state` described, as ``dist_checkpointing`` loaded it from ``path``."""
        unwrap(self.model).load_state_dict(loaded["model"])
        self.optimizer.load_sharded_state_dict(loaded["optimizer"])
        if "rng" in loaded:
            ckpt_io.set_rng_state(loaded["rng"])
        elif self.rank0:
            logger.warning(
                "resuming %s on another layout than it was saved with: the generators start from the seed",
                path,
            )
        self.policy_version = self.oldest_version = policy_version
        self.draft_version = draft_version
        if self.draft is not None:
            self.draft.load_state_dict(loaded["draft"])

    def export_draft(self, path: str | os.PathLike) -> None:
        """The draft in its serving format (collective: every rank calls it)."""
        self.draft.export(path)
