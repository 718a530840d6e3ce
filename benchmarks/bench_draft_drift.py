"""Frozen vs online EAGLE-3 draft over a GRPO run: does online training keep acceptance up?

    python benchmarks/bench_draft_drift.py [--steps 60] [--base DIR --draft DIR] [--plot PATH]

Runs ``launch/pretrain_grpo_spec.py`` twice on the demo config from the same base policy,
ModelOpt EAGLE-3 draft (k=3), seed and prompts: once with the draft frozen, once with
``--spec-online-draft-training`` (the draft trained after every RL step on the verifier's
captured states and streamed to the engine before the next rollouts). Both runs sample the
same prompts; the policies are updated by the same GRPO recipe, so they differ only through
the draft and through the sampled tokens.

Prints the acceptance length (tokens per verify step) of every step for both runs, writes a
plot (``--plot``, default ``docs/draft_drift.png``: the figure of ``megatron-spec report
WORK/drift_online --compare WORK/drift_frozen``, which it also writes, into
``WORK/drift_online/report/``) and ends with one JSON line:

* ``online_over_frozen_accept_last``: mean acceptance over the last fifth of the steps, online
  over frozen (target >= 1.0);
* ``online_accept_last_over_first``: the online run's mean acceptance over its last fifth over its
  first fifth (target >= 0.98);
* both runs' first/last-fifth means, the online draft's loss and held-out expected acceptance
  (``draft/heldout_tau``: the draft that generated a batch, scored on that batch's captured
  states before it trains on them), ``wall_s``, ``dtype`` (the engine's, resolved for this CPU) and
  ``cpu_capability``.

With ``--corrupt-at N`` a third run (online draft, ``--spec-watchdog-fallback``) has its draft
update of step N corrupted (fault point ``corrupt_draft``): ``corrupted_*`` keys give the
acceptance at steps N, N+1 (drafting with the corrupted update) and N+2 (after the watchdog's
verdict on N+1), the first step whose row says ``fallback``, and the generation seconds of those
steps; its plot against the online run is ``--watchdog-plot`` (default ``docs/draft_watchdog.png``).
``--reuse`` keeps finished runs (same step count) instead of running them again.

The base policy and draft are made with launch/sft_base.py and launch/make_draft.py when not
given, and cached in ``--work-dir`` (the same ones as bench_grpo.py: ``runs/bench_grpo``).
The numbers and the plot: docs/draft_training.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _grpo_runs import add_run_args, ensure_models, grpo_cmd, mean, run_grpo

RUNS = (("frozen", ()), ("online", ("--spec-online-draft-training",)))


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    from megatron_spec.telemetry import start_end_means

    first, last, _ = start_end_means(rows, key)
    return first, last


def plot(path: str, runs: dict[str, list[dict]], title: str) -> None:
    """The figure of ``megatron-spec report ONLINE --compare FROZEN`` (acceptance_compare.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_spec.rl.report_figures import compare_acceptance_figure

    fig = compare_acceptance_figure(
        {name if " " in name else f"{name} draft": rows for name, rows in runs.items()}, title=title
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def corrupted_summary(rows: list[dict], n: int) -> dict:
    """The watchdog run: acceptance at step n (the last good draft), n + 1 (drafting with the
    corrupted update of step n) and n + 2 (the step after the watchdog's verdict on n + 1)."""
    by_step = {int(r["step"]): r for r in rows}
    fallback = [int(r["step"]) for r in rows if r.get("spec/watchdog") == "fallback"]
    return {
        "corrupted_at": n,
        "corrupted_accept_before": round(by_step[n]["spec/accept_length"], 4),
        "corrupted_accept_next": round(by_step[n + 1]["spec/accept_length"], 4),
        "corrupted_watchdog_next": by_step[n + 1].get("spec/watchdog"),
        "corrupted_first_fallback_step": fallback[0] if fallback else None,
        "corrupted_accept_after": round(by_step[n + 2]["spec/accept_length"], 4),
        "corrupted_draft_tokens_after": by_step[n + 2].get("spec/num_draft_tokens"),
        "corrupted_gen_s_before": round(by_step[n]["gen/seconds"], 3),
        "corrupted_gen_s_next": round(by_step[n + 1]["gen/seconds"], 3),
        "corrupted_gen_s_after": round(by_step[n + 2]["gen/seconds"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, steps=60, port=29612)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "draft_drift.png"))
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both runs (1 on a machine shared with other jobs); default: the config's",
    )
    ap.add_argument(
        "--extra", default="", help="more launcher flags for the online run (e.g. --spec-draft-lr 1e-4)"
    )
    ap.add_argument(
        "--corrupt-at",
        type=int,
        default=0,
        metavar="N",
        help="also run the online draft with its update of step N corrupted (fault corrupt_draft=N) "
        "and --spec-watchdog-fallback, for N + 10 steps: the acceptance watchdog's fallback on "
        "the demo (plot --watchdog-plot, corrupted_* keys); 0 = off",
    )
    ap.add_argument("--watchdog-plot", default=os.path.join(ROOT, "docs", "draft_watchdog.png"))
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse a run whose directory already holds metrics of --steps steps (e.g. add --corrupt-at "
        "to a finished benchmark without rerunning it)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    base, draft = ensure_models(args.work_dir, args.base, args.draft, sft_steps=args.sft_steps,
                                tag="bench_draft_drift")
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {}
    reused: list[str] = []  # wall_s counts the runs made by this invocation only
    plan = [(name, extra, args.steps, {}) for name, extra in RUNS]
    if args.corrupt_at:
        if not 1 <= args.corrupt_at < args.steps:
            ap.error(f"--corrupt-at must be a step in 1 .. {args.steps - 1}, got {args.corrupt_at}")
        plan.append(("corrupted", RUNS[1][1] + ("--spec-watchdog-fallback",), args.corrupt_at + 10,
                     {"MEGATRON_SPEC_FAULTS": f"corrupt_draft={args.corrupt_at}"}))
    bar = tqdm(total=sum(n for _, _, n, _ in plan), desc="steps", file=sys.stderr)
    for name, extra, steps, env in plan:
        bar.set_description(name)
        if name in ("online", "corrupted") and args.extra:
            extra = tuple(extra) + tuple(args.extra.split())
        run_dir = os.path.join(args.work_dir, f"drift_{name}")
        done = os.path.join(run_dir, "metrics.jsonl")
        if args.reuse and os.path.exists(done):
            from megatron_spec.telemetry import read_metrics

            rows = read_metrics(done)
            if len(rows) == steps:
                runs[name] = rows
                reused.append(name)
                bar.update(steps)
                continue
        cmd = grpo_cmd(run_dir, base, steps, draft=draft, config=args.config, port=args.port, extra=extra)

        def on_step(row, name=name):
            bar.update(1)
            bar.set_postfix(accept=f"{row.get('spec/accept_length', float('nan')):.2f}")

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the fault point (read by the launcher's processes)
        try:
            runs[name] = run_grpo(cmd, run_dir, "bench_draft_drift", on_step=on_step, threads=args.threads)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    bar.close()
    wall = time.perf_counter() - t0

    frozen, online = runs["frozen"], runs["online"]
    print(f"{'step':>5}{'frozen':>9}{'online':>9}{'draft loss':>12}{'held-out tau':>14}")
    for f, o in zip(frozen, online):
        loss, tau = o.get("draft/loss"), o.get("draft/heldout_tau")
        print(
            f"{f['step']:>5}{f['spec/accept_length']:>9.3f}{o['spec/accept_length']:>9.3f}"
            f"{loss if loss is not None else float('nan'):>12.3f}"
            f"{tau if tau is not None else float('nan'):>14.3f}"
        )
    f_first, f_last = first_last(frozen, "spec/accept_length")
    o_first, o_last = first_last(online, "spec/accept_length")
    import yaml

    with open(args.config) as fh:
        rollout_cfg = (yaml.safe_load(fh) or {}).get("rollout", {})
    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import resolve_dtype

    dtype = resolve_dtype(rollout_cfg.get("rollout_dtype", "auto"))
    title = (f"frozen vs online EAGLE-3 draft, {args.steps} GRPO steps, {dtype} engine\n"
             f"last fifth online/frozen {o_last / f_last:.3f}")
    plot(args.plot, {name: runs[name] for name, _ in RUNS}, title)
    from megatron_spec.rl.report import write_report

    report = write_report(os.path.join(args.work_dir, "drift_online"),
                          compare_dir=os.path.join(args.work_dir, "drift_frozen"))
    loss_first, loss_last = first_last(online, "draft/loss")
    tau_first, tau_last = first_last(online, "draft/heldout_tau")
    summary = {
        "online_over_frozen_accept_last": round(o_last / f_last, 4),
        "online_accept_last_over_first": round(o_last / o_first, 4),
        "frozen_accept_first": round(f_first, 4), "frozen_accept_last": round(f_last, 4),
        "online_accept_first": round(o_first, 4), "online_accept_last": round(o_last, 4),
        "frozen_accept_mean": round(mean([r["spec/accept_length"] for r in frozen]), 4),
        "online_accept_mean": round(mean([r["spec/accept_length"] for r in online]), 4),
        "online_draft_loss_first": round(loss_first, 4), "online_draft_loss_last": round(loss_last, 4),
        "online_heldout_tau_first": round(tau_first, 4), "online_heldout_tau_last": round(tau_last, 4),
        "reward_first_frozen": round(first_last(frozen, "reward/mean")[0], 3),
        "reward_last_frozen": round(first_last(frozen, "reward/mean")[1], 3),
        "reward_first_online": round(first_last(online, "reward/mean")[0], 3),
        "reward_last_online": round(first_last(online, "reward/mean")[1], 3),
        "steps": args.steps, "wall_s": round(wall, 1), "reused": reused, "dtype": dtype, **cpu_facts(),
        "plot": os.path.relpath(args.plot, ROOT), "report": os.path.relpath(report["summary"], ROOT),
    }
    if "corrupted" in runs:
        summary.update(corrupted_summary(runs["corrupted"], args.corrupt_at))
        labels = (f"online draft, update {args.corrupt_at} corrupted", "online draft")
        write_report(os.path.join(args.work_dir, "drift_corrupted"),
                     compare_dir=os.path.join(args.work_dir, "drift_online"), labels=labels)
        steps = len(runs["corrupted"])  # the same steps of both: they are the same run up to the fault
        with open(os.path.join(args.work_dir, "drift_corrupted", "config.yaml")) as fh:
            window = (yaml.safe_load(fh) or {}).get("spec", {}).get("spec_watchdog_steps")
        plot(args.watchdog_plot, {labels[0]: runs["corrupted"], labels[1]: runs["online"][:steps]},
             f"the online draft's update of step {args.corrupt_at} corrupted (fault corrupt_draft), "
             f"--spec-watchdog-fallback\nwatchdog window {window} steps; x: the row says fallback")
        summary["watchdog_plot"] = os.path.relpath(args.watchdog_plot, ROOT)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
