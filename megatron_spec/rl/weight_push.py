"""The weight push from the policy actor into the rollout engines, seen from one rank.

It keeps which policy and draft version each engine holds (the same lists on every rank, -1 =
none: a restarted or released engine is fed again and nothing else is) and pushes: the policy of
a version (an older one from its snapshot, ``PolicyActor.weights_of``) streamed into every engine
that lacks it by that engine's senders, every rank of a feeding trainer TP group taking part in the
gathers (``rollout/fleet.py``); the reference engine's copy (``--rollout-reference-check``); then
the draft, the online learner's or the one loaded at start-up. ``sync/*`` metrics are rank 0's own
syncs (engine 0's). It knows no prompts, generation or restarts: the rollout manager
(``rl/rollout_manager.py``) calls it at the same point on every rank with this rank's streamer and
reference engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from megatron_spec.config import RunConfig
from megatron_spec.parallel import ParallelInfo

if TYPE_CHECKING:
    from megatron_spec.models.hf_config import DecoderConfig
    from megatron_spec.rl.actor import PolicyActor
    from megatron_spec.rl.reference import ReferenceCheck
    from megatron_spec.rollout.fleet import EngineLayout
    from megatron_spec.sync.streamer import SyncReport, WeightStreamer


@dataclasses.dataclass
class PushResult:
    """What a push reports."""

    metrics: dict[str, float]
    """``sync/bytes``, ``sync/seconds`` and ``sync/<piece>`` (rank 0's syncs; 0 elsewhere)."""
    reference_sync_s: float | None
    """The seconds this rank spent on the reference engine's copy, when the reference check is due
    after this push (some engine was fed a new policy); None when it is not."""


class WeightPush:
    """The engines' weight versions and the push that updates them (see the module docstring)."""

    def __init__(self, cfg: RunConfig, info: ParallelInfo, layout: EngineLayout):
        self.cfg = cfg
        self.info = info
        self.layout = layout
        self.sender_engine = layout.sender_engine(info.rank)
        self.my_engine = layout.engine_of(info.rank)
        # the policy / draft version each engine holds (the same list on every rank: -1 = none)
        self.target_version = [-1] * layout.num_engines
        self.draft_version = [-1] * layout.num_engines
        self._startup_draft: list[tuple[str, torch.Tensor]] | None = None
        self._startup_draft_read = False

    def forget(self, engines: Iterable[int] | None = None) -> None:
        """``engines`` (default: all) hold no weights now: the next push feeds them again."""
        for e in range(self.layout.num_engines) if engines is None else engines:
            self.target_version[e] = self.draft_version[e] = -1

    def push(
        self,
        actor: PolicyActor,
        version: int,
        *,
        streamer: WeightStreamer | None,
        reference: ReferenceCheck | None,
        draftless: bool,
    ) -> PushResult:
        """Stream the actor's policy of ``version`` and its draft into every engine that does not hold
        them. Collective: every rank calls it at the same point. ``streamer``: this rank's (an owner's
        or a TP sender's; None: it feeds no engine); ``reference``: an owner's reference engine;
        ``draftless``: the engines were rebuilt without speculation and hold no draft."""
        metrics = {"sync/bytes": 0.0, "sync/seconds": 0.0}

        def account(rep: SyncReport) -> None:
            if self.info.rank == 0:
                metrics["sync/bytes"] += rep.bytes
                metrics["sync/seconds"] += rep.seconds
                for piece, sec in rep.timings.items():  # where the seconds went (docs/metrics.md)
                    metrics[f"sync/{piece}"] = metrics.get(f"sync/{piece}", 0.0) + sec

        need = [e for e in range(self.layout.num_engines) if self.target_version[e] != version]
        check = self.cfg.rollout.rollout_reference_check and bool(need)
        t_ref = self._push_target(actor, version, need, streamer, reference, check, account)
        for e in need:
            self.target_version[e] = version
        self._push_draft(actor, streamer, draftless, account)
        return PushResult(metrics, t_ref if check else None)

    def _push_target(
        self,
        actor: PolicyActor,
        version: int,
        need: list[int],
        streamer: WeightStreamer | None,
        reference: ReferenceCheck | None,
        check: bool,
        account: Callable[[SyncReport], None],
    ) -> float:
        """The policy of ``version`` into the engines in ``need``, and with ``check`` the reference
        engine's copy; returns the seconds this rank spent on that copy (0.0: none)."""
        lay, rank, tp_group = self.layout, self.info.rank, self.info.tp_group
        t_ref = 0.0
        if not need or not (self.sender_engine in need or lay.gathers(rank, need)):
            return t_ref
        from megatron_spec.models.gpt import iter_hf_views

        # every rank of a feeding TP group takes part in the gathers
        with actor.weights_of(version) as model:
            if self.sender_engine in need:
                account(streamer.sync_target(model, str(version), tp_group=tp_group))
            else:
                for _ in iter_hf_views(model, tp_group, stream_order=True):
                    pass
            if check:  # the reference engine's copy: the same gathers again
                t0 = time.perf_counter()
                if reference is not None and self.my_engine in need:
                    reference.sync(model, str(version), tp_group=tp_group)
                else:
                    for _ in iter_hf_views(model, tp_group, stream_order=True):
                        pass
                t_ref = time.perf_counter() - t0
        return t_ref

    def _push_draft(
        self,
        actor: PolicyActor,
        streamer: WeightStreamer | None,
        draftless: bool,
        account: Callable[[SyncReport], None],
    ) -> None:
        """The actor's draft (its online learner's, else the start-up one) into every engine that
        does not hold its version."""
        lay, rank = self.layout, self.info.rank
        need = [e for e in range(lay.num_engines) if self.draft_version[e] != actor.draft_version]
        if draftless:
            need = []  # rebuilt without speculation (apply_speculation): vLLM and SGLang hold no draft now
        # MTP heads are tensor-parallel: their export gathers over the TP group like the target's
        collective = actor.draft is not None and self.cfg.draft.spec_draft_kind == "mtp"
        if need and self.sender_engine in need:
            named = (
                list(actor.draft.named_update_tensors())
                if actor.draft is not None
                else self._startup_draft_tensors(actor.dcfg)
            )
            if named is not None:  # n-gram and plain decoding have no draft weights
                account(streamer.sync_draft(named, f"d{actor.draft_version}"))
        elif need and collective and lay.gathers(rank, need):
            for _ in actor.draft.named_update_tensors():
                pass
        for e in need:
            self.draft_version[e] = actor.draft_version

    def _startup_draft_tensors(self, target_cfg: DecoderConfig) -> list[tuple[str, torch.Tensor]] | None:
        """The draft's weights as loaded at start-up, read once (kept to re-push after a memory
        release: an engine that released its weights has lost the draft too)."""
        if not self._startup_draft_read:
            from megatron_spec.draft.modelopt_io import startup_draft_tensors

            d = self.cfg.draft
            self._startup_draft = startup_draft_tensors(d.spec_draft_kind, d.spec_draft_path, target_cfg)
            self._startup_draft_read = True
        return self._startup_draft
