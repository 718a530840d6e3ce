"""Check the simulator against a benchmark of our own rollout engine (on this CPU).

The engine benchmark (``benchmarks/bench_rollout.py --steady-only``) runs autoregressive and
speculative decoding side by side and writes one JSON object (the committed record of this CPU:
``megatron_spec/sim/data/cpu_engine_bench.json``; a relative ``model`` path is resolved next to
the record):

    {
      "hardware": "cpu",                      # a simulator hardware name
      "model": "path/to/config.json",         # or a built-in model name
      "dtype": "bfloat16",                    # rollout dtype
      "draft_kind": "eagle3",                 # eagle3 | mtp | model | ngram
      "draft_model": null,                    # for draft_kind "model"
      "prompt_len": 64,                       # prompt tokens per sequence
      "max_new_tokens": 128,                  # generated tokens per sequence
      "results": [
        {"batch_size": 1,
         "ar_tokens_per_s": 71.3,             # generated tokens / s, autoregressive
         "spec": [
           {"k": 3,
            "accept_length": 2.71,            # generated tokens / verify steps
            "tokens_per_s": 152.0,            # generated tokens / s, speculative
            "v": 1.06,                        # t(verify forward, k+1 tokens/seq) / t(AR forward)
            "c": 0.07}                        # t(draft forward, 1 token/seq) / t(AR forward)
         ]}
      ]
    }

Every sequence of a batch decodes the same number of tokens (no long tail), so the simulator's
prediction is the steady-state step ratio at that batch and the mean context
prompt_len + max_new_tokens / 2:  speedup = tau * t_AR(b) / t_spec(b, k).

Two predictions per row, neither fitted to the speculative points:
* ``predicted_speedup_profile_only``: the measured CPU profile alone (kernel roofline plus the
  measured per-layer launch cost). An eager Python engine also pays a host cost per forward
  (scheduling, sampling, bookkeeping) that no kernel benchmark sees, so this one is optimistic
  about short forwards.
* ``predicted_speedup`` (the one checked against the tolerance): the same, with that per-forward
  host cost taken from the *autoregressive* measurement of the same batch size,
  ``h = b / ar_tokens_per_s - t_AR_model(b)`` (sampling, scheduling, bookkeeping: what an AR step
  spends beyond its modelled forward), and charged to every network call that ends in a
  sampling step: the verify forward and each of the k draft passes (each draft pass samples a
  token with the same code):  speedup = tau (t_AR + h) / (t_verify + t_draft + (1 + k) h).
Both use the measured accept length (acceptance is an input of the simulator, not a prediction);
v and c are reported beside the simulator's own v and c to show which term is off.

What it does not know: the engine itself; it reads what the benchmark wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_spec.sim.hardware import get_hardware
from megatron_spec.sim.models import draft_profile, get_model
from megatron_spec.sim.params import default_engine_settings, efficiency_for
from megatron_spec.sim.roofline import DRAFT_KINDS, ForwardModel, Parallelism, StepModel

REQUIRED = ("hardware", "model", "dtype", "draft_kind", "prompt_len", "max_new_tokens", "results")


def _load(bench: str | Path | dict) -> dict:
    if isinstance(bench, dict):
        return bench
    path = Path(bench)
    if not path.exists():
        raise ValueError(f"engine benchmark {path} does not exist")
    text = path.read_text().strip()
    try:
        data = json.loads(text)  # a JSON file
    except json.JSONDecodeError:
        try:
            data = json.loads(text.splitlines()[-1])  # a benchmark log: its last line
        except (json.JSONDecodeError, IndexError) as err:
            raise ValueError(f"engine benchmark {path}: last line is not a JSON object ({err})") from None
    model = data.get("model")
    if isinstance(model, str) and model.endswith(".json") and not Path(model).is_absolute():
        data["model"] = str(path.parent / model)  # a config file next to the record
    return data


def validate_engine_benchmark(bench: str | Path | dict, tolerance: float = 0.2,
                              calibration_path: str | Path | None = None) -> dict:
    """Predicted vs measured speculative speedup for every (batch size, k) of a benchmark."""
    data = _load(bench)
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ValueError(f"engine benchmark lacks {missing}; see megatron_spec/sim/engine_bench.py")
    if data["draft_kind"] not in DRAFT_KINDS:
        raise ValueError(f"engine benchmark draft_kind {data['draft_kind']!r} not in {DRAFT_KINDS}")
    hw = get_hardware(data["hardware"])
    model = get_model(data["model"])
    eff = efficiency_for(hw, calibration_path)
    settings = default_engine_settings(hw)
    par = Parallelism(1, 1)
    target = ForwardModel(model, hw, eff, settings, par, data["dtype"])
    dprof = draft_profile(data["draft_kind"], model, data.get("draft_model"))
    draft = ForwardModel(dprof, hw, eff, settings, par, data["dtype"]) if dprof is not None else None
    ctx_per_seq = float(data["prompt_len"]) + float(data["max_new_tokens"]) / 2.0
    rows = []
    for res in data["results"]:
        b = float(res["batch_size"])
        ar_tps = float(res["ar_tokens_per_s"])
        if ar_tps <= 0:
            raise ValueError(f"engine benchmark: ar_tokens_per_s={ar_tps} at batch {int(b)} must be > 0")
        ctx = np.array([b * ctx_per_seq])
        bb = np.array([b])
        t_ar_model = float(target.forward(bb, 1, ctx, eff.step_overhead_s)["total"][0])
        host = max(0.0, b / ar_tps - t_ar_model)  # per-forward host cost seen only by the engine
        for sp in res.get("spec", []):
            k, tau = int(sp["k"]), float(sp["accept_length"])
            if not 1.0 <= tau <= k + 1:
                raise ValueError(f"engine benchmark: accept_length {tau} impossible for k={k}")
            steps = StepModel(target, draft, data["draft_kind"], k)
            t_spec_model = float(steps.spec_step(bb, ctx)["total"][0])
            t_verify = float(target.forward(bb, k + 1, ctx, eff.step_overhead_s)["total"][0])
            t_draft1 = (float(draft.forward(bb, 1, ctx, eff.draft_pass_overhead_s)["total"][0])
                        if draft is not None else 0.0)
            passes = k if draft is not None else 0  # draft forwards per step: a first pass, then k-1
            predicted = tau * (t_ar_model + host) / (t_spec_model + host * (1 + passes))
            measured = float(sp["tokens_per_s"]) / ar_tps
            rows.append({
                "batch_size": int(b), "k": k, "accept_length": tau,
                "measured_speedup": measured, "predicted_speedup": predicted,
                "predicted_speedup_profile_only": tau * t_ar_model / t_spec_model,
                "rel_error": predicted / measured - 1.0,
                "v_measured": sp.get("v"), "v_predicted": t_verify / t_ar_model,
                "c_measured": sp.get("c"), "c_predicted": t_draft1 / t_ar_model,
                "ar_tokens_per_s_measured": ar_tps, "ar_tokens_per_s_profile_only": b / t_ar_model,
                "host_s_per_forward_from_ar": host,
            })
    within = [r for r in rows if abs(r["rel_error"]) <= tolerance]
    return {"hardware": hw.name, "model": model.name, "tolerance": tolerance, "rows": rows,
            "within_tolerance": len(within), "k_values_within": sorted({r["k"] for r in within}),
            "max_abs_rel_error": max((abs(r["rel_error"]) for r in rows), default=None)}
