"""One GRPO step with speculative rollouts, synchronous or asynchronous: the recipe.

Two components do the work (each file says how): the **rollout manager**
(``rl/rollout_manager.py``: engines, prompts, rewards, generation, evaluation, the weight push)
and the **policy actor** (``rl/actor.py``: the policy, its reference and optimizer, the
verifier-side log-probs, the GRPO and draft updates). This file calls them in order, each stage
timed (``time/<stage>``): data, prepare (the weight push), gen (+ reward), logprob, train.

Asynchronous mode (``async_policy_lag`` L >= 1): the engines generate batch t+1 with policy
max(0, t+1-L) while the actor trains on batch t; the old log-probs of a batch are recomputed
under exactly the version that generated it (its snapshot). Failure handling: a dead engine is
restarted and only its prompts generated again; a non-finite loss or gradient stops the run
before anything is written; a reward function that raises stops it naming the sample.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from megatron_spec.config import RunConfig
from megatron_spec.models import HFCheckpoint
from megatron_spec.parallel import init_parallel
from megatron_spec.rl import checkpoint as ckpt_io
from megatron_spec.rl.actor import PolicyActor, TrainingDivergedError  # noqa: F401 (raised through run())
from megatron_spec.rl.rollout_manager import RolloutManager, RolloutWaitTimeout  # noqa: F401 (as above)
from megatron_spec.rl.rollouts import split
from megatron_spec.rl.step_records import dump_rollouts, step_metrics
from megatron_spec.rl.task import PromptTask
from megatron_spec.telemetry import StageTimer, open_metrics, print_progress, progress_line

logger = logging.getLogger(__name__)


class GRPOTrainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        m, r = cfg.model, cfg.rollout
        self.info = init_parallel(tp_size=m.tensor_model_parallel_size, seed=m.seed,
                                  timeout_s=r.dist_timeout_s, wait_timeout_s=r.rollout_wait_timeout_s)
        self.rank0 = self.info.rank == 0
        self.timer = StageTimer()
        self.rollout = RolloutManager(cfg, self.info, self.timer)  # the engine layout (checks the flags)
        ckpt = HFCheckpoint(m.hf_checkpoint)
        ckpt.decoder_config.check_tensor_parallel(m.tensor_model_parallel_size)
        self.task = PromptTask(cfg, self.timer)  # the tokenizer, prompt format and stop ids
        self.actor = PolicyActor(cfg, self.info, ckpt,
                                 renormalise_engine_logprobs=self.rollout.backend == "sglang")
        self.run_dir = ckpt_io.prepare_run_dir(cfg, self.info)  # resumes a stopped run (rl/checkpoint.py)
        self.task.load(self.run_dir)
        self.step = 0
        if cfg.draft.spec_online_draft_training:  # EAGLE-3 / MTP trained from the verifier's hidden states
            self.actor.init_online_draft(os.path.join(self.run_dir, "draft_export"))
        if cfg.checkpoint.load:
            self._resume(cfg.checkpoint.load)
        self.writer = None
        if self.rank0:
            self.writer = open_metrics(cfg, self.run_dir, self.step if cfg.checkpoint.load else None)
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                f.write(cfg.to_yaml())
        self.rollout.start(self.task, self.actor)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, Any]:
        """Synchronous: push, (evaluate), generate, logprob, train. Asynchronous: the batch generated
        meanwhile is collected, the engines get the next version and start the next batch, then
        logprob and train on the collected one."""
        lag, rollout, actor, timer = self.cfg.rollout.async_policy_lag, self.rollout, self.actor, self.timer
        timer.reset()
        metrics: dict[str, Any] = {"step": self.step + 1}
        if lag == 0:
            with timer("prepare"):
                actor.offload.enter("prepare")  # grads and optimizer state leave before the engine resumes
                metrics.update(rollout.push_weights())
                actor.offload.enter("gen")  # and, at level all, the weights once the engine has them
            if self._eval_due(self.step):
                with timer("eval"):  # the policy that generates this step's rollouts
                    metrics.update(rollout.evaluate())
            batch, exposed = rollout.generate(self.step, actor.policy_version)  # collective: every rank
            if self.cfg.rollout.rollout_release_memory:
                rollout.release_memory()
        else:
            actor.keep_snapshot()
            if not rollout.pipeline_started:  # start-up or resume: the engines get the current policy
                with timer("prepare"):
                    metrics.update(rollout.push_weights())
                rollout.pipeline_started = True
            with timer("data"):
                if not rollout.pending:  # start-up (or resume): the first batch, with the current policy
                    rollout.submit(self.step, actor.policy_version)
            batch, exposed = rollout.collect_pending()
            # the engines are idle: version max(0, t+1-L) (never older than a resumed run's), batch t+1.
            # One engine call is in flight at a time: a lag of L comes from the version pushed.
            version = max(actor.oldest_version, self.step + 1 - lag)
            with timer("prepare"):
                metrics.update(rollout.push_weights(version))
            if self.step + 1 < self.cfg.grpo.train_iters:
                rollout.apply_speculation(version)
                rollout.submit(self.step + 1, version)
        self.last_batch = batch
        with timer("logprob"):
            actor.offload.enter("logprob")
            mine = split(batch.rollouts, self.info.dp_size)[self.info.dp_rank]
            microbatches, mismatch = actor.old_logprobs(mine, self.task.pad_id)
        with timer("train"):
            actor.offload.enter("train")
            metrics.update(actor.train(microbatches, self.step))
            if actor.draft is not None:
                metrics.update(actor.train_draft(self.step))
        actor.policy_version += 1
        if lag > 0:  # the next batch to train on was generated by max(0, step + 1 - L)
            actor.drop_snapshots_before(max(actor.oldest_version, self.step + 1 - lag))
        self.step += 1
        if lag == 0 and self.cfg.logging.eval_interval and self.step == self.cfg.grpo.train_iters:
            with timer("eval"):  # and the final policy
                actor.offload.enter("prepare")
                rollout.push_weights()
                actor.offload.enter("gen")
                final = rollout.evaluate()
                actor.offload.enter("train")  # the checkpoint reads everything
            metrics.update({k.replace("eval/", "eval_final/"): v for k, v in final.items()})
        metrics.update(mismatch)
        spec = self.cfg.draft.spec_draft_kind != "none"
        metrics.update(step_metrics(batch, exposed, policy_version=actor.policy_version, speculative=spec))
        if actor.draft is None:
            metrics["draft/loss"] = None
        metrics.update(rollout.engine_metrics(batch))
        metrics.update(timer.metrics())
        return metrics

    def _eval_due(self, step: int) -> bool:
        return bool(self.cfg.logging.eval_interval) and step % self.cfg.logging.eval_interval == 0

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        actor = self.actor
        trainer_state = {"step": self.step, "policy_version": actor.policy_version,
                         "draft_version": actor.draft_version, "draft_state": actor.draft is not None,
                         "sampler": self.rollout.sampler_state(),
                         "world_size": self.info.world_size, "tp_size": self.info.tp_size,
                         "config": self.cfg.to_dict()}
        ckpt_io.save_checkpoint(self.cfg.checkpoint.save, self.step, rank=self.info.rank,
                                sharded_state=actor.sharded_state(), trainer_state=trainer_state,
                                draft_saver=actor.export_draft if actor.draft is not None else None)
        if self.rank0:
            for gone in ckpt_io.prune(self.cfg.checkpoint.save, self.cfg.checkpoint.save_keep):
                logger.info("--save-keep %d: removed %s", self.cfg.checkpoint.save_keep, gone)

    def _resume(self, root: str) -> None:
        path, saved = ckpt_io.latest_checkpoint(root)
        state = ckpt_io.load_checkpoint(path, self.actor.sharded_state(saved=saved))
        versions = dict(policy_version=saved["policy_version"], draft_version=saved.get("draft_version", 0))
        self.actor.load_state(state, path, **versions)
        self.step = saved["step"]
        self.task.sampler.load_state_dict(saved["sampler"])
        if self.rank0:
            print(f"megatron-spec: {ckpt_io.resume_line(path, saved, self.info, self.cfg.grpo.train_iters)}",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ loop
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        history = []
        start, first = time.monotonic(), self.step  # this process's pace (a resumed run: since it)
        try:
            while self.step < cfg.grpo.train_iters:
                m = self.train_step()
                self.rollout.observe_acceptance(m)  # the watchdog may ask for the autoregressive fallback
                if self.rank0:
                    self.writer.write(m)
                    if cfg.logging.dump_rollouts:
                        dump_rollouts(self.last_batch, os.path.join(self.run_dir, "rollouts",
                                                                    f"step_{self.step:06d}.jsonl"))
                    interval = cfg.logging.log_interval  # 0: no progress line
                    if not cfg.logging.quiet and interval and self.step % interval == 0:
                        left = cfg.grpo.train_iters - self.step
                        eta = (time.monotonic() - start) / (self.step - first) * left
                        print_progress(progress_line(m, cfg.grpo.train_iters, eta))
                history.append(m)
                interval = cfg.checkpoint.save_interval
                if (interval and self.step % interval == 0) or self.step == cfg.grpo.train_iters:
                    self.save()
            if cfg.checkpoint.save_hf and history:  # the trained policy as an HF folder beside its draft
                from megatron_spec.rl.export import export_trained

                export_trained(cfg, self.info, self.actor, self.run_dir, self.step)
        finally:
            self.shutdown()
        return history

    def shutdown(self) -> None:
        self.rollout.shutdown()
        if self.writer is not None:
            self.writer.close()
