"""``megatron-spec simulate``: project speculative-decoding gains for RL at cluster scale.

Prints one JSON object (docs/design.md, "megatron-spec simulate"): ``rollout_speedup``, ``e2e_speedup``,
``step_time_ar_s``, ``step_time_spec_s``, per-stage times for both, the engine layout, the
best k for the given acceptance, and where the fitted parameters came from. ``--sweep``
prints a table of speedup vs k and acceptance, writes a PNG (``--output``) and ends with one
JSON line. ``--validate-engine-bench FILE`` compares the simulator with a run of our own
engine benchmark (see megatron_spec/sim/engine_bench.py). Impossible configurations exit
with status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "project speculative-decoding speedups of an RL step (roofline performance model)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_spec.sim.hardware import HARDWARE_NAMES
    from megatron_spec.sim.models import MODEL_NAMES
    from megatron_spec.sim.roofline import DRAFT_KINDS
    from megatron_spec.sim.workload import PRESETS

    p = parser
    # --model, --hardware, --num-gpus, -k and the acceptance are required unless
    # --validate-engine-bench is given (checked in run()).
    p.add_argument("--model", help=f"NAME ({', '.join(MODEL_NAMES)}) or an HF config.json")
    p.add_argument("--hardware", type=str.lower, choices=HARDWARE_NAMES)
    p.add_argument("--num-gpus", type=int, help="GPUs (devices) in the job")
    p.add_argument("--mode", default="sync", choices=("sync", "async"))
    p.add_argument("--policy-lag", type=int, default=1, help="async: max policy versions a rollout lags")
    p.add_argument("--draft-kind", default="eagle3", choices=DRAFT_KINDS)
    p.add_argument("--num-draft-tokens", "-k", type=int, help="draft tokens per verify step")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--accept-length", type=float, help="mean tokens per verify step at this k")
    acc.add_argument("--accept-rates", type=_rates, help="marginal per-position accept rates A1,A2,...")
    p.add_argument("--tp", "--rollout-tensor-parallel-size", dest="tp", type=int, default=None,
                   help="tensor parallel size T of a rollout engine (default: searched, docs/simulator.md)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert parallel size of a rollout engine (MoE; default: searched; dense: 1)")
    p.add_argument("--rollout-num-engines", dest="num_engines", type=int, default=None,
                   help="rollout engines N (default: as many as the generation GPUs hold)")
    p.add_argument("--sweep", action="store_true", help="sweep k and acceptance: table + PNG")
    p.add_argument("--output", default="simulate_sweep.png", help="PNG path for --sweep")
    p.add_argument("--sweep-models", type=lambda s: [m for m in s.split(",") if m],
                   help="comma-separated models for --sweep (default: --model)")
    p.add_argument("--sweep-hardware", type=lambda s: [h.lower() for h in s.split(",") if h],
                   help="comma-separated hardware for --sweep (default: --hardware)")
    g = p.add_argument_group("workload (defaults: the preset)")
    g.add_argument("--workload", default="rl-zero", choices=tuple(PRESETS))
    g.add_argument("--prompts-per-step", type=int)
    g.add_argument("--samples-per-prompt", type=int)
    g.add_argument("--prompt-len", type=int)
    g.add_argument("--response-len", type=float, help="median response length (tokens)")
    g.add_argument("--response-sigma", type=float, help="log-normal sigma of response lengths")
    g.add_argument("--max-response-len", type=int)
    e = p.add_argument_group("engine and trainer")
    e.add_argument("--rollout-dtype", default="bf16", choices=("bf16", "fp8", "fp32"))
    e.add_argument("--train-gpus", type=int, help="async: GPUs that train (default num_gpus // 4)")
    e.add_argument("--draft-model", help="draft model NAME|config.json for --draft-kind model")
    e.add_argument("--online-draft-training", action="store_true", help="train the draft every step")
    e.add_argument("--train-mfu", type=float, help="override the fitted training MFU")
    e.add_argument("--max-num-seqs", type=int, help="engine max running sequences")
    e.add_argument("--mem-util", type=float, help="fraction of device memory the engine uses")
    e.add_argument("--fused-verify-max-q", type=int,
                   help="most tokens per sequence the engine verifies in one pass over the KV cache "
                        "(GPU default 4, as calibrated; 0: any k in one pass)")
    e.add_argument("--params", help="calibration JSON (default: megatron_spec/sim/data/calibration.json)")
    e.add_argument(
        "--measured",
        default=None,
        help="measured forward times of a GPU run (benchmarks/measure_forward_costs.py; default: "
        "megatron_spec/sim/data/measured_forwards.json when it exists); 'none': the roofline alone",
    )
    e.add_argument("--k-max", type=int, default=10, help="largest k searched for the optimal k")
    p.add_argument("--validate-engine-bench", metavar="FILE",
                   help="compare with an engine benchmark JSON instead of simulating a step")


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--accept-rates wants comma-separated numbers, got {text!r}"
        ) from None


def build_config(args: argparse.Namespace):
    from megatron_spec.sim.hardware import get_hardware
    from megatron_spec.sim.params import default_engine_settings, efficiency_for
    from megatron_spec.sim.rl_step import SimConfig
    from megatron_spec.sim.workload import PRESETS

    wl = PRESETS[args.workload]
    overrides = {"prompts_per_step": args.prompts_per_step, "samples_per_prompt": args.samples_per_prompt,
                 "prompt_len": args.prompt_len, "response_median": args.response_len,
                 "response_sigma": args.response_sigma, "max_response_len": args.max_response_len}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        wl = wl.replace(name=f"{wl.name}+overrides", **overrides)
    hw = get_hardware(args.hardware)
    eff = efficiency_for(hw, args.params)
    if args.train_mfu is not None:
        eff = eff.replace(train_mfu=args.train_mfu)
    engine = default_engine_settings(hw)
    if args.max_num_seqs is not None:
        engine = engine.replace(max_num_seqs=args.max_num_seqs)
    if args.mem_util is not None:
        engine = engine.replace(mem_util=args.mem_util)
    if args.fused_verify_max_q is not None:
        engine = engine.replace(fused_verify_max_q=args.fused_verify_max_q)
    return SimConfig(
        model=args.model,
        hardware=hw,
        num_gpus=args.num_gpus,
        mode=args.mode,
        policy_lag=args.policy_lag,
        draft_kind=args.draft_kind,
        num_draft_tokens=args.num_draft_tokens,
        accept_length=args.accept_length,
        accept_rates=args.accept_rates,
        tp=args.tp,
        ep=args.ep,
        num_engines=args.num_engines,
        workload=wl,
        rollout_dtype=args.rollout_dtype,
        train_gpus=args.train_gpus,
        draft_model=args.draft_model,
        online_draft_training=args.online_draft_training,
        efficiency=eff,
        engine=engine,
        calibration_path=args.params,
        measured_path=False if args.measured == "none" else args.measured,
    )


def _calibration_summary(hardware_kind: str, path) -> dict:
    from megatron_spec.sim.params import CALIBRATION_PATH, load_calibration

    if hardware_kind == "cpu":
        return {"source": "measured cpu profile (megatron_spec/sim/data/cpu_profile.json)"}
    cal = load_calibration(path or CALIBRATION_PATH)
    source = str(path) if path else "megatron_spec/sim/data/calibration.json"
    return {"source": source, "generated_at": cal.get("generated_at"),
            "fit_max_abs_rel_error": cal["fit"]["max_abs_rel_error"]}


def _other_mode(cfg):
    """The same job in the other mode: async with the user's lag and training split (default a
    quarter of the GPUs train), or sync on all GPUs."""
    if cfg.mode == "sync":
        return cfg.replace(mode="async", policy_lag=max(1, cfg.policy_lag), train_gpus=None)
    return cfg.replace(mode="sync", train_gpus=None)


def _projection(cfg, result) -> dict:
    eng = result.detail["engine"]
    eng_ar = result.detail.get("engine_ar", eng)
    out = {"mode": cfg.mode, "policy_lag": result.detail["policy_lag"],
           "gen_gpus": eng["gen_gpus"], "train_gpus": eng["train_gpus"],
           "layout_ar": {k: eng_ar[k] for k in ("engines", "devices_per_engine", "tp", "ep")},
           "layout_spec": {k: eng[k] for k in ("engines", "devices_per_engine", "tp", "ep")},
           "rollout_speedup": result.rollout_speedup, "e2e_speedup": result.e2e_speedup,
           "step_time_ar_s": result.step_time_ar_s, "step_time_spec_s": result.step_time_spec_s}
    if cfg.mode == "async":
        out["exposed_gen_ar_s"] = result.stages_ar["exposed_gen"]
        out["exposed_gen_spec_s"] = result.stages_spec["exposed_gen"]
    return out


def run(args: argparse.Namespace) -> int:
    from megatron_spec.sim.layout import simulate_layout
    from megatron_spec.sim.rl_step import optimal_k

    try:
        if args.validate_engine_bench:
            from megatron_spec.sim.engine_bench import validate_engine_benchmark

            print(
                json.dumps(
                    validate_engine_benchmark(args.validate_engine_bench, calibration_path=args.params)
                )
            )
            return 0
        missing = [flag for flag, value in (("--model", args.model), ("--hardware", args.hardware),
                                            ("--num-gpus", args.num_gpus),
                                            ("--num-draft-tokens", args.num_draft_tokens)) if value is None]
        if args.accept_length is None and args.accept_rates is None:
            missing.append("--accept-length or --accept-rates")
        if missing:
            raise ValueError(f"the following arguments are required: {', '.join(missing)}")
        cfg = build_config(args)
        if args.sweep:
            from megatron_spec.sim import sweep as sw

            rows = sw.sweep(cfg, models=args.sweep_models, k_values=range(1, args.k_max + 1),
                            hardware=args.sweep_hardware)
            print(sw.format_table(rows))
            batch_rows, edges = [], {}
            for hw_name in args.sweep_hardware or [cfg.hardware]:
                for model in args.sweep_models or [cfg.model]:
                    per = cfg if hw_name is cfg.hardware else cfg.replace(
                        hardware=hw_name, efficiency=None, engine=None)
                    block = sw.batch_sweep(
                        per.replace(model=model), k_values=range(1, min(args.k_max, 5) + 1)
                    )
                    print(sw.format_batch_table(block))
                    edges[f"{block[0]['model']}@{block[0]['hardware']}"] = sw.break_even(block)
                    batch_rows += block
            title = f"{cfg.num_gpus} devices, {cfg.mode}, {cfg.draft_kind}, workload {cfg.workload.name}"
            png = sw.plot(rows, args.output, title=title, batch_rows=batch_rows)
            best = {f"{r['model']}@{r['hardware']}/{r['profile']}": r["k"] for r in rows if r["optimal"]}
            print(json.dumps({"sweep_png": str(png), "optimal_k": best, "rows": len(rows),
                              "stops_paying_at_batch": edges}))
            return 0
        result, search = simulate_layout(cfg)
        if search is not None:
            print(f"megatron-spec simulate: {cfg.mode}: {search.describe()}", file=sys.stderr)
        eng = result.detail["engine"]
        pinned = cfg.replace(tp=eng["tp"], ep=eng["ep"])
        best_k, by_k = optimal_k(pinned, k_max=args.k_max)
        out = result.as_dict()
        out["optimal_k"] = best_k
        out["speedup_by_k"] = by_k
        out["projections"] = {cfg.mode: _projection(cfg, result)}
        other = _other_mode(cfg)
        try:
            res_other, search_other = simulate_layout(other)
            out["projections"][other.mode] = _projection(other, res_other)
            if search_other is not None:
                print(f"megatron-spec simulate: {other.mode}: {search_other.describe()}", file=sys.stderr)
        except ValueError as err:  # the other mode is extra information: say why it is missing
            out["projections"][other.mode] = {"error": str(err)}
        out["calibration"] = _calibration_summary(cfg.hardware.kind, args.params)
        out["calibration"]["measured_points"] = out.get("measured_points")
        print(json.dumps(out))
        return 0
    except ValueError as err:
        print(f"megatron-spec simulate: error: {err}", file=sys.stderr)
        return 2
