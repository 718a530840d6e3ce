"""What one rank builds for the rollout engines from the run's settings.

The rules a backend puts on the speculation flags, the senders' process groups of TP>1 engines,
the engine's record (:func:`engine_config`), an owner's engine and the streamer that feeds it, a
TP sender's streamer that forwards its payloads to the owner, the reference engine beside an
owner's (``--rollout-reference-check``) and the acceptance watchdog. It knows nothing of prompts,
generate rounds, restarts or which weights an engine holds: the rollout manager
(``rl/rollout_manager.py``) decides when each is built and what it is used for.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from megatron_spec.config import ConfigError, RolloutConfig, RunConfig
from megatron_spec.interfaces import RolloutEngine
from megatron_spec.rollout.config import EngineConfig, parse_engine_kwargs
from megatron_spec.rollout.settings import engine_kwargs

if TYPE_CHECKING:
    from megatron_spec.rl.reference import ReferenceCheck
    from megatron_spec.rl.task import PromptTask
    from megatron_spec.rl.watchdog import AcceptanceWatchdog
    from megatron_spec.rollout.fleet import EngineLayout
    from megatron_spec.sync.streamer import WeightStreamer


class OwnedEngine(NamedTuple):
    """An owner's engine and the streamer that feeds it."""

    engine: RolloutEngine
    streamer: WeightStreamer


def check_backend(cfg: RunConfig, backend: str) -> None:
    """Refuse, on an SGLang backend, the speculation settings only the native engine runs."""
    s, d = cfg.spec, cfg.draft
    if backend == "sglang" and (
        s.spec_num_draft_tokens == "auto" or s.spec_history or d.spec_draft_kind == "history"
    ):
        # the flags' check covers an explicit --rollout-backend sglang; this, SGLang as the GPU default
        raise ConfigError(
            "--spec-num-draft-tokens auto, --spec-history and --spec-draft-kind history run in the "
            "native engine only (SGLang drafts a fixed k: docs/architecture.md); the rollout backend "
            "defaults to sglang on a GPU: pass --rollout-backend native or a fixed k"
        )


def sender_group(
    layout: EngineLayout, sender_engine: int | None, timeout_s: float
) -> dist.ProcessGroup | None:
    """The gloo group of ``sender_engine``'s senders (None: this rank feeds no TP>1 engine), through which
    the per-TP-rank payloads travel (sync/forward.py). Collective: every rank creates every group."""
    group = None
    if layout.engine_tp_size > 1:
        for e in range(layout.num_engines):  # collective: every rank creates every group
            grp = dist.new_group(
                ranks=list(layout.senders(e)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
            if e == sender_engine:
                group = grp
    return group


def engine_config(cfg: RunConfig, device: torch.device, backend: str, *, online_draft: bool) -> EngineConfig:
    """The engine's record from the run's settings (``rollout.settings.SETTINGS`` maps them), with what
    the trainer decides: this rank's device, the context, weights streamed (not read), their dtype."""
    c, r = cfg, cfg.rollout
    values = {
        **dataclasses.asdict(c.model),
        **dataclasses.asdict(r),
        **dataclasses.asdict(c.draft),
        **dataclasses.asdict(c.spec),
    }
    if c.draft.spec_draft_kind == "mtp" and online_draft:
        # the heads are streamed from the trainer before the first rollout
        values["spec_draft_path"] = None
    return EngineConfig(
        **engine_kwargs(values),
        # the native engine shares this rank's device (SGLang places itself)
        device=str(device),
        context_length=c.data.max_prompt_length + r.rollout_max_new_tokens,
        load_weights=False,
        fp8_weights=r.rollout_weight_dtype == "fp8",
        engine_kwargs=parse_engine_kwargs(r.rollout_engine_kwargs, backend),
    )


def start_owner_engine(
    config: EngineConfig,
    r: RolloutConfig,
    layout: EngineLayout,
    backend: str,
    *,
    rank: int,
    group: dist.ProcessGroup | None,
) -> OwnedEngine:
    """Start the engine ``config`` describes (its ``engine_index`` set) and the streamer that feeds it;
    a TP>1 engine gets one payload per engine TP rank, gathered from its senders over ``group``."""
    from megatron_spec.rollout import make_engine
    from megatron_spec.sync.streamer import WeightStreamer

    engine = make_engine(
        config,
        backend=backend,
        mem_fraction_static=r.rollout_mem_fraction_static,
        tp_size=layout.engine_tp_size,
        temperatures=(r.rollout_temperature,),
    )
    target = engine
    if layout.engine_tp_size > 1:  # one payload per engine TP rank, from its colocated rank
        from megatron_spec.sync.forward import PayloadGather

        target = PayloadGather(engine, group, rank, layout.engine_tp_size)
    streamer = WeightStreamer(
        target,
        bucket_bytes=r.rollout_bucket_mb << 20,
        weight_dtype=r.rollout_weight_dtype,
        for_sglang=backend == "sglang",
    )
    return OwnedEngine(engine, streamer)


def forwarding_streamer(
    r: RolloutConfig, backend: str, *, owner: int, group: dist.ProcessGroup | None, engine_dtype: torch.dtype
) -> WeightStreamer:
    """A TP>1 engine's sender (not its owner): the streamer that forwards this rank's payloads to the
    ``owner`` over the senders' ``group``."""
    from megatron_spec.sync.forward import PayloadForwarder
    from megatron_spec.sync.streamer import WeightStreamer

    return WeightStreamer(
        PayloadForwarder(group, owner),
        bucket_bytes=r.rollout_bucket_mb << 20,
        weight_dtype=r.rollout_weight_dtype,
        for_sglang=backend == "sglang",
        verify=False,
        engine_dtype=engine_dtype,
        engine_tp_size=1,
    )


def reference_check(config: EngineConfig, task: PromptTask, r: RolloutConfig) -> ReferenceCheck:
    """``--rollout-reference-check``: the native engine ``config`` describes, beside an owner's
    engine, with the task's probe prompts."""
    from megatron_spec.rl.reference import ReferenceCheck

    return ReferenceCheck(
        config,
        task.probe_requests(r.rollout_reference_prompts, r.rollout_reference_tokens),
        bucket_bytes=r.rollout_bucket_mb << 20,
        weight_dtype=r.rollout_weight_dtype,
    )


def acceptance_watchdog(cfg: RunConfig) -> AcceptanceWatchdog | None:
    """The watchdog of a speculative run (``--spec-watchdog-steps`` > 0), else None."""
    s = cfg.spec
    if cfg.draft.spec_draft_kind == "none" or s.spec_watchdog_steps <= 0:
        return None
    from megatron_spec.rl.watchdog import AcceptanceWatchdog

    # every owner sees the same (job-wide) acceptance, so all engines fall back together
    return AcceptanceWatchdog(window=s.spec_watchdog_steps, fallback=s.spec_watchdog_fallback)
