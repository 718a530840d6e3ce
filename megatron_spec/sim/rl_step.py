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

What it does not know: pipeline parallel bubbles, reward-model time, dynamic sampling, data
loading beyond a constant, and failure/restart costs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_spec.sim.acceptance import AcceptanceProfile
from megatron_spec.sim.hardware import HardwareProfile, get_hardware
from megatron_spec.sim.models import ModelProfile, draft_profile, get_model
from megatron_spec.sim.params import EfficiencyParams, EngineSettings, default_engine_settings, efficiency_for
from megatron_spec.sim.rollout import simulate_engine, simulate_streaming
from megatron_spec.sim.roofline import DRAFT_KINDS, ForwardModel, Parallelism, StepModel
from megatron_spec.sim.workload import PRESETS, Workload

#: bytes per parameter of Megatron training state: bf16 weights, fp32 grads, fp32 master
#: weights, Adam m and v (Megatron distributed optimizer).
TRAIN_BYTES_PER_PARAM = 18


class LayoutError(ValueError):
    """The engine layout (tp, ep, engines) cannot hold the model's weights or one sequence's KV
    cache. The layout search (:mod:`megatron_spec.sim.layout`) skips such layouts; any other
    ValueError is a problem with the configuration as a whole."""


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


def _split_gpus(cfg: SimConfig, engine_devices: int) -> tuple[int, int]:
    """(generation GPUs, training GPUs)."""
    if cfg.mode == "sync":
        if cfg.train_gpus not in (None, cfg.num_gpus):
            raise ValueError("--train-gpus applies to async mode only (sync mode colocates generation "
                             "and training on all GPUs)")
        return cfg.num_gpus, cfg.num_gpus
    train = cfg.train_gpus if cfg.train_gpus is not None else max(1, cfg.num_gpus // 4)
    if not 1 <= train < cfg.num_gpus:
        raise ValueError(f"async mode needs 1 <= train_gpus < num_gpus, got train_gpus={train} of "
                         f"num_gpus={cfg.num_gpus}")
    return cfg.num_gpus - train, train


def _check_parallelism(model: ModelProfile, par: Parallelism) -> None:
    if model.heads % par.tp:
        raise ValueError(f"tp={par.tp} does not divide the {model.heads} attention heads of {model.name!r}")
    if par.ep > 1 and not model.is_moe:
        raise ValueError(f"ep={par.ep} needs an MoE model; {model.name!r} is dense")
    if model.is_moe and model.num_experts % par.ep:
        raise ValueError(f"ep={par.ep} does not divide the {model.num_experts} experts of {model.name!r}")


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


def _memory(cfg: SimConfig, model: ModelProfile, hw: HardwareProfile, settings: EngineSettings,
            target: ForwardModel, draft: ForwardModel | None, wl: Workload, train_gpus: int) -> dict:
    usable = hw.memory_bytes * settings.mem_util - settings.workspace_bytes
    w = target.weight_bytes_per_device()
    if draft is not None:
        dw = draft.weight_bytes_per_device()
        if cfg.draft_kind == "mtp":  # the MTP module shares the target's LM head
            dw -= draft.model.lm_head_params * draft.wbytes / draft.par.tp
        w += dw
    par = target.par
    if w > usable:
        raise LayoutError(
            f"{model.name} does not fit: {w / 1e9:.1f} GB of {target.dtype} weights per device with "
            f"tp={par.tp} ep={par.ep}, but one {hw.name} offers {usable / 1e9:.1f} GB "
            f"({hw.memory_bytes / 1e9:.0f} GB x mem_util {settings.mem_util} - "
            f"{settings.workspace_bytes / 1e9:.1f} GB workspace); raise --tp/--ep")
    kv_tok = target.kv_bytes_per_token_per_device()
    if draft is not None:
        kv_tok += draft.kv_bytes_per_token_per_device()
    group_tokens = (usable - w) / kv_tok  # tokens one attention group can cache
    need = wl.prompt_len + wl.max_response_len + cfg.num_draft_tokens + 1
    if group_tokens < need:
        raise LayoutError(
            f"{model.name} on {hw.name} with tp={par.tp} ep={par.ep}: the KV cache holds "
            f"{group_tokens:.0f} tokens per engine group but one sequence needs prompt_len + "
            f"max_response_len + k + 1 = {need}; raise --tp or shorten responses")
    mean_seq = wl.prompt_len + wl.mean_response_len()
    concurrency = int(min(settings.max_num_seqs * par.attn_groups,
                          math.floor(group_tokens / mean_seq) * par.attn_groups))
    train_need = TRAIN_BYTES_PER_PARAM * model.total_params / train_gpus
    if train_need > hw.memory_bytes:
        raise ValueError(
            f"training {model.name} needs at least {train_need / 1e9:.0f} GB per device "
            f"({TRAIN_BYTES_PER_PARAM} B/param of weights, grads and Adam states, fully sharded over "
            f"{train_gpus} training devices) but one {hw.name} has {hw.memory_bytes / 1e9:.0f} GB; "
            "use more GPUs")
    return {"weights_gb_per_device": w / 1e9, "kv_capacity_tokens": group_tokens * par.attn_groups,
            "concurrency": concurrency}


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
    _check_parallelism(model, par)
    target, draft = _forward_models(cfg, model, hw, eff, settings, par)
    return StepModel(target, draft, cfg.draft_kind, cfg.num_draft_tokens if k is None else k)


def simulate(cfg: SimConfig) -> SimResult:
    """Simulate one RL step with autoregressive and with speculative rollouts."""
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
    k = cfg.num_draft_tokens
    tau = acceptance.accept_length(k)
    eff = cfg.efficiency or efficiency_for(hw, cfg.calibration_path)
    settings = cfg.engine or default_engine_settings(hw)
    if cfg.tp is None or (cfg.ep is None and model.is_moe):
        raise ValueError(f"simulate() needs tp and ep (got tp={cfg.tp}, ep={cfg.ep}); "
                         "megatron_spec.sim.layout.simulate_layout searches them")
    par = Parallelism(cfg.tp, cfg.ep or 1)
    _check_parallelism(model, par)
    gen_gpus, train_gpus = _split_gpus(cfg, par.engine_devices)
    if gen_gpus % par.engine_devices and cfg.num_engines is None:
        raise ValueError(f"{gen_gpus} generation GPUs are not a multiple of the {par.engine_devices} "
                         f"devices per engine (max(tp={par.tp}, ep={par.ep})); pin --rollout-num-engines "
                         "to leave the rest idle")
    engines = gen_gpus // par.engine_devices
    if cfg.num_engines is not None:
        if not 1 <= cfg.num_engines <= engines:
            raise ValueError(f"num_engines={cfg.num_engines} engines of {par.engine_devices} devices need "
                             f"{cfg.num_engines * par.engine_devices} GPUs; {gen_gpus} generate "
                             f"(at most {engines} engines)")
        engines = cfg.num_engines
        gen_gpus = engines * par.engine_devices
    wl = cfg.workload

    target, draft = _forward_models(cfg, model, hw, eff, settings, par)
    mem = _memory(cfg, model, hw, settings, target, draft, wl, train_gpus)
    steps = StepModel(target, draft, cfg.draft_kind, k)

    per_engine = math.ceil(wl.rollouts / engines)
    concurrency = {"ar": mem["concurrency"], "spec": mem["concurrency"]}
    if settings.max_batched_tokens:
        for name, q in (("ar", 1), ("spec", k + 1)):
            concurrency[name] = max(
                1, min(concurrency[name], settings.max_batched_tokens * par.attn_groups // q)
            )
    if cfg.mode == "async" and cfg.policy_lag >= 2:
        gen = {}
        for name, fn, t in (("ar", steps.ar_step, 1.0), ("spec", steps.spec_step, tau)):
            gen[name] = simulate_streaming(per_engine * wl.mean_response_len(), wl.mean_response_len(),
                                           wl.mean_sq_response_len(), wl.prompt_len,
                                           min(concurrency[name], per_engine), t, fn)
    else:
        lengths = wl.engine_lengths(per_engine)
        gen = {"ar": simulate_engine(lengths, wl.prompt_len, concurrency["ar"], 1.0, steps.ar_step),
               "spec": simulate_engine(lengths, wl.prompt_len, concurrency["spec"], tau, steps.spec_step)}
    prefill = {"ar": steps.prefill(per_engine, wl.prompt_len, with_draft=False),
               "spec": steps.prefill(per_engine, wl.prompt_len, with_draft=True)}

    train = _train_side(
        model,
        None if draft is None else draft.model,
        hw,
        eff,
        wl,
        train_gpus,
        cfg.online_draft_training,
        cfg.draft_train_unroll,
    )
    sync_bytes = target.weight_bytes_per_device()
    if cfg.online_draft_training and draft is not None:
        sync_bytes += draft.weight_bytes_per_device()
    if cfg.mode == "sync":  # colocated: a device-local copy (read + write)
        prepare = 2.0 * sync_bytes / (hw.mem_bw * eff.mem_eff)
    else:  # disaggregated: each generation device receives its shard from the trainers
        within = cfg.num_gpus <= hw.scaleup_domain
        bw, lat = (hw.link_bw, hw.link_latency_s) if within else (hw.net_bw, hw.net_latency_s)
        prepare = sync_bytes / bw + lat

    stages = {}
    for name in ("ar", "spec"):
        g = prefill[name] + gen[name].decode_s
        st = {"data": eff.step_fixed_s, "prepare": prepare, "gen": g, "logprob": train["logprob"],
              "train": train["train"], "draft_train": train["draft_train"] if name == "spec" else 0.0}
        if cfg.mode == "sync":
            st["step"] = sum(st.values())
        else:
            train_side = st["logprob"] + st["train"] + st["draft_train"]
            gen_side = st["prepare"] + st["gen"]
            st["exposed_gen"] = max(0.0, gen_side - train_side)
            st["step"] = st["data"] + max(train_side, gen_side)
        stages[name] = st

    b_full = float(max(1, min(concurrency["spec"], per_engine)))
    ctx = wl.prompt_len + wl.mean_response_len() / 2.0
    step_costs = [step_cost_breakdown(steps, b, ctx, tau) for b in sorted({1.0, b_full})]
    detail = {
        "model": model.name,
        "hardware": hw.name,
        "num_gpus": cfg.num_gpus,
        "mode": cfg.mode,
        "policy_lag": cfg.policy_lag if cfg.mode == "async" else 0,
        "draft_kind": cfg.draft_kind,
        "num_draft_tokens": k,
        **acceptance.describe(k),
        "gen_ar": {**gen["ar"].as_dict(), "prefill_s": prefill["ar"], "concurrency": concurrency["ar"]},
        "gen_spec": {
            **gen["spec"].as_dict(),
            "prefill_s": prefill["spec"],
            "concurrency": concurrency["spec"],
        },
        "engine": {
            "tp": par.tp,
            "ep": par.ep,
            "devices_per_engine": par.engine_devices,
            "engines": engines,
            "gen_gpus": gen_gpus,
            "train_gpus": train_gpus,
            "rollouts_per_engine": per_engine,
            "rollout_dtype": target.dtype,
            **mem,
        },
        "workload": wl.describe(),
        "step_costs": step_costs,
        "model_params": model.summary(),
        "efficiency": eff.as_dict(),
        "measured_points": {
            name: (fm.measured.describe() if fm is not None and fm.measured is not None else None)
            for name, fm in (("verify", target), ("draft", draft))
        },
    }
    return SimResult(
        rollout_speedup=stages["ar"]["gen"] / stages["spec"]["gen"],
        e2e_speedup=stages["ar"]["step"] / stages["spec"]["step"],
        step_time_ar_s=stages["ar"]["step"], step_time_spec_s=stages["spec"]["step"],
        stages_ar=stages["ar"], stages_spec=stages["spec"], detail=detail)


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
