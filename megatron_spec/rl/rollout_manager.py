"""The rollout manager: the engine fleet and its layout, the prompts and rewards, generation over
the engines, restarts, held-out evaluation, and the weight push from the policy actor.

* **data**: ``prompts_per_step`` prompts (resumable position), tokenised, lengths checked;
* **prepare** (:meth:`RolloutManager.push_weights`): the policy (and the online-trained draft)
  streamed into every engine that does not hold them, verified by version and checksum
  (``megatron_spec.sync``); each engine is fed by its own senders (``rollout/fleet.py``);
* **gen** (:meth:`RolloutManager.next_batch`): ``grpo_group_size`` samples per prompt; engine e
  is owned by the first rank of the e-th block of ranks; the prompts are shared out as whole
  groups, each owner generates and scores its shard (**reward**), every rank gets every shard.

A dead engine is restarted by its owner, re-fed by its senders, and only its prompts are
generated again (the other engines' rollouts are kept; ``--engine-restarts`` rounds at most).

Asynchronous mode (``--async-policy-lag`` L >= 1): :meth:`RolloutManager.submit` starts batch
t+L on the owner's executor thread while the trainer works on batch t (one engine call in
flight at a time; the trainer talks to the engine only while it is idle).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_spec.config import ConfigError, RunConfig
from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl.advantages import grpo_advantages
from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rl.step_records import Batch, Pending, Round, Shard, engine_metrics

if TYPE_CHECKING:
    from megatron_spec.rl.actor import PolicyActor
    from megatron_spec.rl.task import PromptTask
from megatron_spec.interfaces import RolloutEngine
from megatron_spec.rollout.config import EngineConfig, engine_kwargs, parse_engine_kwargs
from megatron_spec.rollout.types import GenerateRequest, GenerateStats
from megatron_spec.telemetry import StageTimer, generation_bar

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
        r, s = cfg.rollout, cfg.spec
        self.backend = r.rollout_backend or default_backend()
        if self.backend == "sglang" and (s.spec_num_draft_tokens == "auto" or s.spec_history
                                         or s.spec_draft_kind == "history"):
            # the flags' check covers an explicit --rollout-backend sglang; this, SGLang as the GPU default
            raise ConfigError(
                "--spec-num-draft-tokens auto, --spec-history and --spec-draft-kind history run in the "
                "native engine only (SGLang drafts a fixed k: docs/architecture.md); the rollout backend "
                "defaults to sglang on a GPU: pass --rollout-backend native or a fixed k"
            )
        self.layout = EngineLayout.resolve(
            world_size=info.world_size, trainer_tp_size=info.tp_size, num_engines=r.rollout_num_engines,
            engine_tp_size=r.rollout_tensor_parallel_size,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)), backend=self.backend)
        self.owner = self.layout.is_owner(info.rank)
        self.my_engine = self.layout.engine_of(info.rank)
        self.sender_engine = self.layout.sender_engine(info.rank)
        self._sender_group = None
        # per-TP-rank payloads through the senders' group (sync/forward.py)
        if self.layout.engine_tp_size > 1:
            import datetime

            for e in range(self.layout.num_engines):  # collective: every rank creates every group
                grp = dist.new_group(ranks=list(self.layout.senders(e)), backend="gloo",
                                     timeout=datetime.timedelta(seconds=r.dist_timeout_s))
                if e == self.sender_engine:
                    self._sender_group = grp
        self.engine: RolloutEngine | None = None
        self.streamer = None
        self.watchdog = None
        # --rollout-reference-check: the native engine beside this owner's (rl/reference.py)
        self.reference = None
        # the policy / draft version each engine holds (the same list on every rank: -1 = none)
        self.engine_target_version = [-1] * self.layout.num_engines
        self.engine_draft_version = [-1] * self.layout.num_engines
        self.engine_restarts_total = 0
        self.speculation_off = False  # the watchdog's fallback, applied while the engine is idle
        self._speculation_applied = False  # the engines run it (a restarted engine starts speculative again)
        self._round = 0  # generate rounds so far (the same count on every rank)
        self.pending: list[Pending] = []
        self.pipeline_started = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1) if self.owner else None

    # ------------------------------------------------------------------ engines
    def engine_config(self, online_draft: bool) -> EngineConfig:
        """The engine's record from the run's settings (``rollout.config.SETTINGS`` maps them), with what the
        trainer decides: this rank's device, the context, weights streamed (not read), their dtype."""
        c, r = self.cfg, self.cfg.rollout
        values = {**dataclasses.asdict(c.model), **dataclasses.asdict(r), **dataclasses.asdict(c.spec)}
        if c.spec.spec_draft_kind == "mtp" and online_draft:
            # the heads are streamed from the trainer before the first rollout
            values["spec_draft_path"] = None
        return EngineConfig(
            **engine_kwargs(values),
            # the native engine shares this rank's device (SGLang places itself)
            device=str(self.info.device),
            context_length=c.data.max_prompt_length + r.rollout_max_new_tokens,
            load_weights=False, fp8_weights=r.rollout_weight_dtype == "fp8",
            engine_kwargs=parse_engine_kwargs(r.rollout_engine_kwargs, self.backend))

    def start(self, task: PromptTask, actor: PolicyActor) -> None:
        """Start this owner's engine (and its streamer, and the acceptance watchdog); a sender of a
        TP>1 engine gets the streamer that forwards its payloads to the owner. ``task``: the prompts
        and the reward; ``actor``: the policy whose weights :meth:`push_weights` streams."""
        r, s = self.cfg.rollout, self.cfg.spec
        self.task, self.actor = task, actor
        self._engine_cfg = self.engine_config(online_draft=actor.draft is not None)
        if self.info.rank == 0 and (self.layout.num_engines > 1 or self.layout.engine_tp_size > 1):
            print(f"megatron-spec: {self.layout.describe()}", file=sys.stderr, flush=True)
        if self.owner:
            self._start_engine()
            if r.rollout_reference_check:
                from megatron_spec.rl.reference import ReferenceCheck

                self.reference = ReferenceCheck(
                    dataclasses.replace(self._engine_cfg, engine_index=self.my_engine),
                    task.probe_requests(r.rollout_reference_prompts, r.rollout_reference_tokens),
                    bucket_bytes=r.rollout_bucket_mb << 20, weight_dtype=r.rollout_weight_dtype)
            if s.spec_draft_kind != "none" and s.spec_watchdog_steps > 0:
                from megatron_spec.rl.watchdog import AcceptanceWatchdog

                # every owner sees the same (job-wide) acceptance, so all engines fall back together
                self.watchdog = AcceptanceWatchdog(
                    window=s.spec_watchdog_steps, fallback=s.spec_watchdog_fallback
                )
        elif self.sender_engine is not None:
            from megatron_spec.sync.forward import PayloadForwarder
            from megatron_spec.sync.streamer import WeightStreamer

            self.streamer = WeightStreamer(
                PayloadForwarder(self._sender_group, self.layout.owner(self.sender_engine)),
                bucket_bytes=r.rollout_bucket_mb << 20, weight_dtype=r.rollout_weight_dtype,
                for_sglang=self.backend == "sglang", verify=False,
                engine_dtype=self._engine_cfg.resolved(self.info.device.type).dtype, engine_tp_size=1)

    def _start_engine(self) -> None:
        """Start this owner's engine (and its streamer); every rank then treats it as holding no weights."""
        from megatron_spec.rollout import make_engine
        from megatron_spec.sync.streamer import WeightStreamer

        r = self.cfg.rollout
        config = dataclasses.replace(self._engine_cfg, engine_index=self.my_engine)
        self.engine = make_engine(
            config,
            backend=self.backend,
            mem_fraction_static=r.rollout_mem_fraction_static,
            tp_size=self.layout.engine_tp_size,
            temperatures=(r.rollout_temperature,),
        )
        target = self.engine
        if self.layout.engine_tp_size > 1:  # one payload per engine TP rank, from its colocated rank
            from megatron_spec.sync.forward import PayloadGather

            target = PayloadGather(
                self.engine, self._sender_group, self.info.rank, self.layout.engine_tp_size
            )
        self.streamer = WeightStreamer(
            target,
            bucket_bytes=r.rollout_bucket_mb << 20,
            weight_dtype=r.rollout_weight_dtype,
            for_sglang=self.backend == "sglang",
        )

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
        n = self.layout.num_engines
        self.engine_target_version, self.engine_draft_version = [-1] * n, [-1] * n

    def sampler_state(self) -> dict[str, int]:
        """The data position to resume from: before the prompts of a batch still in flight (async
        mode), so a resumed run generates and trains on them instead of skipping them."""
        if self.pending:
            return self.pending[0].sampler_state
        return self.task.sampler.state_dict()

    def apply_speculation(self, version: int) -> None:
        """Switch the engines to autoregressive decoding once the watchdog asked for it (collective: every
        rank
        calls it before a generate round, with the ``version`` the round generates from); called only where no
        generate is in flight (the handle's pipe serves one call at a time). The native engine switches in
        place; vLLM and SGLang fix their speculative method at start-up and rebuild, losing their weights,
        so the policy ``version`` is pushed to them again here."""
        if not self.speculation_off or self._speculation_applied:
            return
        self._speculation_applied = True
        if self.owner and self.engine is not None:
            self.engine.set_speculation(False)
        if self.backend != "native":
            n = self.layout.num_engines
            self.engine_target_version, self.engine_draft_version = [-1] * n, [-1] * n
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
        actor = self.actor
        out = {"sync/bytes": 0.0, "sync/seconds": 0.0}
        version = actor.policy_version if version is None else version
        lay, rank = self.layout, self.info.rank
        if self.owner and self.cfg.rollout.rollout_release_memory and self.cfg.rollout.async_policy_lag == 0:
            self.engine.resume_memory()

        def account(rep) -> None:
            if rank == 0:
                out["sync/bytes"] += rep.bytes
                out["sync/seconds"] += rep.seconds
                for piece, sec in rep.timings.items():  # where the seconds went (docs/metrics.md)
                    out[f"sync/{piece}"] = out.get(f"sync/{piece}", 0.0) + sec

        need = [e for e in range(lay.num_engines) if self.engine_target_version[e] != version]
        check = self.cfg.rollout.rollout_reference_check and bool(need)
        t_ref = 0.0
        if need and (self.sender_engine in need or lay.gathers(rank, need)):
            # every rank of a feeding TP group takes part in the gathers
            with actor.weights_of(version) as model:
                from megatron_spec.models.gpt import iter_hf_views

                if self.sender_engine in need:
                    account(self.streamer.sync_target(model, str(version), tp_group=self.info.tp_group))
                else:
                    for _ in iter_hf_views(model, self.info.tp_group, stream_order=True):
                        pass
                if check:  # the reference engine's copy: the same gathers again
                    t0 = time.perf_counter()
                    if self.reference is not None and self.my_engine in need:
                        self.reference.sync(model, str(version), tp_group=self.info.tp_group)
                    else:
                        for _ in iter_hf_views(model, self.info.tp_group, stream_order=True):
                            pass
                    t_ref = time.perf_counter() - t0
        for e in need:
            self.engine_target_version[e] = version

        need = [e for e in range(lay.num_engines) if self.engine_draft_version[e] != actor.draft_version]
        if self._speculation_applied and self.backend != "native":
            need = []  # rebuilt without speculation (apply_speculation): vLLM and SGLang hold no draft now
        # MTP heads are tensor-parallel: their export gathers over the TP group like the target's
        collective = actor.draft is not None and self.cfg.spec.spec_draft_kind == "mtp"
        if need and self.sender_engine in need:
            named = (
                list(actor.draft.named_update_tensors()) if actor.draft is not None else self._static_draft
            )
            if named is not None:  # n-gram and plain decoding have no draft weights
                account(self.streamer.sync_draft(named, f"d{actor.draft_version}"))
        elif need and collective and lay.gathers(rank, need):
            for _ in actor.draft.named_update_tensors():
                pass
        for e in need:
            self.engine_draft_version[e] = actor.draft_version
        if check:
            from megatron_spec.rl.reference import check_owners

            out.update(
                check_owners(self.reference, self.engine, self.task.tokenizer.decode, self.info, t_ref)
            )
        return out

    @functools.cached_property
    def _static_draft(self) -> list[tuple[str, torch.Tensor]] | None:
        """The draft's weights as loaded at start-up (kept to re-push after a memory release:
        an engine that released its weights has lost the draft too)."""
        from megatron_spec.draft.modelopt_io import startup_draft_tensors

        return startup_draft_tensors(
            self.cfg.spec.spec_draft_kind, self.cfg.spec.spec_draft_path, self.actor.dcfg
        )

    # ------------------------------------------------------------------ generation over the engines
    def _shard_plan(self, reqs: list[GenerateRequest]) -> list[list[int]]:
        """Request positions per engine: whole requests (GRPO groups), balanced by expected work."""
        from megatron_spec.rollout.fleet import request_work, shard_requests

        work = [request_work(q.n, len(q.input_ids), q.sampling.max_new_tokens) for q in reqs]
        return shard_requests(work, self.layout.num_engines)

    @staticmethod
    def _engine_seed(seed: int, engine: int) -> int:
        """Engine e's sampling seed for a call (engine 0 keeps the job's seed: one engine runs as before)."""
        return seed + 1_000_003 * engine

    def _generate_shard(self, reqs: list[GenerateRequest], seed: int) -> Shard:
        """This owner's engine call (runs in the executor thread in async mode). A dead or stuck
        engine is reported, not restarted here: restarting needs the weights again, which every
        feeding rank streams together (:meth:`_collect`). Every backend raises the same two errors for an
        engine that is gone or stuck (``megatron_spec.interfaces``)."""
        from megatron_spec.interfaces import EngineDiedError, EngineTimeoutError

        t0 = time.perf_counter()
        if not reqs:
            return Shard(self.my_engine, [], GenerateStats(), 0.0, t0)
        try:
            with generation_bar(sum(q.n for q in reqs),
                                enabled=self.info.rank == 0 and not self.cfg.logging.quiet) as on_progress:
                samples, stats = self.engine.generate(reqs, seed=seed, on_progress=on_progress)
        except (EngineDiedError, EngineTimeoutError) as exc:
            end = time.perf_counter()
            return Shard(self.my_engine, None, None, end - t0, end, error=f"{type(exc).__name__}: {exc}")
        end = time.perf_counter()
        return Shard(self.my_engine, samples, stats, end - t0, end)

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
        plan = self._shard_plan(reqs)
        pending = [e for e in range(self.layout.num_engines) if plan[e]]
        mine = [reqs[i] for i in plan[self.my_engine]] if self.owner else []
        done: dict[int, Shard] = {}
        tries = self.cfg.rollout.engine_restarts + 1
        for attempt in range(tries):
            local = None
            if self.owner and self.my_engine in pending:
                local = first if first is not None else self._generate_shard(
                    mine, self._engine_seed(rnd.seed, self.my_engine))
                if local.error is None:  # the owner scores its own (the reward work is spread over them)
                    local = dataclasses.replace(
                        local,
                        samples=None,
                        rollouts=self.task.score(local.samples, meta, version),
                        request_ids=[s.request_id for s in local.samples],
                    )
            first = None
            got = self._exchange(local, pending)
            failed = [e for e in pending if got[e].error is not None]
            done.update({e: got[e] for e in pending if got[e].error is None})
            if not failed:
                break
            if attempt + 1 == tries:
                raise RuntimeError(f"rollout engine(s) {failed} failed {tries} times in a row; last error: "
                                   f"{got[failed[0]].error}")
            if self.info.rank == 0:
                logger.warning(
                    "rollout engine(s) %s failed (%s); restarting them and generating their prompts again",
                    failed,
                    got[failed[0]].error,
                )
            self.engine_restarts_total += len(failed)
            for e in failed:  # the same bookkeeping on every rank
                self.engine_target_version[e] = self.engine_draft_version[e] = -1
            # a restarted engine starts speculative: the fallback is applied again before the next round
            self._speculation_applied = False
            if self.owner and self.my_engine in failed:
                self._restart_engine(got[self.my_engine].error)
            self.push_weights(version)
            pending = failed
        order = {q.request_id: i for i, q in enumerate(reqs)}
        keyed = [
            (order[q], ro.sample_index, ro)
            for sh in done.values()
            for ro, q in zip(sh.rollouts, sh.request_ids)
        ]
        rollouts = [ro for _, _, ro in sorted(keyed, key=lambda t: (t[0], t[1]))]
        return rollouts, [done[e] for e in sorted(done)]

    def _make_batch(self, rollouts: list[Rollout], shards: list[Shard], prompts: list[str], version: int,
                    gen_s: float) -> Batch:
        """Group-relative advantages over the assembled batch (every rank, the same result)."""
        g = self.cfg.grpo
        adv = grpo_advantages(torch.tensor([ro.reward for ro in rollouts]), g.grpo_group_size,
                              baseline=g.advantage_baseline, normalize_std=g.advantage_normalize_std)
        for ro, a in zip(rollouts, adv.tolist()):
            ro.advantage = a
        stats = GenerateStats()
        for sh in shards:
            stats.merge(sh.stats)
        stats.wall_s = max((sh.seconds for sh in shards), default=0.0)  # the engines ran side by side
        return Batch(rollouts, stats, prompts, version, gen_s, shards)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of the engines' current policy on the held-out prompts: one sample per prompt,
        the rollout sampling settings, the same seed every time (so two evaluations differ by the
        policy, not by the draw). Collective: the prompts are shared out over the engines."""
        version = self.engine_target_version[0]
        rollouts, _ = self._collect(self.task.eval_round(), version)
        rewards = [ro.reward for ro in rollouts]
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)
        return {
            "eval/reward": mean,
            "eval/reward_se": math.sqrt(var / len(rewards)),
            "eval/prompts": len(rewards),
            "eval/policy_version": version,
        }

    def submit(self, step: int, version: int) -> None:
        """Async mode: draw the prompts of batch ``step`` and start generating this owner's shard
        with the weights of ``version``, which the engines hold now."""
        # a checkpoint taken while this batch is in flight resumes here
        before = self.task.sampler.state_dict()
        rnd = self.task.next_round(step)
        fut = None
        if self.owner:
            plan = self._shard_plan(rnd.requests)
            mine = [rnd.requests[i] for i in plan[self.my_engine]]
            fut = self._executor.submit(
                self._generate_shard, mine, self._engine_seed(rnd.seed, self.my_engine)
            )
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
        return self._make_batch(rollouts, shards, rnd.prompts, version, gen_s), gen_s

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
        return self._make_batch(rollouts, shards, p.round.prompts, p.version, gen_s), exposed

    def engine_metrics(self, batch: Batch) -> dict[str, Any]:
        """Per-engine work and speculation (docs/metrics.md, "rollout engines")."""
        return engine_metrics(batch, self.layout.num_engines, self.engine_restarts_total)
