"""The same short GRPO run with and without speculative rollouts, side by side.

    python benchmarks/bench_grpo.py [--base DIR --draft DIR] [--steps 12] [--nproc 1]
    python benchmarks/bench_grpo.py --model smollm2 [--draft DIR] [--steps 4] [--rounds 1]

Runs ``launch/pretrain_grpo_spec.py`` from the same base policy, seed and prompts: with the
EAGLE-3 draft (k=3), with ``--spec-draft-kind none``, and (unless ``--no-adaptive``) with the
EAGLE-3 draft at adaptive k plus the history drafter (``--spec-num-draft-tokens auto
--spec-history``). Reports, from the metrics files:

* ``gen_speedup`` = mean AR generation time / mean speculative generation time (k=3);
  ``gen_speedup_adaptive_history`` the same for the adaptive + history run, with its
  ``_median`` forms: the median over steps of a step's generation tokens/s over the AR run's at the same
  step (same prompts; the runs go one after the other, so one stalled step of one run moves the means by
  its whole stall and the median by nothing; the per-step ratios in ``gen_step_ratios*``), and
  ``step_speedup_adaptive_history``, ``accept_length_adaptive_history``, ``k_mean_adaptive_history``
  ``history_frac`` (share of request-steps drafted from finished responses) and ``live_frac`` (from
  the live group index: the running siblings' text);
* ``step_speedup`` = mean AR step time / mean speculative step time;
* ``gen_fraction_ar`` = generation's share of the AR step, and the Amdahl bound
  1 / ((1 - f) + f / gen_speedup) that ``step_speedup`` is compared with;
* ``accept_length`` and the reward at the start and end of each run (mean over the first and
  last fifth of the steps: one step's reward depends on which prompts it drew);
* the decode regime of the policy at the rollout batch: ``v_k3`` = target forward over 4
  tokens per sequence / one-token forward, ``c`` = one draft forward / one-token forward, both
  at the configured rollout batch (benchmarks/bench_rollout.py's measurement), and the
  ceiling ``accept_length / (v_k3 + 3 c)`` that speculation cannot beat on this machine.

``--model smollm2`` (or a Hub id; issue 28) runs the real model instead of the demo's small policy:
SmolLM2-135M-Instruct as ``megatron-spec fetch-model`` makes it, on mathematics_dataset's
``algebra__linear_1d`` (chat template, math-verify reward, up to 64 new tokens: 4 prompts x 8
samples a step, ``launch/configs/smollm2_algebra.yaml``), with the EAGLE-3 draft of
``bench_rollout.py --model`` (``--draft``, or trained here once: benchmarks/_real_model.py).

``--rollout-backend vllm`` runs the same GRPO with both rollout backends side by side instead: the native
engine and vLLM's CPU build (``.venv-vllm``, docs/vllm_backend.md), each with the EAGLE-3 draft (k=3) and
without, all greedy (``--rollout-temperature 0``: vLLM's CPU build refuses sampled speculation, vllm#55005,
and greedy groups carry no advantage, so this measures the rollout machinery, not learning). Its JSON line:
per backend and run ``{backend}_{spec|ar}_gen_s`` / ``_prepare_s`` / ``_step_s`` / ``_accept_length``, and
``vllm_over_native_{gen|prepare|step}_{spec|ar}`` (vLLM's time over ours: above 1, ours is faster).

``--rounds R`` runs them all R times, every other round in the reverse order (the machine's drift over
the minutes a round takes falls on each run in turn): each number is then the median over the rounds of
that round's value, the speed-ups also listed round by round (``{key}_rounds``), each list given once per
round, and ``rounds`` says how many. The report is the last round's.

The first step of each run is excluded from the timings (engine warm-up). The base policy
and draft are made with launch/sft_base.py and launch/make_draft.py when not given (or
reused from the demo's run directory). The decode regime: see docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _grpo_runs import DEMO_CONFIG, add_run_args, ensure_models, grpo_cmd, mean, run_grpo


def step_paired(suffix: str, runs: list[dict], ar: list[dict]) -> dict:
    """``gen_speedup{suffix}_median`` and ``gen_step_ratios{suffix}``: each step's generation tokens/s over
    the AR run's at the same step (the module docstring), their median; {} where a run lacks the metric."""
    ratios = [r["gen/tokens_per_s"] / a["gen/tokens_per_s"] for r, a in zip(runs, ar)
              if r.get("gen/tokens_per_s") and a.get("gen/tokens_per_s")]
    if not ratios:
        return {}
    return {f"gen_speedup{suffix}_median": round(statistics.median(ratios), 3),
            f"gen_step_ratios{suffix}": [round(x, 3) for x in ratios]}


def decode_regime(base: str, draft: str, batch: int, dtype: str, k: int = 3) -> dict[str, float]:
    """v and c of the policy + draft in the native engine, at ``batch`` sequences, in the engine dtype
    the GRPO runs used (``dtype`` already resolved for this CPU)."""
    from bench_rollout import forward_costs
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer

    srv = EngineServer(
        EngineConfig(
            model_path=base,
            draft_kind="eagle3",
            draft_path=draft,
            num_draft_tokens=k,
            dtype=dtype,
            max_batch_size=batch,
            context_length=160,
            num_threads=2,
        )
    )
    v, c, _ = forward_costs(srv, batch, k)
    return {"v_k3": v, "c": c}


def print_runs(runs: dict[str, list[dict]]) -> None:
    """One round's runs as a table: generation and step seconds (first step excluded), accept length and
    reward."""
    from megatron_spec.telemetry import start_end_means

    print(f"{'':<22}{'gen s':>8}{'step s':>8}{'accept':>8}{'reward start->end':>20}")
    for name, rows in runs.items():
        print(f"{name:<22}{mean([r['time/gen'] for r in rows[1:]]):>8.2f}"
              f"{mean([r['time/step'] for r in rows[1:]]):>8.2f}"
              f"{mean([r['spec/accept_length'] for r in rows]):>8.2f}"
              "{:>10.3f} -> {:.3f}".format(*start_end_means(rows, "reward/mean")[:2]))


def round_summary(runs: dict[str, list[dict]], regime: dict[str, float], engines: int | None,
                  nproc: int) -> dict:
    """The keys of one round's runs (the module docstring); the first step of each run excluded."""
    from megatron_spec.telemetry import start_end_means

    spec, ar = runs["spec"][1:], runs["ar"][1:]
    gen_s, gen_a = mean([r["time/gen"] for r in spec]), mean([r["time/gen"] for r in ar])
    step_s, step_a = mean([r["time/step"] for r in spec]), mean([r["time/step"] for r in ar])
    f = gen_a / step_a
    gen_speedup = gen_a / gen_s
    amdahl = 1.0 / ((1.0 - f) + f / gen_speedup)
    step_speedup = step_a / step_s
    accept = mean([r["spec/accept_length"] for r in runs["spec"]])
    reward = {name: start_end_means(rows, "reward/mean")[:2] for name, rows in runs.items()}
    summary = {
        "gen_speedup": round(gen_speedup, 3),
        "step_speedup": round(step_speedup, 3),
        "gen_fraction_ar": round(f, 3),
        "amdahl_step_speedup": round(amdahl, 3),
        "step_speedup_over_amdahl": round(step_speedup / amdahl, 3),
        "accept_length": round(accept, 3),
        "reward_start": round(reward["spec"][0], 3),
        "reward_end": round(reward["spec"][1], 3),
        "reward_start_ar": round(reward["ar"][0], 3),
        "reward_end_ar": round(reward["ar"][1], 3),
        "ceiling_k3": round(accept / (regime["v_k3"] + 3 * regime["c"]), 3),
    }
    summary.update(step_paired("", spec, ar))
    if "spec_adaptive_history" in runs:
        ah = runs["spec_adaptive_history"][1:]
        summary.update(step_paired("_adaptive_history", ah, ar))
        summary.update({
            "gen_speedup_adaptive_history": round(gen_a / mean([r["time/gen"] for r in ah]), 3),
            "step_speedup_adaptive_history": round(step_a / mean([r["time/step"] for r in ah]), 3),
            "accept_length_adaptive_history": round(mean([r["spec/accept_length"] for r in ah]), 3),
            "k_mean_adaptive_history": round(mean([r["spec/k_mean"] for r in ah
                                                   if r.get("spec/k_mean") is not None]), 3),
            "history_frac": round(mean([r.get("spec/history_frac", 0.0) for r in ah]), 3),
            "live_frac": round(mean([r.get("spec/live_frac", 0.0) for r in ah]), 3),
        })
    if "spec_engines1" in runs:  # the same ranks, N engines against one (on 2 CPU cores: the mechanism)
        one = runs["spec_engines1"][1:]
        summary.update({
            "rollout_num_engines": engines, "nproc": nproc,
            "gen_s_per_step_engines": round(gen_s, 3),
            "gen_s_per_step_engines1": round(mean([r["time/gen"] for r in one]), 3),
            "engines_gen_speedup": round(mean([r["time/gen"] for r in one]) / gen_s, 3),
            "engines_imbalance": round(mean([r["rollout/imbalance"] for r in spec]), 3),
            "engine_samples_per_step": [round(mean([r[f"rollout/engine{e}/samples"] for r in spec]), 2)
                                        for e in range(engines)],
        })
    return summary


def over_rounds(summaries: list[dict]) -> dict:
    """One round's keys as they are; over several, each number the median over rounds (the speed-ups also
    listed per round, ``{key}_rounds``), each list one per round."""
    if len(summaries) == 1:
        return dict(summaries[0])
    out: dict = {"rounds": len(summaries)}
    for key, first in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if isinstance(first, list) or not all(isinstance(v, (int, float)) for v in values):
            out[key] = values
            continue
        out[key] = round(statistics.median(values), 3)
        if "speedup" in key:
            out[f"{key}_rounds"] = values
    return out


def compare_backends(args, data_flags: tuple[str, ...]) -> int:
    """The native engine and vLLM in the same greedy GRPO run, with and without the EAGLE-3 draft."""
    from megatron_spec._ext import cpu_facts

    greedy = ("--rollout-temperature", "0", "--no-dynamic-sampling")
    runs = {}
    for kind, tag in (("eagle3", "spec"), ("none", "ar")):
        for backend in ("native", "vllm"):  # the two backends one after the other, per configuration
            run_dir = os.path.join(args.work_dir, f"{backend}_{tag}")
            cmd = grpo_cmd(
                run_dir,
                args.base,
                args.steps,
                draft_kind=kind,
                draft=args.draft,
                config=args.config,
                nproc=args.nproc,
                port=args.port,
                extra=("--rollout-backend", backend) + greedy + data_flags,
            )
            runs[f"{backend}_{tag}"] = run_grpo(cmd, run_dir, "bench_grpo")
    summary: dict = {}
    for name, rows in runs.items():
        rows = rows[1:]  # the first step: engine warm-up
        summary.update({f"{name}_gen_s": round(mean([r["time/gen"] for r in rows]), 3),
                        f"{name}_prepare_s": round(mean([r["time/prepare"] for r in rows]), 3),
                        f"{name}_step_s": round(mean([r["time/step"] for r in rows]), 3),
                        f"{name}_accept_length": round(mean([r["spec/accept_length"] for r in rows]), 3)})
    for tag in ("spec", "ar"):
        for stage in ("gen", "prepare", "step"):
            summary[f"vllm_over_native_{stage}_{tag}"] = round(summary[f"vllm_{tag}_{stage}_s"]
                                                               / summary[f"native_{tag}_{stage}_s"], 3)
    summary.update({"steps": args.steps, "temperature": 0.0, "real_model": args.base if args.model else None,
                    **cpu_facts()})
    print(json.dumps(summary))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, steps=12, port=29611)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--no-adaptive", action="store_true", help="skip the adaptive k + history run")
    ap.add_argument(
        "--rollout-num-engines",
        type=int,
        default=None,
        help="engines for both runs; above 1, the speculative run is repeated with one engine on the "
        "same ranks and the generation times per step are reported side by side",
    )
    ap.add_argument("--model", default=None,
                    help="a real model instead of the demo's small policy: smollm2 or a Hub id (see above)")
    ap.add_argument(
        "--eagle-steps", type=int, default=150, help="ModelOpt steps of the real model's draft when made here"
    )
    ap.add_argument("--rollout-backend", choices=("native", "vllm"), default="native",
                    help="vllm: both backends side by side, greedy (see above)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the runs this many times, in reverse order every other round (see above)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    data_flags: tuple[str, ...] = ()
    if args.model:
        from _real_model import MODULES, questions, real_model_paths

        if not any(a == "--steps" or a.startswith("--steps=") for a in sys.argv[1:]):
            args.steps = 4  # a 30-layer model on 2 cores: ~1.5 min a step
        if args.config == DEMO_CONFIG:
            args.config = os.path.join(ROOT, "launch", "configs", "smollm2_algebra.yaml")
        paths = real_model_paths(
            args.model, args.work_dir, args.draft, draft_layers=4, eagle_steps=args.eagle_steps
        )
        args.base, args.draft = paths["target"], paths["eagle3"]
        questions(args.work_dir, "train-easy")  # makes the task
        data_flags = ("--prompt-data", os.path.join(args.work_dir, "math_task", MODULES, "train-easy.jsonl"))
    else:
        args.base, args.draft = ensure_models(args.work_dir, args.base, args.draft, sft_steps=args.sft_steps,
                                              tag="bench_grpo")

    if args.rollout_backend == "vllm":
        return compare_backends(args, data_flags)
    engines = args.rollout_num_engines
    adaptive = ("--spec-num-draft-tokens", "auto", "--spec-history")
    plan = [("spec", "eagle3", engines, ()), ("ar", "none", engines, ())]
    if not args.no_adaptive:
        plan.append(("spec_adaptive_history", "eagle3", engines, adaptive))
    if engines and engines > 1:
        plan.append(("spec_engines1", "eagle3", 1, ()))
    rounds: list[dict[str, list[dict]]] = []
    for r in range(args.rounds):
        runs = {}
        for name, kind, n, flags in plan if r % 2 == 0 else plan[::-1]:  # a drift falls on each run in turn
            run_dir = os.path.join(args.work_dir, name)
            extra = (() if n is None else ("--rollout-num-engines", str(n))) + flags + data_flags
            cmd = grpo_cmd(run_dir, args.base, args.steps, draft_kind=kind, draft=args.draft,
                           config=args.config, nproc=args.nproc, port=args.port, extra=extra)
            runs[name] = run_grpo(cmd, run_dir, f"bench_grpo round {r + 1}/{args.rounds}")
        rounds.append({name: runs[name] for name, *_ in plan})  # in the plan's order, whatever the round's
    import yaml

    with open(args.config) as fh:
        config = yaml.safe_load(fh) or {}
    rollout_cfg, grpo_cfg = config.get("rollout", {}), config.get("grpo", {})
    batch = int(rollout_cfg.get("rollout_max_batch_size", 16))
    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.rl.report import write_report

    dtype = resolve_dtype(rollout_cfg.get("rollout_dtype", "auto"))  # what the launcher's engine ran in
    regime = decode_regime(args.base, args.draft, batch, dtype)
    write_report(os.path.join(args.work_dir, "spec"), os.path.join(args.work_dir, "ar"))  # the last round's
    summaries = []
    for r, runs in enumerate(rounds):
        print(f"round {r + 1}/{len(rounds)}")
        print_runs(runs)
        summaries.append(round_summary(runs, regime, engines, args.nproc))
    summary = over_rounds(summaries)
    summary.update({
        "prompts_per_step": grpo_cfg.get("prompts_per_step"),
        "group_size": grpo_cfg.get("grpo_group_size"),
        "rollout_batch": batch,
        "v_k3": round(regime["v_k3"], 3),
        "c": round(regime["c"], 3),
        "steps": args.steps,
        "dtype": dtype,
        "real_model": args.base if args.model else None,
        **cpu_facts(),
        "report": os.path.join(args.work_dir, "spec", "report", "summary.md"),
    })
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
