"""One RL step, autoregressive vs speculative: stage times, step times and speedups.

Stages (docs/design.md, "The RL step"): ``data`` (a fixed per-step cost), ``prepare`` (weight sync into
the engines), ``gen`` (rollout generation, :mod:`megatron_spec.sim.rollout`), ``logprob``
(Megatron forward of the verifier over all rollout tokens), ``train`` (forward + backward,
i.e. 3x the forward: the 6 N tokens rule plus causal attention), and ``draft_train`` when the
draft is trained online (EAGLE-3/MTP head over all tokens x the training-time-test unroll).

Synchronous mode: all GPUs generate, then all train; step = sum of the stages.
Asynchronous mode (policy lag L >= 1): ``train_gpus`` train while the others generate the next
step's rollouts with weights at most L versions old; the step period is
max(logprob + train + draft_train, prepare + gen), and the part of generation not hidden
behind training is reported as ``exposed_gen``. With L = 1 the engine drains each step (it
needs the newest weights before starting the next batch), so ``gen`` includes the long tail;
with L >= 2 it can admit the next step's prompts while the tail finishes, so ``gen`` is the
steady-state (streaming) time.

Whether the layout holds the model, and how many sequences its engines run at once, is
:mod:`megatron_spec.sim.capacity`. What it does not know: pipeline parallel bubbles, reward-model time,
dynamic sampling, data loading beyond a constant, and failure/restart costs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_spec.sim.acceptance import AcceptanceProfile
from megatron_spec.sim.capacity import EnginePlacement, check_parallelism, engine_memory, place_engines
from megatron_spec.sim.hardware import HardwareProfile, get_hardware
from megatron_spec.sim.models import ModelProfile, draft_profile, get_model
from megatron_spec.sim.params import EfficiencyParams, EngineSettings, default_engine_settings, efficiency_for
from megatron_spec.sim.rollout import GenerationResult, simulate_engine, simulate_streaming
from megatron_spec.sim.roofline import DRAFT_KINDS, ForwardModel, Parallelism, StepModel
from megatron_spec.sim.workload import PRESETS, Workload


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation needs (CLI flags map one to one)."""

    model: str | ModelProfile
    hardware: str | HardwareProfile
    num_gpus: int
    mode: str = "sync"
    policy_lag: int = 1
    draft_kind: str = "eagle3"
    num_draft_tokens: int = 3
    accept_length: float | None = None
    accept_rates: tuple[float, ...] | None = None
    tp: int | None = 1  # None: searched by megatron_spec.sim.layout.simulate_layout
    ep: int | None = 1
    num_engines: int | None = None  # None: as many engines as the generation GPUs hold
    workload: Workload = PRESETS["rl-zero"]
    rollout_dtype: str = "bf16"
    train_gpus: int | None = None
    draft_model: str | None = None
    online_draft_training: bool = False
    draft_train_unroll: int = 3
    efficiency: EfficiencyParams | None = None
    engine: EngineSettings | None = None
    calibration_path: str | Path | None = None
    measured_path: str | Path | bool | None = None
    """Measured verify/draft forward times (``sim.measured``): None reads the committed GPU run's file when
    there is one, a path reads that file, False uses the roofline alone."""

    def replace(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class SimResult:
    rollout_speedup: float
    e2e_speedup: float
    step_time_ar_s: float
    step_time_spec_s: float
    stages_ar: dict
    stages_spec: dict
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"rollout_speedup": self.rollout_speedup, "e2e_speedup": self.e2e_speedup,
                "step_time_ar_s": self.step_time_ar_s, "step_time_spec_s": self.step_time_spec_s,
                "stages_ar": self.stages_ar, "stages_spec": self.stages_spec, **self.detail}


def build_acceptance(cfg: SimConfig) -> AcceptanceProfile:
    if cfg.num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens k={cfg.num_draft_tokens} must be >= 1")
    if (cfg.accept_length is None) == (cfg.accept_rates is None):
        raise ValueError(
            "give exactly one of accept_length (--accept-length) or accept_rates (--accept-rates)"
        )
    if cfg.accept_rates is not None:
        return AcceptanceProfile.from_rates(cfg.accept_rates)
    return AcceptanceProfile.from_accept_length(cfg.accept_length, cfg.num_draft_tokens)


def _train_side(model: ModelProfile, draft: ModelProfile | None, hw: HardwareProfile, eff: EfficiencyParams,
                wl: Workload, train_gpus: int, online_draft: bool, unroll: int) -> dict[str, float]:
    flops = hw.peak_flops("bf16") * eff.train_mfu * train_gpus
    tokens = wl.train_tokens()
    fwd = 2.0 * model.active_params * tokens + model.attn_flops_per_ctx * wl.attention_token_pairs()
    out = {"logprob": fwd / flops, "train": 3.0 * fwd / flops, "draft_train": 0.0}
    if online_draft and draft is not None:
        dfwd = 2.0 * draft.active_params * tokens + draft.attn_flops_per_ctx * wl.attention_token_pairs()
        out["draft_train"] = 3.0 * unroll * dfwd / flops
    return out


def step_cost_breakdown(steps: StepModel, batch: float, ctx_per_seq: float, tau: float) -> dict:
    """One decode step and one speculative step of ``batch`` sequences at ``ctx_per_seq`` cached
    tokens each, by component: what the verify step streams and computes that the decode step
    does not (weight bytes, distinct experts per MoE layer, KV bytes, collectives), the draft,
    and the per-step speedup tau x t_decode / t_spec (below 1: speculation loses at this batch)."""
    b, ctx = np.array([batch]), np.array([batch * ctx_per_seq])
    ar = steps.target.forward(b, 1, ctx, steps.target.eff.step_overhead_s)
    v = steps.target.forward(b, steps.k + 1, ctx, steps.target.eff.step_overhead_s)
    spec = steps.spec_step(b, ctx)

    def ms(x) -> float:
        return round(float(np.asarray(x).ravel()[0]) * 1e3, 4)

    out = {
        "batch": float(batch),
        "ctx_per_seq": float(ctx_per_seq),
        "decode_ms": ms(ar["total"]),
        "verify_ms": ms(v["total"]),
        "draft_ms": ms(spec["draft"] + spec["host"]),
        "spec_step_ms": ms(spec["total"]),
        "step_speedup": round(tau * float(ar["total"][0]) / float(spec["total"][0]), 4),
    }
    for name, f in (("decode", ar), ("verify", v)):
        out[f"{name}_parts_ms"] = {c: ms(f[c]) for c in ("gemm", "attn", "logits", "comm", "overhead")}
        out[f"{name}_weight_gb_per_device"] = round(float(np.asarray(f["weight_bytes"]).ravel()[0]) / 1e9, 4)
        out[f"{name}_kv_gb_per_device"] = round(float(np.asarray(f["kv_bytes"]).ravel()[0]) / 1e9, 4)
        if steps.target.model.is_moe:
            out[f"{name}_distinct_experts_per_layer"] = round(
                float(np.asarray(f["distinct_experts"]).ravel()[0]), 2
            )
    return out


def _forward_models(cfg: SimConfig, model: ModelProfile, hw: HardwareProfile, eff, settings, par
                    ) -> tuple[ForwardModel, ForwardModel | None]:
    """The target's and the draft's forward models, with the measured points that cover them."""
    from megatron_spec.sim.measured import measured_for

    target = ForwardModel(
        model,
        hw,
        eff,
        settings,
        par,
        cfg.rollout_dtype,
        measured=measured_for(model, hw, cfg.rollout_dtype, par, "target", cfg.measured_path),
    )
    dprof = draft_profile(cfg.draft_kind, model, cfg.draft_model)
    # the draft runs inside the same engine, with the same sharding (a dense draft ignores ep)
    draft = None
    if dprof is not None:
        dmeas = (measured_for(model, hw, cfg.rollout_dtype, par, "eagle3", cfg.measured_path)
                 if cfg.draft_kind == "eagle3" else None)
        draft = ForwardModel(dprof, hw, eff, settings, par, cfg.rollout_dtype, measured=dmeas)
    return target, draft


def build_step_model(cfg: SimConfig, k: int | None = None) -> StepModel:
    """The decode/verify step costs of one engine of ``cfg``'s layout (tp and ep given) at ``k``
    draft tokens (default cfg's), without simulating a whole RL step."""
    model = cfg.model if isinstance(cfg.model, ModelProfile) else get_model(cfg.model)
    hw = cfg.hardware if isinstance(cfg.hardware, HardwareProfile) else get_hardware(cfg.hardware)
    if cfg.tp is None or (cfg.ep is None and model.is_moe):
        raise ValueError(f"build_step_model() needs tp and ep (got tp={cfg.tp}, ep={cfg.ep})")
    eff = cfg.efficiency or efficiency_for(hw, cfg.calibration_path)
    settings = cfg.engine or default_engine_settings(hw)
    par = Parallelism(cfg.tp, cfg.ep or 1)
    check_parallelism(model, par)
    target, draft = _forward_models(cfg, model, hw, eff, settings, par)
    return StepModel(target, draft, cfg.draft_kind, cfg.num_draft_tokens if k is None else k)


@dataclass(frozen=True)
class _Setup:
    """What :func:`simulate` resolves from a :class:`SimConfig` before it times anything."""

    model: ModelProfile
    hw: HardwareProfile
    acceptance: AcceptanceProfile
    tau: float
    """Mean tokens one verify step emits at cfg's k."""
    eff: EfficiencyParams
    settings: EngineSettings
    par: Parallelism
    place: EnginePlacement


@dataclass(frozen=True)
class _Generation:
    """One engine's share of the rollouts, generated autoregressively (key ``"ar"``) and speculatively
    (``"spec"``)."""

    per_engine: int
    """Rollouts each engine generates."""
    concurrency: dict[str, int]
    """Sequences an engine runs at once."""
    runs: dict[str, GenerationResult]
    prefill: dict[str, float]
    """Seconds of the prompts' prefill."""


def _resolve(cfg: SimConfig) -> _Setup:
    """Check ``cfg`` and resolve its profiles, acceptance, efficiency, engine settings and layout."""
    model = cfg.model if isinstance(cfg.model, ModelProfile) else get_model(cfg.model)
    hw = cfg.hardware if isinstance(cfg.hardware, HardwareProfile) else get_hardware(cfg.hardware)
    if cfg.mode not in ("sync", "async"):
        raise ValueError(f"unknown mode {cfg.mode!r}; expected sync or async")
    if cfg.mode == "async" and cfg.policy_lag < 1:
        raise ValueError(f"async mode needs policy_lag >= 1, got {cfg.policy_lag} (lag 0 is sync mode)")
    if cfg.num_gpus < 1:
        raise ValueError(f"num_gpus={cfg.num_gpus} must be >= 1")
    if cfg.draft_kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {cfg.draft_kind!r}; expected one of {', '.join(DRAFT_KINDS)}")
    acceptance = build_acceptance(cfg)
    tau = acceptance.accept_length(cfg.num_draft_tokens)
    eff = cfg.efficiency or efficiency_for(hw, cfg.calibration_path)
    settings = cfg.engine or default_engine_settings(hw)
    if cfg.tp is None or (cfg.ep is None and model.is_moe):
        raise ValueError(f"simulate() needs tp and ep (got tp={cfg.tp}, ep={cfg.ep}); "
                         "megatron_spec.sim.layout.simulate_layout searches them")
    par = Parallelism(cfg.tp, cfg.ep or 1)
    check_parallelism(model, par)
    return _Setup(model, hw, acceptance, tau, eff, settings, par, place_engines(cfg, par))


def _generate(cfg: SimConfig, s: _Setup, steps: StepModel, concurrency: int) -> _Generation:
    """Generation on one engine, both ways: a batch drained to its last sequence (sync mode, or async with
    lag 1), or the steady state of an engine that admits the next step's prompts (async, lag >= 2).
    ``concurrency``: the sequences its memory holds, capped by the tokens a forward may batch."""
    wl = cfg.workload
    per_engine = math.ceil(wl.rollouts / s.place.engines)
    conc = {"ar": concurrency, "spec": concurrency}
    if s.settings.max_batched_tokens:
        for name, q in (("ar", 1), ("spec", cfg.num_draft_tokens + 1)):
            conc[name] = max(1, min(conc[name], s.settings.max_batched_tokens * s.par.attn_groups // q))
    if cfg.mode == "async" and cfg.policy_lag >= 2:
        runs = {}
        for name, fn, t in (("ar", steps.ar_step, 1.0), ("spec", steps.spec_step, s.tau)):
            runs[name] = simulate_streaming(per_engine * wl.mean_response_len(), wl.mean_response_len(),
                                            wl.mean_sq_response_len(), wl.prompt_len,
                                            min(conc[name], per_engine), t, fn)
    else:
        lengths = wl.engine_lengths(per_engine)
        runs = {"ar": simulate_engine(lengths, wl.prompt_len, conc["ar"], 1.0, steps.ar_step),
                "spec": simulate_engine(lengths, wl.prompt_len, conc["spec"], s.tau, steps.spec_step)}
    prefill = {"ar": steps.prefill(per_engine, wl.prompt_len, with_draft=False),
               "spec": steps.prefill(per_engine, wl.prompt_len, with_draft=True)}
    return _Generation(per_engine, conc, runs, prefill)


def _prepare_seconds(cfg: SimConfig, s: _Setup, target: ForwardModel, draft: ForwardModel | None) -> float:
    """The weight sync into the engines: the target's (and an online-trained draft's) bytes per device."""
    sync_bytes = target.weight_bytes_per_device()
    if cfg.online_draft_training and draft is not None:
        sync_bytes += draft.weight_bytes_per_device()
    if cfg.mode == "sync":  # colocated: a device-local copy (read + write)
        return 2.0 * sync_bytes / (s.hw.mem_bw * s.eff.mem_eff)
    # disaggregated: each generation device receives its shard from the trainers
    within = cfg.num_gpus <= s.hw.scaleup_domain
    bw, lat = (s.hw.link_bw, s.hw.link_latency_s) if within else (s.hw.net_bw, s.hw.net_latency_s)
    return sync_bytes / bw + lat


def _stage_times(cfg: SimConfig, data_s: float, prepare_s: float, gen_s: float, train: dict[str, float],
                 spec: bool) -> dict[str, float]:
    """Seconds of each stage of one step and of the ``step``: their sum (sync), or the longer of the
    training and generation sides (async; ``exposed_gen``: generation not hidden behind training)."""
    st = {"data": data_s, "prepare": prepare_s, "gen": gen_s, "logprob": train["logprob"],
          "train": train["train"], "draft_train": train["draft_train"] if spec else 0.0}
    if cfg.mode == "sync":
        st["step"] = sum(st.values())
    else:
        train_side = st["logprob"] + st["train"] + st["draft_train"]
        gen_side = st["prepare"] + st["gen"]
        st["exposed_gen"] = max(0.0, gen_side - train_side)
        st["step"] = st["data"] + max(train_side, gen_side)
    return st


def _detail(cfg: SimConfig, s: _Setup, steps: StepModel, gen: _Generation, mem: dict) -> dict:
    """What :attr:`SimResult.detail` reports besides the stage times."""
    k, wl, par, place = cfg.num_draft_tokens, cfg.workload, s.par, s.place
    b_full = float(max(1, min(gen.concurrency["spec"], gen.per_engine)))
    ctx = wl.prompt_len + wl.mean_response_len() / 2.0
    return {
        "model": s.model.name,
        "hardware": s.hw.name,
        "num_gpus": cfg.num_gpus,
        "mode": cfg.mode,
        "policy_lag": cfg.policy_lag if cfg.mode == "async" else 0,
        "draft_kind": cfg.draft_kind,
        "num_draft_tokens": k,
        **s.acceptance.describe(k),
        **{f"gen_{name}": {**gen.runs[name].as_dict(), "prefill_s": gen.prefill[name],
                           "concurrency": gen.concurrency[name]} for name in ("ar", "spec")},
        "engine": {
            "tp": par.tp,
            "ep": par.ep,
            "devices_per_engine": par.engine_devices,
            "engines": place.engines,
            "gen_gpus": place.gen_gpus,
            "train_gpus": place.train_gpus,
            "rollouts_per_engine": gen.per_engine,
            "rollout_dtype": steps.target.dtype,
            **mem,
        },
        "workload": wl.describe(),
        "step_costs": [step_cost_breakdown(steps, b, ctx, s.tau) for b in sorted({1.0, b_full})],
        "model_params": s.model.summary(),
        "efficiency": s.eff.as_dict(),
        "measured_points": {
            name: (fm.measured.describe() if fm is not None and fm.measured is not None else None)
            for name, fm in (("verify", steps.target), ("draft", steps.draft))
        },
    }


def simulate(cfg: SimConfig) -> SimResult:
    """Simulate one RL step with autoregressive and with speculative rollouts."""
    s = _resolve(cfg)
    target, draft = _forward_models(cfg, s.model, s.hw, s.eff, s.settings, s.par)
    mem = engine_memory(cfg, s.model, s.hw, s.settings, target, draft, cfg.workload, s.place.train_gpus)
    steps = StepModel(target, draft, cfg.draft_kind, cfg.num_draft_tokens)
    gen = _generate(cfg, s, steps, mem["concurrency"])
    train = _train_side(s.model, None if draft is None else draft.model, s.hw, s.eff, cfg.workload,
                        s.place.train_gpus, cfg.online_draft_training, cfg.draft_train_unroll)
    prepare = _prepare_seconds(cfg, s, target, draft)
    stages = {
        name: _stage_times(cfg, s.eff.step_fixed_s, prepare, gen.prefill[name] + gen.runs[name].decode_s,
                           train, spec=name == "spec")
        for name in ("ar", "spec")
    }
    return SimResult(
        rollout_speedup=stages["ar"]["gen"] / stages["spec"]["gen"],
        e2e_speedup=stages["ar"]["step"] / stages["spec"]["step"],
        step_time_ar_s=stages["ar"]["step"], step_time_spec_s=stages["spec"]["step"],
        stages_ar=stages["ar"], stages_spec=stages["spec"], detail=_detail(cfg, s, steps, gen, mem))


def speedup_by_k(cfg: SimConfig, k_values: range | list[int] = range(1, 11)) -> list[dict]:
    """Rollout and end-to-end speedup for each k with the same acceptance profile (a mean
    accept length given at cfg's k is turned into its geometric profile first)."""
    profile = build_acceptance(cfg)
    base = cfg.replace(accept_length=None, accept_rates=None)
    rows = []
    for k in k_values:
        rates = tuple(profile.marginal(k))
        res = simulate(base.replace(num_draft_tokens=k, accept_rates=rates))
        rows.append({"k": k, "accept_length": 1.0 + sum(rates), "extrapolated": profile.extrapolated(k),
                     "rollout_speedup": res.rollout_speedup, "e2e_speedup": res.e2e_speedup})
    return rows


def optimal_k(cfg: SimConfig, k_max: int = 10, metric: str = "e2e_speedup") -> tuple[int, list[dict]]:
    """The k in 1..k_max that maximises ``metric`` for cfg's acceptance profile (ties, e.g. when
    async training hides generation whatever k, go to the better rollout speedup)."""
    if k_max < 1:
        raise ValueError(f"k_max={k_max} must be >= 1")
    rows = speedup_by_k(cfg, range(1, k_max + 1))
    best = max(rows, key=lambda r: (round(r[metric], 9), r["rollout_speedup"]))
    return best["k"], rows
