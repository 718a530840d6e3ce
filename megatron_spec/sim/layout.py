"""Rollout layout search: how many engines, of how many GPUs each (TP x EP), for a model and cluster.

With ``--tp`` / ``--ep`` left out, :func:`search_layouts` enumerates the engine shapes a
practitioner would consider on the generation GPUs (TP and EP powers of two; TP dividing the
attention heads and at most ``MAX_TP``; EP dividing the routed experts; the smaller of the two
dividing the larger, as in :class:`~megatron_spec.sim.roofline.Parallelism`), simulates each
that fits, and picks:

- **dense models**: the smallest engine whose KV cache holds the workload's concurrency
  (the rollouts one engine gets, capped by ``max_num_seqs``, at the mean sequence length)
  with ``HEADROOM``, then as many engines as the generation GPUs hold (what SGLang and vLLM
  users do: TP only as far as memory needs it, data-parallel engines beyond). If no engine
  has that headroom, the fitting engine with the largest KV cache.
- **MoE models**: the EP/TP combination with the shortest simulated generation, separately
  for autoregressive and for speculative rollouts (the best layout can differ: verification
  touches more experts per step, so EP pays differently).

Either way the autoregressive and the speculative throughput optimum over all fitting layouts
are reported next to the choice, with every candidate's generation times, so a user can read
off what N (``--rollout-num-engines``) and T (``--rollout-tensor-parallel-size``) to use.
``--tp``, ``--ep`` and ``--rollout-num-engines`` pin the search.

What it does not know: pipeline parallelism, attention data-parallelism beyond
``max(tp, ep) / tp`` groups, heterogeneous engines, and placement (it assumes an engine of up
to ``scaleup_domain`` GPUs stays inside one NVLink domain; larger ones pay scale-out links).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_spec.sim.capacity import LayoutError, split_gpus
from megatron_spec.sim.hardware import HardwareProfile, get_hardware
from megatron_spec.sim.models import ModelProfile, get_model
from megatron_spec.sim.params import default_engine_settings
from megatron_spec.sim.rl_step import SimConfig, SimResult, simulate

#: KV-cache headroom the dense rule asks for over the workload's concurrency (a practitioner
#: leaves room for length spread and for the speculative draft's own cache).
HEADROOM = 1.25
#: largest TP an engine is given (beyond one NVLink board, TP all-reduces dominate decode).
MAX_TP = 16
MAX_EP = 256


@dataclass
class Candidate:
    """One engine shape on the generation GPUs, simulated (or why it could not be)."""

    tp: int
    ep: int
    engines: int
    fits: bool
    reason: str = ""
    kv_capacity_tokens: float = 0.0
    kv_needed_tokens: float = 0.0
    gen_ar_s: float | None = None
    gen_spec_s: float | None = None
    result: SimResult | None = field(default=None, repr=False)

    @property
    def devices(self) -> int:
        return max(self.tp, self.ep)

    @property
    def headroom_ok(self) -> bool:
        return self.fits and self.kv_capacity_tokens >= HEADROOM * self.kv_needed_tokens

    def as_dict(self) -> dict:
        out = {"tp": self.tp, "ep": self.ep, "devices_per_engine": self.devices, "engines": self.engines,
               "fits": self.fits}
        if not self.fits:
            out["reason"] = self.reason
            return out
        out.update(
            kv_capacity_tokens=round(self.kv_capacity_tokens),
            kv_needed_tokens=round(self.kv_needed_tokens),
            headroom_ok=self.headroom_ok,
            gen_ar_s=round(self.gen_ar_s, 3),
            gen_spec_s=round(self.gen_spec_s, 3),
            rollout_speedup=round(self.gen_ar_s / self.gen_spec_s, 4),
        )
        return out


@dataclass
class LayoutSearch:
    """Outcome of :func:`search_layouts`."""

    rule: str
    ar: Candidate  # layout used for the autoregressive projection
    spec: Candidate  # layout used for the speculative projection
    ar_optimum: Candidate
    spec_optimum: Candidate
    candidates: list[Candidate]

    def as_dict(self) -> dict:
        def brief(c: Candidate) -> dict:
            return {"tp": c.tp, "ep": c.ep, "devices_per_engine": c.devices, "engines": c.engines,
                    "gen_ar_s": round(c.gen_ar_s, 3), "gen_spec_s": round(c.gen_spec_s, 3)}

        return {"rule": self.rule, "ar": brief(self.ar), "spec": brief(self.spec),
                "ar_optimum": brief(self.ar_optimum), "spec_optimum": brief(self.spec_optimum),
                "candidates": [c.as_dict() for c in self.candidates]}

    def describe(self) -> str:
        def one(c: Candidate) -> str:
            ep = f" ep={c.ep}" if c.ep > 1 else ""
            return f"{c.engines} engines x {c.devices} GPUs (tp={c.tp}{ep})"

        same = (self.ar.tp, self.ar.ep, self.ar.engines) == (self.spec.tp, self.spec.ep, self.spec.engines)
        text = f"layout ({self.rule}): " + (one(self.spec) if same else
                                              f"AR {one(self.ar)}; speculative {one(self.spec)}")
        if (self.ar_optimum is not self.ar) or (self.spec_optimum is not self.spec):
            text += (f"; throughput optima: AR {one(self.ar_optimum)}, "
                     f"speculative {one(self.spec_optimum)}")
        return text


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def candidate_shapes(model: ModelProfile, gen_gpus: int, tp: int | None = None, ep: int | None = None,
                     num_engines: int | None = None) -> list[tuple[int, int]]:
    """(tp, ep) pairs worth simulating on ``gen_gpus`` generation GPUs (pins respected)."""
    tps = (
        [tp] if tp is not None else [t for t in _powers_of_two(min(MAX_TP, gen_gpus)) if model.heads % t == 0]
    )
    if model.is_moe:
        eps = [ep] if ep is not None else [e for e in _powers_of_two(min(MAX_EP, gen_gpus))
                                           if model.num_experts % e == 0]
    else:
        if ep not in (None, 1):
            raise ValueError(f"ep={ep} needs an MoE model; {model.name!r} is dense")
        eps = [1]
    shapes = []
    for t in tps:
        for e in eps:
            big, small = max(t, e), min(t, e)
            if big % small:
                continue
            if num_engines is not None:
                if num_engines * big > gen_gpus:
                    continue
            elif gen_gpus % big:
                continue
            shapes.append((t, e))
    return shapes


def _kv_needed(result: SimResult, max_num_seqs: int) -> float:
    eng, wl = result.detail["engine"], result.detail["workload"]
    groups = eng["devices_per_engine"] // eng["tp"]
    running = min(eng["rollouts_per_engine"], max_num_seqs * groups)
    return running * (wl["prompt_len"] + wl["mean_response_len"])


def search_layouts(cfg: SimConfig) -> LayoutSearch:
    """Simulate every candidate engine shape for ``cfg`` (its ``tp``/``ep`` of None: free; an
    int: pinned) and choose as the module docstring says. ValueError if none fits."""
    model = cfg.model if isinstance(cfg.model, ModelProfile) else get_model(cfg.model)
    hw = cfg.hardware if isinstance(cfg.hardware, HardwareProfile) else get_hardware(cfg.hardware)
    settings = cfg.engine or default_engine_settings(hw)
    gen_gpus, _ = split_gpus(cfg, 1)
    shapes = candidate_shapes(model, gen_gpus, cfg.tp, cfg.ep, cfg.num_engines)
    if not shapes:
        raise ValueError(f"no engine shape tp x ep fits {gen_gpus} generation GPUs for {model.name!r} "
                         f"(tp={cfg.tp}, ep={cfg.ep}, num_engines={cfg.num_engines})")
    cands: list[Candidate] = []
    for t, e in shapes:
        engines = cfg.num_engines or gen_gpus // max(t, e)
        try:
            res = simulate(cfg.replace(model=model, hardware=hw, tp=t, ep=e))
        except LayoutError as err:
            cands.append(Candidate(t, e, engines, fits=False, reason=str(err)))
            continue
        eng = res.detail["engine"]
        cands.append(Candidate(t, e, eng["engines"], fits=True, kv_capacity_tokens=eng["kv_capacity_tokens"],
                               kv_needed_tokens=_kv_needed(res, settings.max_num_seqs),
                               gen_ar_s=res.stages_ar["gen"], gen_spec_s=res.stages_spec["gen"], result=res))
    fit = [c for c in cands if c.fits]
    if not fit:
        smallest = min(cands, key=lambda c: (c.devices, c.tp))
        largest = max(cands, key=lambda c: (c.devices, c.tp))
        raise ValueError(
            f"no rollout engine layout fits {model.name!r} on {gen_gpus} {hw.name} generation GPUs: "
            f"the largest tried ({largest.tp=}, {largest.ep=}): {largest.reason}; "
            f"the smallest: {smallest.reason}"
        )
    ar_opt = min(fit, key=lambda c: (c.gen_ar_s, c.devices))
    spec_opt = min(fit, key=lambda c: (c.gen_spec_s, c.devices))
    if model.is_moe:
        return LayoutSearch(
            "MoE: best simulated rollout throughput per mode", ar_opt, spec_opt, ar_opt, spec_opt, cands
        )
    roomy = [c for c in fit if c.headroom_ok]
    if roomy:
        chosen = min(roomy, key=lambda c: (c.devices, c.tp))
        rule = f"dense: smallest engine whose KV cache holds the concurrency x {HEADROOM}"
    else:
        chosen = max(fit, key=lambda c: (c.kv_capacity_tokens / max(c.kv_needed_tokens, 1.0), -c.devices))
        rule = f"dense: no engine holds the concurrency x {HEADROOM}; the one with the most KV room"
    return LayoutSearch(rule, chosen, chosen, ar_opt, spec_opt, cands)


def simulate_layout(cfg: SimConfig) -> tuple[SimResult, LayoutSearch | None]:
    """``simulate(cfg)`` when both ``tp`` and ``ep`` are given (the layout is pinned; ``ep`` may
    be omitted for a dense model); otherwise search the layout and combine the autoregressive
    side simulated on the AR layout with the speculative side on the speculative layout (the same
    layout for dense models). Speedups compare the two sides as a practitioner would run them."""
    model = cfg.model if isinstance(cfg.model, ModelProfile) else get_model(cfg.model)
    if cfg.tp is not None and (cfg.ep is not None or not model.is_moe):
        return simulate(cfg.replace(ep=cfg.ep or 1)), None
    search = search_layouts(cfg)
    ar, spec = search.ar.result, search.spec.result
    detail = dict(spec.detail)
    detail["engine_ar"] = ar.detail["engine"]
    detail["gen_ar"] = ar.detail["gen_ar"]
    detail["layout"] = search.as_dict()
    combined = SimResult(
        rollout_speedup=ar.stages_ar["gen"] / spec.stages_spec["gen"],
        e2e_speedup=ar.stages_ar["step"] / spec.stages_spec["step"],
        step_time_ar_s=ar.stages_ar["step"], step_time_spec_s=spec.stages_spec["step"],
        stages_ar=ar.stages_ar, stages_spec=spec.stages_spec, detail=detail)
    return combined, search


def pin_layout(cfg: SimConfig) -> SimConfig:
    """``cfg`` with ``tp`` and ``ep`` set: as given, or the speculative layout the search picks."""
    model = cfg.model if isinstance(cfg.model, ModelProfile) else get_model(cfg.model)
    if cfg.tp is not None and (cfg.ep is not None or not model.is_moe):
        return cfg.replace(ep=cfg.ep or 1)
    search = search_layouts(cfg)
    return cfg.replace(tp=search.spec.tp, ep=search.spec.ep)
