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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.support import vocab_parallel_entropy_and_log_mass, vocab_parallel_support_mask
from megatron_spec.config import GRPOConfig, RunConfig
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights, unwrap
from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl import checkpoint as ckpt_io
from megatron_spec.rl.loss import grpo_loss
from megatron_spec.rl.rollouts import PackedBatch, Rollout, micro_batches, pack, select_for_training, split
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads
from megatron_spec.train.offload import ColocateOffload
from megatron_spec.train.optimizer import MixedPrecisionAdamW

logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient: the run stops before the optimizer step and any checkpoint."""


class MicroBatch(NamedTuple):
    """One micro-batch of the train stage, as the logprob stage leaves it."""

    batch: PackedBatch
    old_logprobs: torch.Tensor
    """``[B, L-1]`` under the policy version that generated the rollouts (0 outside the mask)."""
    ref_logprobs: torch.Tensor | None
    """``[B, L-1]`` under the reference (``--kl-coef`` > 0), else None."""


def policy_lr(g: GRPOConfig, step: int) -> float:
    """The policy's learning rate at ``step``, a function of the step alone (a resumed run
    continues the schedule exactly): linear warm-up over ``--lr-warmup-steps`` W, then
    ``--lr-decay-style`` from ``--lr`` towards ``--lr-min`` over the remaining steps (T =
    ``--train-iters``): at step s >= W, t = (s - W) / (T - W), cosine
    ``lr_min + (lr - lr_min) (1 + cos(pi t)) / 2``, linear ``lr - (lr - lr_min) t``
    (megatron-core's OptimizerParamScheduler; the first step after the warm-up uses ``--lr``)."""
    if step < g.lr_warmup_steps:
        return g.lr * (step + 1) / g.lr_warmup_steps
    if g.lr_decay_style == "constant":
        return g.lr
    t = min(1.0, (step - g.lr_warmup_steps) / max(1, g.train_iters - g.lr_warmup_steps))
    if g.lr_decay_style == "cosine":
        return g.lr_min + (g.lr - g.lr_min) * 0.5 * (1.0 + math.cos(math.pi * t))
    return g.lr - (g.lr - g.lr_min) * t


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

        self.draft = build_draft_trainer(self.cfg, self.model, self.dcfg, self.info, export_dir=export_dir)
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
    def _logprobs(self, model, batch, grad: bool, extras: bool = False, log_mass: bool = False):
        """``[B, L-1]`` log-probs of the targets under the processed distribution (``-inf`` outside
        its support); with ``extras``, also the entropy of that distribution and (``log_mass``)
        ``log Z``, the log-mass its support keeps (capture/support.py; else None), ``[B, L-1]``, detached."""
        r = self.cfg.rollout
        logits = model(batch.input_ids, batch.position_ids, attention_mask=None)[:, :-1]  # [B, L-1, V/tp]
        exclude = vocab_parallel_support_mask(logits.detach(), vocab_size=self.dcfg.vocab_size,
                                              temperature=r.rollout_temperature, top_k=r.rollout_top_k,
                                              top_p=r.rollout_top_p, min_p=r.rollout_min_p,
                                              tp_group=self.info.tp_group)
        lp = vocab_parallel_token_logprobs(logits, batch.targets, vocab_size=self.dcfg.vocab_size,
                                           temperature=r.rollout_temperature, exclude_mask=exclude,
                                           tp_group=self.info.tp_group)
        # -inf * 0 would be NaN
        lp = torch.where(batch.mask > 0, lp, torch.zeros_like(lp)) if not grad else lp
        if not extras:
            return lp
        entropy, log_mass = vocab_parallel_entropy_and_log_mass(
            logits.detach(), exclude, vocab_size=self.dcfg.vocab_size, temperature=r.rollout_temperature,
            tp_group=self.info.tp_group, log_mass=log_mass)
        return lp, entropy, log_mass

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

        def score(batch):  # old log-probs, and log Z where SGLang's log-probs need it
            if not self.renormalise:
                return self._logprobs(self.model, batch, grad=False), None
            lp, _, log_z = self._logprobs(self.model, batch, grad=False, extras=True, log_mass=True)
            return lp, log_z

        out = []
        # sum |diff|, tokens compared, tokens out of the support, response tokens; max |diff|
        # (device accumulators: read once, after the loop)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        diff_max = torch.zeros((), dtype=torch.float64, device=self.device)
        version = rollouts[0].policy_version if rollouts else self.policy_version
        self.model.eval()
        with self.weights_of(version):  # async: recompute under the generating policy
            for minibatch in split(kept, g.grpo_num_minibatches):
                micro = []
                for mb in micro_batches(minibatch, g.micro_batch_size):
                    batch = pack(mb, pad_id, device=self.device)
                    if self.capture is not None:
                        response = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=self.device)
                        response[:, 1:] = batch.mask > 0  # input position t holds target t-1
                        with self.capture.record(self.model, response):
                            old, log_mass = score(batch)
                    else:
                        old, log_mass = score(batch)
                    ref = self._logprobs(self.ref, batch, grad=False) if self.ref is not None else None
                    on = batch.mask > 0  # [B, L-1]
                    inside = on & torch.isfinite(old)
                    # SGLang's log p(t) + log Z -> log p(t) under the truncated distribution
                    if self.renormalise:
                        batch.engine_logprobs = torch.where(
                            on, batch.engine_logprobs - log_mass, batch.engine_logprobs
                        )
                    # the out-of-support tokens leave the loss
                    batch.mask = batch.mask * inside.to(batch.mask.dtype)
                    old = torch.where(inside, old, torch.zeros_like(old))
                    diff = (old - batch.engine_logprobs).abs()[inside].to(torch.float64)
                    sums += torch.stack([diff.sum(), inside.sum().to(torch.float64), (on & ~inside).sum().to(
                        torch.float64), on.sum().to(torch.float64)])
                    if diff.numel():  # host sync (the boolean index's size): skips max() of nothing
                        diff_max = torch.maximum(diff_max, diff.max())
                    micro.append(MicroBatch(batch, old, ref))
                out.append(micro)
        counts = torch.tensor([groups_dropped, truncated_dropped], dtype=torch.float64, device=self.device)
        if self.info.dp_size > 1:
            dist.all_reduce(sums, group=self.info.dp_group)
            dist.all_reduce(counts, group=self.info.dp_group)
            dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=self.info.dp_group)
        diff_sum, compared, outside, response = sums.tolist()  # the stage's one read of its statistics
        metrics = {"mismatch/logprob_abs_diff_max": float(diff_max),
                   "mismatch/logprob_abs_diff_mean": diff_sum / max(compared, 1.0),
                   "mismatch/out_of_support_frac": outside / max(response, 1.0)}
        if g.dynamic_sampling:
            metrics["train/groups_filtered"] = int(counts[0])
        if g.truncated_responses == "drop":
            metrics["train/truncated_dropped"] = int(counts[1])
        return out, metrics

    # ------------------------------------------------------------------ the GRPO update
    def _grad_norm(self) -> float:
        """L2 norm of the fp32 gradients over the model (TP shards summed over the TP group)."""
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        for p, grad in zip(self.params, self.optimizer.grads()):
            if grad is None:
                continue
            sq = grad.pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):  # megatron-core's attribute, set on TP shards only
                sharded += sq
            else:
                replicated += sq
        if self.info.tp_size > 1:
            dist.all_reduce(sharded, group=self.info.tp_group)
        return float((sharded + replicated).sqrt())  # host sync: clipping and the divergence check need it

    def train(self, minibatches: list[list[MicroBatch]], step: int) -> dict[str, float]:
        """One optimizer step per minibatch of :meth:`old_logprobs`; ``step``: the GRPO step (0-based).

        A minibatch with no response token on any DP rank takes no optimizer step (AdamW would
        still move the weights through its moments and the weight decay). The statistics are sums
        over every DP rank's tokens (max for the ratio), so they describe the whole step.
        """
        g = self.cfg.grpo
        lr = policy_lr(g, step)
        self.model.train()
        # pg, kl, clipped, ratio, tokens, entropy, out of support, samples trained, optimizer steps
        sums = torch.zeros(9, dtype=torch.float64, device=self.device)
        ratio_max = torch.zeros((), dtype=torch.float64, device=self.device)
        grad_norm = 0.0
        for mbs in minibatches:
            # host syncs (float(), tolist()): the skip decision and the normaliser, once per minibatch
            counts = torch.tensor([sum(float(b.mask.sum()) for b, _, _ in mbs),
                                   sum(float((b.mask.sum(dim=1) > 0).sum()) for b, _, _ in mbs)],
                                  dtype=torch.float64, device=self.device)  # response tokens, sequences
            if self.info.dp_size > 1:
                dist.all_reduce(counts, group=self.info.dp_group)
            tokens, seqs = counts.tolist()
            if tokens == 0:  # the same decision on every rank: the counts are global
                continue
            normalizer = (tokens if g.loss_agg == "token" else seqs) / self.info.dp_size
            zero_grads(self.ddp)
            for batch, old, ref in mbs:
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
                # the loss statistics are host floats (rl/loss.py: one sync per call); entropy and the
                # samples trained stay on the device
                host = torch.tensor([st.pg_loss_sum, st.kl_sum, st.clipped, st.ratio_sum, st.tokens],
                                    dtype=torch.float64, device=self.device)
                sums += torch.cat([host, (entropy * batch.mask).sum().to(torch.float64).reshape(1),
                                   torch.tensor([st.out_of_support], dtype=torch.float64, device=self.device),
                                   (batch.mask.sum(dim=1) > 0).sum().to(torch.float64).reshape(1),
                                   torch.zeros(1, dtype=torch.float64, device=self.device)])
                ratio_max = torch.maximum(ratio_max, torch.tensor(st.ratio_max, dtype=torch.float64,
                                                                  device=self.device))
            finalize_grads(self.ddp, as_param_grad=False)  # the optimizer reads the fp32 main_grad
            norm = self._grad_norm()
            if not math.isfinite(norm):
                raise TrainingDivergedError(f"non-finite gradient norm at step {step}; stopping before the "
                                            f"optimizer step and any checkpoint")
            if g.clip_grad > 0 and norm > g.clip_grad:
                scale = g.clip_grad / (norm + 1e-6)
                for grad in self.optimizer.grads():
                    if grad is not None:
                        grad.mul_(scale)
            grad_norm = max(grad_norm, norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            sums[8] += 1.0 / self.info.dp_size  # every rank steps: the DP sum counts it once
        if self.info.dp_size > 1:
            dist.all_reduce(sums, group=self.info.dp_group)
            dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX, group=self.info.dp_group)
        pg, kl, clipped, ratio, tokens, entropy, outside, samples, steps = sums.tolist()
        n = max(tokens, 1.0)
        return {
            "loss/pg": pg / n,
            "loss/kl": kl / n,
            "train/clip_frac": clipped / n,
            "train/ratio_mean": ratio / n,
            "train/ratio_max": float(ratio_max),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/entropy": entropy / n,
            "train/out_of_support_frac": outside / n,
            "train/samples_trained": int(samples),
            "train/optimizer_steps": int(round(steps)),
        }

    # ------------------------------------------------------------------ checkpoint state
    def sharded_state(self, saved: dict[str, Any] | None = None) -> dict[str, Any]:
        """The policy, its AdamW state, this rank's generators and draft learner, for megatron-core's
        ``dist_checkpointing`` (``rl/checkpoint.py``). To save: ``saved`` is None. To load: ``saved`` is the
        checkpoint's trainer state; on another layout than it was saved with, the generators are left out
        (they start from the seed) and the draft learner's state is DP rank 0's of the saved run (an
        EAGLE-3 head is the same on every rank; an MTP learner's is tensor-parallel: refused at another
        TP)."""
        info = self.info
        model = unwrap(self.model).sharded_state_dict()
        state = {"model": model, "optimizer": self.optimizer.sharded_state_dict(model)}
        same = saved is None or (saved["world_size"], saved["tp_size"]) == (info.world_size, info.tp_size)
        world, rank = (info.world_size, info.rank) if same else (saved["world_size"],
                                                                 info.tp_rank % saved["world_size"])
        if same:
            state["rng"] = ckpt_io.per_rank("rng_state", ckpt_io.rng_state(), rank, world)
        if self.draft is not None:
            kind = self.cfg.spec.spec_draft_kind
            if saved is not None and not saved.get("draft_state", True):
                raise ckpt_io.CheckpointLoadError(
                    "the checkpoint has no draft trainer state; it was saved without "
                    "--spec-online-draft-training"
                )
            if not same and kind == "mtp" and saved["tp_size"] != info.tp_size:
                raise ckpt_io.CheckpointLoadError(
                    "the MTP draft learner's state is tensor-parallel: it resumes at the TP size it was "
                    "saved with "
                    f"({saved['tp_size']}), this run has TP {info.tp_size}"
                )
            state["draft"] = ckpt_io.per_rank(
                "draft_state", self.draft.state_dict() if saved is None else None, rank, world
            )
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
