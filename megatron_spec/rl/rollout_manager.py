"""The rollout manager: the engine fleet and its layout, the prompts and rewards, generation over
the engines, restarts, held-out evaluation, and the weight push from the policy actor.

* **data**: ``prompts_per_step`` prompts (resumable position), tokenised, lengths checked;
* **prepare** (:meth:`RolloutManager.push_weights`): the policy (and the online-trained draft)
  streamed into every engine that does not hold them, verified by version and checksum
  (``megatron_spec.sync``); each engine is fed by its own senders (``rollout/fleet.py``);
* **gen** (:meth:`RolloutManager.generate`): ``grpo_group_size`` samples per prompt; engine e
  is owned by the first rank of the e-th block of ranks; the prompts are shared out as whole
  groups, each owner generates and scores its shard (**reward**), every rank gets every shard.

A dead engine is restarted by its owner, re-fed by its senders, and only its prompts are
generated again (the other engines' rollouts are kept; ``--engine-restarts`` rounds at most).

Asynchronous mode (``--async-policy-lag`` L >= 1): :meth:`RolloutManager.submit` starts batch
t+L on the owner's executor thread while the trainer works on batch t (one engine call in
flight at a time; the trainer talks to the engine only while it is idle).

What it builds comes from ``rl/engine_setup.py``; which weights each engine holds and the push are
``rl/weight_push.py``'s; the parts of a round that need no process group are ``rl/engine_shards.py``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_spec.config import RunConfig
from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl import engine_setup
from megatron_spec.rl.engine_shards import (
    assemble_batch,
    engine_seed,
    eval_metrics,
    generate_shard,
    in_request_order,
    scored,
    shard_plan,
)
from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rl.step_records import Batch, Pending, Round, Shard, engine_metrics
from megatron_spec.rl.weight_push import WeightPush

if TYPE_CHECKING:
    from megatron_spec.rl.actor import PolicyActor
    from megatron_spec.rl.task import PromptTask
from megatron_spec.interfaces import RolloutEngine
from megatron_spec.rollout.types import GenerateRequest
from megatron_spec.telemetry import StageTimer

logger = logging.getLogger(__name__)


class RolloutWaitTimeout(RuntimeError):
    """A rank waited longer than ``--rollout-wait-timeout-s`` for an engine's rollouts."""


class RolloutManager:
    """Engines, prompts and rewards of this job, seen from one rank.

    Built before the policy (the layout checks the flags and makes the senders' groups, a
    collective); :meth:`start` then loads the data and starts this owner's engine.
    """

    def __init__(self, cfg: RunConfig, info: ParallelInfo, timer: StageTimer):
        from megatron_spec.rollout import default_backend
        from megatron_spec.rollout.fleet import EngineLayout

        self.cfg = cfg
        self.info = info
        self.timer = timer
        r = cfg.rollout
        self.backend = r.rollout_backend or default_backend()
        engine_setup.check_backend(cfg, self.backend)
        self.layout = EngineLayout.resolve(
            world_size=info.world_size, trainer_tp_size=info.tp_size, num_engines=r.rollout_num_engines,
            engine_tp_size=r.rollout_tensor_parallel_size,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)), backend=self.backend)
        self.owner = self.layout.is_owner(info.rank)
        self.my_engine = self.layout.engine_of(info.rank)
        self.sender_engine = self.layout.sender_engine(info.rank)
        # per-TP-rank payloads through the senders' group (sync/forward.py)
        self._sender_group = engine_setup.sender_group(self.layout, self.sender_engine, r.dist_timeout_s)
        self.engine: RolloutEngine | None = None
        self.streamer = None
        self.watchdog = None
        # --rollout-reference-check: the native engine beside this owner's (rl/reference.py)
        self.reference = None
        self.weights = WeightPush(cfg, info, self.layout)  # the versions each engine holds, the push
        self.engine_restarts_total = 0
        self.speculation_off = False  # the watchdog's fallback, applied while the engine is idle
        self._speculation_applied = False  # the engines run it (a restarted engine starts speculative again)
        self._round = 0  # generate rounds so far (the same count on every rank)
        self.pending: list[Pending] = []
        self.pipeline_started = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if self.owner else None

    # ------------------------------------------------------------------ engines
    def start(self, task: PromptTask, actor: PolicyActor) -> None:
        """Start this owner's engine (and its streamer, and the acceptance watchdog); a sender of a
        TP>1 engine gets the streamer that forwards its payloads to the owner. ``task``: the prompts
        and the reward; ``actor``: the policy whose weights :meth:`push_weights` streams."""
        r = self.cfg.rollout
        self.task, self.actor = task, actor
        self._engine_cfg = engine_setup.engine_config(
            self.cfg, self.info.device, self.backend, online_draft=actor.draft is not None)
        if self.info.rank == 0 and (self.layout.num_engines > 1 or self.layout.engine_tp_size > 1):
            print(f"megatron-spec: {self.layout.describe()}", file=sys.stderr, flush=True)
        if self.owner:
            self._start_engine()
            if r.rollout_reference_check:
                self.reference = engine_setup.reference_check(
                    dataclasses.replace(self._engine_cfg, engine_index=self.my_engine), task, r)
            self.watchdog = engine_setup.acceptance_watchdog(self.cfg)
        elif self.sender_engine is not None:
            self.streamer = engine_setup.forwarding_streamer(
                r, self.backend, owner=self.layout.owner(self.sender_engine), group=self._sender_group,
                engine_dtype=self._engine_cfg.resolved(self.info.device.type).dtype)

    def _start_engine(self) -> None:
        """Start this owner's engine (and its streamer); every rank then treats it as holding no weights."""
        config = dataclasses.replace(self._engine_cfg, engine_index=self.my_engine)
        owned = engine_setup.start_owner_engine(config, self.cfg.rollout, self.layout, self.backend,
                                                rank=self.info.rank, group=self._sender_group)
        self.engine, self.streamer = owned.engine, owned.streamer

    def _restart_engine(self, why: str) -> None:
        logger.warning("rollout engine %d failed (%s); restarting it", self.my_engine, why)
        try:
            self.engine.shutdown()
        except Exception:  # a dead engine may fail to say goodbye; it is replaced either way
            pass
        self._start_engine()

    def shutdown(self) -> None:
        if self._executor is not None:
            for p in self.pending:
                if p.future is not None:
                    p.future.cancel()
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
        if self.reference is not None:
            self.reference.shutdown()

    def release_memory(self) -> None:
        """Colocated (synchronous) runs: the engines hand their memory back after generating; their
        weights must be pushed again (the same bookkeeping on every rank)."""
        if self.owner:
            self.engine.release_memory()
        self.weights.forget()

    def sampler_state(self) -> dict[str, int]:
        """The data position to resume from: before the prompts of a batch still in flight (async
        mode), so a resumed run generates and trains on them instead of skipping them."""
        if self.pending:
            return self.pending[0].sampler_state
        return self.task.sampler.state_dict()

    def apply_speculation(self, version: int) -> None:
        """Switch the engines to autoregressive decoding once the watchdog asked for it (collective: every
        rank calls it before a generate round, with the ``version`` the round generates from); called only
        where no generate is in flight (the handle's pipe serves one call at a time). The native engine
        switches in place; vLLM and SGLang fix their speculative method at start-up and rebuild, losing
        their weights, so the policy ``version`` is pushed to them again here."""
        if not self.speculation_off or self._speculation_applied:
            return
        self._speculation_applied = True
        if self.owner and self.engine is not None:
            self.engine.set_speculation(False)
        if self.backend != "native":
            self.weights.forget()
            self.push_weights(version)

    def observe_acceptance(self, metrics: dict[str, Any]) -> None:
        """The watchdog reads the step's acceptance (owners: the same job-wide value) and may ask for
        the autoregressive fallback; ``spec/watchdog`` says what it decided."""
        if self.watchdog is None or not self.owner or self.engine is None:
            return
        from megatron_spec.rl.watchdog import Action

        # no per-position rate: no speculative verify step this step (off, or adaptive k = 0)
        spec = any(k.startswith("spec/accept_rate_pos") for k in metrics)
        action = self.watchdog.observe(metrics["spec/accept_length"] if spec else None)
        metrics["spec/watchdog"] = action.value
        if action is Action.FALLBACK and self.cfg.spec.spec_watchdog_fallback:
            self.speculation_off = True

    # ------------------------------------------------------------------ weights
    def push_weights(self, version: int | None = None) -> dict[str, float]:
        """Stream the actor's policy of ``version`` (default: the current one) and its draft into
        every engine that does not hold them. Collective: every rank calls it at the same point, and
        each engine is fed by its own senders (their trainer TP groups take part in the gathers;
        other ranks return at once). An older version is streamed from its snapshot.
        ``sync/bytes`` and ``sync/seconds`` are engine 0's (rank 0's own sync)."""
        version = self.actor.policy_version if version is None else version
        if self.owner and self.cfg.rollout.rollout_release_memory and self.cfg.rollout.async_policy_lag == 0:
            self.engine.resume_memory()
        pushed = self.weights.push(self.actor, version, streamer=self.streamer, reference=self.reference,
                                   draftless=self._speculation_applied and self.backend != "native")
        if pushed.reference_sync_s is not None:  # both engines decode the probes after the new policy
            from megatron_spec.rl.reference import check_owners

            pushed.metrics.update(check_owners(self.reference, self.engine, self.task.tokenizer.decode,
                                               self.info, pushed.reference_sync_s))
        return pushed.metrics

    # ------------------------------------------------------------------ generation over the engines
    def _generate_shard(self, reqs: list[GenerateRequest], seed: int) -> Shard:
        """This owner's engine call (runs in the executor thread in async mode); a failed engine is
        restarted by :meth:`_collect`, where every feeding rank streams its weights again."""
        return generate_shard(self.engine, self.my_engine, reqs, seed,
                              progress=self.info.rank == 0 and not self.cfg.logging.quiet)

    def _exchange(self, local: Shard | None, engines: list[int]) -> dict[int, Shard]:
        """Every rank gets the shard of every engine in ``engines`` from its owner, over the
        long-timeout group (a rank waiting for a long generation must not hit the training timeout)."""
        if self.info.world_size == 1:
            return {local.engine: local}
        self._wait_for_engines(engines)
        got = {}
        for e in engines:
            owner = self.layout.owner(e)
            box = [local if self.info.rank == owner else None]
            dist.broadcast_object_list(box, src=owner, group=self.info.wait_group)
            got[e] = box[0]
        return got

    def _wait_for_engines(self, engines: list[int]) -> None:
        """Wait until every owner of ``engines`` has its shard, through the job's key-value store: a
        heartbeat that knows which engines are late, so a wait past ``--rollout-wait-timeout-s``
        stops the run naming them (a collective that timed out could not say whom it waited for)."""
        store = dist.distributed_c10d._get_default_store()
        self._round += 1
        key = f"megatron_spec/gen/{self._round}/{{}}".format
        if self.owner and self.my_engine in engines:
            store.set(key(self.my_engine), "1")
            if self._round > 2:  # keys of two rounds ago: every rank has read them
                store.delete_key(f"megatron_spec/gen/{self._round - 2}/{self.my_engine}")
        deadline = time.monotonic() + self.info.wait_timeout_s
        missing = list(engines)
        while True:
            missing = [e for e in missing if not store.check([key(e)])]
            if not missing:
                return
            if time.monotonic() > deadline:
                late = ", ".join(f"engine {e} (rank {self.layout.owner(e)})" for e in missing)
                raise RolloutWaitTimeout(
                    f"rank {self.info.rank} waited more than --rollout-wait-timeout-s "
                    f"{self.info.wait_timeout_s:g} "
                    f"for the rollouts of {late}; a generation is stuck or needs longer: raise "
                    f"--rollout-wait-timeout-s"
                )
            time.sleep(0.02)

    def _collect(
        self, rnd: Round, version: int, first: Shard | None = None
    ) -> tuple[list[Rollout], list[Shard]]:
        """One generate round over all engines (collective): each owner generates its shard of the
        round and scores it; every rank gets every shard. An engine that fails is restarted by its
        owner and re-fed ``version`` by its senders, and only its shard is generated again; the
        other engines' rollouts are kept (``--engine-restarts`` rounds at most).

        ``first``: this owner's shard already generated (async mode). Returns the rollouts in
        request order (then sample index), and the shards (per-engine statistics)."""
        reqs, meta = rnd.requests, rnd.meta()
        plan = shard_plan(reqs, self.layout.num_engines)
        pending = [e for e in range(self.layout.num_engines) if plan[e]]
        mine = [reqs[i] for i in plan[self.my_engine]] if self.owner else []
        done: dict[int, Shard] = {}
        tries = self.cfg.rollout.engine_restarts + 1
        for attempt in range(tries):
            local = None
            if self.owner and self.my_engine in pending:
                local = first if first is not None else self._generate_shard(
                    mine, engine_seed(rnd.seed, self.my_engine))
                if local.error is None:  # the owner scores its own (the reward work is spread over them)
                    local = scored(local, self.task, meta, version)
            first = None
            got = self._exchange(local, pending)
            failed = [e for e in pending if got[e].error is not None]
            done.update({e: got[e] for e in pending if got[e].error is None})
            if not failed:
                break
            if attempt + 1 == tries:
                raise RuntimeError(f"rollout engine(s) {failed} failed {tries} times in a row; last error: "
                                   f"{got[failed[0]].error}")
            self._restart_failed(failed, got, version)
            pending = failed
        return in_request_order(reqs, done.values()), [done[e] for e in sorted(done)]

    def _restart_failed(self, failed: list[int], got: dict[int, Shard], version: int) -> None:
        """The engines in ``failed`` (their shards in ``got`` name the error) restarted by their owners
        and re-fed ``version`` by their senders (collective: the same bookkeeping on every rank)."""
        if self.info.rank == 0:
            logger.warning(
                "rollout engine(s) %s failed (%s); restarting them and generating their prompts again",
                failed,
                got[failed[0]].error,
            )
        self.engine_restarts_total += len(failed)
        self.weights.forget(failed)
        # a restarted engine starts speculative: the fallback is applied again before the next round
        self._speculation_applied = False
        if self.owner and self.my_engine in failed:
            self._restart_engine(got[self.my_engine].error)
        self.push_weights(version)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of the engines' current policy on the held-out prompts: one sample per prompt,
        the rollout sampling settings, the same seed every time (so two evaluations differ by the
        policy, not by the draw). Collective: the prompts are shared out over the engines."""
        version = self.weights.target_version[0]
        rollouts, _ = self._collect(self.task.eval_round(), version)
        return eval_metrics(rollouts, version)

    def submit(self, step: int, version: int) -> None:
        """Async mode: draw the prompts of batch ``step`` and start generating this owner's shard
        with the weights of ``version``, which the engines hold now."""
        # a checkpoint taken while this batch is in flight resumes here
        before = self.task.sampler.state_dict()
        rnd = self.task.next_round(step)
        fut = None
        if self.owner:
            plan = shard_plan(rnd.requests, self.layout.num_engines)
            mine = [rnd.requests[i] for i in plan[self.my_engine]]
            fut = self._executor.submit(self._generate_shard, mine, engine_seed(rnd.seed, self.my_engine))
        self.pending.append(Pending(rnd, version, fut, before))

    def generate(self, step: int, version: int) -> tuple[Batch, float]:
        """Synchronous mode: the rollouts of batch ``step`` from the engines holding ``version``,
        on every rank (and the seconds rank 0 waited for them)."""
        self.apply_speculation(version)
        with self.timer("data"):
            rnd = self.task.next_round(step)
        with self.timer("gen"):
            t0 = time.perf_counter()
            rollouts, shards = self._collect(rnd, version)
            gen_s = time.perf_counter() - t0
        return assemble_batch(rollouts, shards, rnd.prompts, version, gen_s, self.cfg.grpo), gen_s

    def collect_pending(self) -> tuple[Batch, float]:
        """Async mode: the oldest batch in flight, on every rank, and the part of its generation
        this rank waited for (``gen/exposed_s``)."""
        with self.timer("gen"):
            t0 = time.perf_counter()
            p = self.pending.pop(0)
            first = p.future.result() if p.future is not None else None
            rollouts, shards = self._collect(p.round, p.version, first=first)
            # the part of the generation that overlapped this wait: from the wait's start to the
            # end of the last engine's call (or the wait itself, whichever is shorter)
            exposed = time.perf_counter() - t0
            if self.layout.num_engines == 1 and first is not None and first.error is None:
                exposed = max(0.0, min(first.seconds, first.end - t0))
        gen_s = max((sh.seconds for sh in shards), default=0.0)
        return assemble_batch(rollouts, shards, p.round.prompts, p.version, gen_s, self.cfg.grpo), exposed

    def engine_metrics(self, batch: Batch) -> dict[str, Any]:
        """Per-engine work and speculation (docs/metrics.md, "rollout engines")."""
        return engine_metrics(batch, self.layout.num_engines, self.engine_restarts_total)
