"""Plots and a Markdown summary of a GRPO run from its metrics JSONL.

Writes into ``RUN_DIR/report/``:

* ``reward.png``: mean reward per step with a +-1 std band;
* ``acceptance.png``: acceptance length and per-position acceptance rates over steps;
* ``stage_times.png``: stacked stage times per step (data, prepare, gen, reward, logprob, train);
* ``step_time.png``: step time of this run and, with a baseline run (same job with
  ``--spec-draft-kind none``), the autoregressive step time beside it;
* ``acceptance_compare.png`` (with ``compare_dir``, ``megatron-spec report RUN --compare OTHER``):
  the acceptance length per step of this run and of another speculative run of the same job
  on one figure, e.g. online draft training against the frozen ModelOpt draft
  (benchmarks/bench_draft_drift.py); the top panel on the full 1 .. k+1 scale, the bottom one
  zoomed with 10-step running means; watchdog fallbacks marked;
* ``summary.md``: start/end reward, acceptance, mean stage times, speedups against the
  baseline, train/rollout mismatch, weight-sync bytes and seconds, memory, and with
  ``compare_dir`` both runs' acceptance over the first and last fifth of the steps.

Reads metrics only; it knows nothing about models.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from megatron_spec.telemetry import STAGES, read_metrics, start_end_means


def _col(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) is not None else float("nan") for r in rows]


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def write_report(run_dir: str, baseline_dir: str | None = None, compare_dir: str | None = None,
                 labels: Sequence[str] | None = None) -> dict[str, str]:
    """Plots and summary into ``run_dir/report``. ``baseline_dir``: the same job without speculation
    (step time); ``compare_dir``: another speculative run (acceptance per step on one figure),
    ``labels`` = (this run's, the other's) legend names (default: from the runs, :func:`run_label`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read_run(run_dir)
    base = read_metrics(os.path.join(baseline_dir, "metrics.jsonl")) if baseline_dir else None
    other = _read_run(compare_dir) if compare_dir else None
    if other is not None:
        labels = tuple(labels) if labels else _distinct_labels(run_dir, rows, compare_dir, other)
        if len(labels) != 2:
            raise ValueError(f"labels names the two compared runs, got {len(labels)}: {labels}")
    out_dir = os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    steps = [int(r["step"]) for r in rows]
    files = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    mean, std = _col(rows, "reward/mean"), _col(rows, "reward/std")
    ax.plot(steps, mean, label="this run (training batch)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    evals = _eval_points(rows)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="k", label="held-out (after step)")
    if base:
        ax.plot([int(r["step"]) for r in base], _col(base, "reward/mean"), "--", label="baseline")
    ax.set(xlabel="step", ylabel="mean reward", title="Reward")
    ax.legend()
    files["reward"] = os.path.join(out_dir, "reward.png")
    fig.tight_layout()
    fig.savefig(files["reward"], dpi=110)
    plt.close(fig)

    fig = acceptance_figure(rows)
    files["acceptance"] = os.path.join(out_dir, "acceptance.png")
    fig.savefig(files["acceptance"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [x if x == x else 0.0 for x in _col(rows, f"time/{stage}")]
        ax.bar(steps, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(xlabel="step", ylabel="seconds", title="Stage times per step")
    ax.legend(fontsize=8, ncol=3)
    files["stage_times"] = os.path.join(out_dir, "stage_times.png")
    fig.tight_layout()
    fig.savefig(files["stage_times"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, _col(rows, "time/step"), label="speculative: step")
    ax.plot(steps, _col(rows, "time/gen"), label="speculative: gen")
    if base:
        bsteps = [int(r["step"]) for r in base]
        ax.plot(bsteps, _col(base, "time/step"), "--", label="autoregressive: step")
        ax.plot(bsteps, _col(base, "time/gen"), "--", label="autoregressive: gen")
    ax.set(
        xlabel="step",
        ylabel="seconds",
        title="Step time, speculative vs autoregressive" if base else "Step time",
    )
    ax.legend(fontsize=8)
    files["step_time"] = os.path.join(out_dir, "step_time.png")
    fig.tight_layout()
    fig.savefig(files["step_time"], dpi=110)
    plt.close(fig)

    source_lines = []
    sources = draft_sources(rows)
    if sources:
        fig = sources_figure(rows, sources)
        files["draft_sources"] = os.path.join(out_dir, "draft_sources.png")
        fig.savefig(files["draft_sources"], dpi=110)
        plt.close(fig)
        source_lines = ["", "## Draft sources per step (accepted drafted tokens, acceptance length)", "",
                        *sources_table(rows, sources)]

    compare_lines = []
    if other is not None:
        runs = {labels[0]: rows, labels[1]: other}
        fig = compare_acceptance_figure(runs)
        files["acceptance_compare"] = os.path.join(out_dir, "acceptance_compare.png")
        fig.savefig(files["acceptance_compare"], dpi=110)
        plt.close(fig)
        compare_lines = ["", f"## Acceptance length per step: {labels[0]} vs {labels[1]} "
                             f"({os.path.abspath(compare_dir)})", "", *acceptance_table(runs)]

    first, last = rows[0], rows[-1]
    reward_start, reward_end, k = start_end_means(rows, "reward/mean")
    lines = [
        f"# GRPO run report: {os.path.abspath(run_dir)}",
        "",
        f"- steps: {len(rows)} (policy version {last.get('policy_version')})",
        f"- reward: {reward_start:.3f} (first {k} steps) -> {reward_end:.3f} (last {k} steps)"
        + _batch_note(run_dir),
        *_eval_lines(rows),
        f"- acceptance length: {_mean(_col(rows, 'spec/accept_length')):.2f} tokens per verify step "
        f"(k = {first.get('spec/num_draft_tokens')})",
        f"- draft loss: {_mean(_col(rows, 'draft/loss')):.4f}"
        if any(r.get("draft/loss") is not None for r in rows)
        else "- draft loss: no online draft training",
        f"- train/rollout log-prob mismatch: mean {_mean(_col(rows, 'mismatch/logprob_abs_diff_mean')):.2e}, "
        f"max {max(_col(rows, 'mismatch/logprob_abs_diff_max')):.2e}",
        f"- weight sync: {_mean(_col(rows, 'sync/bytes')) / 2**20:.1f} MiB in "
        f"{_mean(_col(rows, 'sync/seconds')):.3f} s per step",
        f"- resident memory: {rows[0].get('mem/rss_mb', float('nan')):.0f} -> "
        f"{last.get('mem/rss_mb', float('nan')):.0f} MiB",
        "",
        "| stage | mean seconds |",
        "|---|---|",
    ]
    for stage in (*STAGES, "step"):
        lines.append(f"| {stage} | {_mean(_col(rows, f'time/{stage}')):.3f} |")
    if base:
        gen_s, gen_b = _mean(_col(rows, "time/gen")), _mean(_col(base, "time/gen"))
        step_s, step_b = _mean(_col(rows, "time/step")), _mean(_col(base, "time/step"))
        lines += [
            "",
            f"- against the baseline {os.path.abspath(baseline_dir)}: generation {gen_b / gen_s:.2f}x, "
            f"step {step_b / step_s:.2f}x",
        ]
    lines += source_lines
    lines += compare_lines
    lines += ["", "Plots: " + ", ".join(f"[{name}]({os.path.basename(p)})" for name, p in files.items())]
    files["summary"] = os.path.join(out_dir, "summary.md")
    with open(files["summary"], "w") as f:
        f.write("\n".join(lines) + "\n")
    return files


def acceptance_figure(rows: Sequence[dict[str, Any]]):
    """Accept length (left axis) and per-position acceptance rates (right axis) over steps.

    The accept-length axis runs from 1 (every verify step emits at least the verifier's token) to
    k + 1, not zoomed to the data: a run that holds 3.50-3.66 reads as flat, not as drift. The
    legend sits below the axes, off the lines.
    """
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    accept = _col(rows, "spec/accept_length")
    fig, ax = plt.subplots(figsize=(7, 4.6), layout="constrained")
    ax.plot(steps, accept, "k-", lw=2, label="accept length (tokens / verify)")
    positions = sorted({int(k[len("spec/accept_rate_pos"):]) for r in rows for k in r
                        if k.startswith("spec/accept_rate_pos")})
    ax2 = ax.twinx()
    for i in positions:
        ax2.plot(steps, _col(rows, f"spec/accept_rate_pos{i}"), label=f"P(draft {i + 1} accepted)", alpha=0.8)
    k = max([int(r["spec/num_draft_tokens"]) for r in rows if r.get("spec/num_draft_tokens") is not None]
            + [len(positions)])
    top = max([k + 1.0, 2.0] + [a for a in accept if a == a])
    ax.set(
        xlabel="step",
        ylabel="accept length",
        title="Speculative acceptance",
        ylim=(1, top + 0.02 * (top - 1)),
    )
    ax2.set(ylabel="acceptance rate", ylim=(0, 1.02))
    lines, labels = (a + b for a, b in zip(ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()))
    fig.legend(lines, labels, fontsize=8, loc="outside lower center", ncol=min(len(labels), 3), frameon=False)
    return fig


SOURCE_NAMES = {"live": "live group", "history": "history", "tree": "tree (draft + history)"}


def draft_sources(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The draft sources a run's steps name (``spec/source_steps/<source>``: eagle3, mtp, model, ngram,
    history, live, tree), in order of first appearance."""
    out: list[str] = []
    for r in rows:
        for key in r:
            if key.startswith("spec/source_steps/") and key.split("/", 2)[2] not in out:
                out.append(key.split("/", 2)[2])
    return out


def sources_table(rows: Sequence[dict[str, Any]], sources: Sequence[str]) -> list[str]:
    """Markdown: per step and source, the drafted tokens the target accepted and the source's
    acceptance length (1 + accepted per request-step it drafted)."""
    head = "| step | " + " | ".join(SOURCE_NAMES.get(s, s) for s in sources) + " |"
    lines = [head, "|---|" + "---|" * len(sources)]
    for r in rows:
        cells = []
        for s in sources:
            n, a = r.get(f"spec/source_steps/{s}"), r.get(f"spec/source_tokens/{s}")
            cells.append(f"{int(a)} ({1 + a / n:.2f})" if n else "-")
        lines.append(f"| {int(r['step'])} | " + " | ".join(cells) + " |")
    return lines


def sources_figure(rows: Sequence[dict[str, Any]], sources: Sequence[str]):
    """Stacked bars: per step, the drafted tokens each source had accepted."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [int(r["step"]) for r in rows]
    bottom = [0.0] * len(rows)
    for s in sources:
        vals = [float(r.get(f"spec/source_tokens/{s}", 0) or 0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=SOURCE_NAMES.get(s, s))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(
        xlabel="step",
        ylabel="accepted drafted tokens",
        title="Which draft source drafted the accepted tokens",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _read_run(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path} has no step records")
    return rows


def run_label(rows: Sequence[dict[str, Any]]) -> str:
    """What kind of draft a run used, from its metrics: ``online draft`` (the draft trained in the
    loop: ``draft/step`` logged), ``no speculation`` (no draft tokens ever), else ``frozen draft``."""
    if any(r.get("draft/step") is not None for r in rows):
        return "online draft"
    if all(not r.get("spec/num_draft_tokens") for r in rows):
        return "no speculation"
    return "frozen draft"


def _distinct_labels(dir_a: str, rows_a, dir_b: str, rows_b) -> tuple[str, str]:
    a, b = run_label(rows_a), run_label(rows_b)
    if a == b:  # two runs of the same kind: name them by their directories too
        a, b = (f"{a} ({os.path.basename(os.path.normpath(d))})" for d in (dir_a, dir_b))
    return a, b


def _running_mean(xs: Sequence[float], n: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        out.append(_mean(xs[max(0, i - n + 1): i + 1]))
    return out


def compare_acceptance_figure(
    runs: dict[str, Sequence[dict[str, Any]]],
    title: str | None = None,
    smooth: int = 10,
    zoom: bool | None = None,
):
    """Acceptance length per step of several runs on one figure: top, the full scale 1 .. k+1 (so
    that noise reads as noise); bottom, zoomed to the data with ``smooth``-step running means
    (dotted: each run's raw curve is the top panel's). An online run's held-out expected
    acceptance (``draft/heldout_tau``) is drawn dashed; steps where the acceptance watchdog said
    ``fallback`` are marked with an x at the bottom of the top panel. ``zoom`` None: the bottom
    panel only when no run fell back (a collapse to 1.0 leaves nothing to zoom into)."""
    import matplotlib.pyplot as plt

    if zoom is None:
        zoom = not any(r.get("spec/watchdog") == "fallback" for rows in runs.values() for r in rows)
    if zoom:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.2), sharex=True, layout="constrained",
                                          gridspec_kw={"height_ratios": [1, 1.2]})
    else:
        fig, top = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
        bottom = None
    k, values = 1, []
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [int(r["step"]) for r in rows]
        accept = _col(rows, "spec/accept_length")
        values += [a for a in accept if a == a]
        k = max([k] + [int(r["spec/num_draft_tokens"]) for r in rows if r.get("spec/num_draft_tokens")])
        top.plot(steps, accept, color=color, lw=1.2, label=name)
        if bottom is not None:
            bottom.plot(steps, accept, color=color, lw=0.6, alpha=0.45)
            bottom.plot(steps, _running_mean(accept, smooth), color=color, lw=2.0,
                        label=f"{name}: {smooth}-step running mean")
            tau = [
                (int(r["step"]), r["draft/heldout_tau"])
                for r in rows
                if r.get("draft/heldout_tau") is not None
            ]
            if tau:
                bottom.plot(*zip(*tau), color=color, ls="--", lw=0.9, label=f"{name}: held-out expected tau")
        fallback = [int(r["step"]) for r in rows if r.get("spec/watchdog") == "fallback"]
        if fallback:
            top.plot(fallback, [1.0] * len(fallback), "x", color=color, clip_on=False,
                     label=f"{name}: watchdog fallback")
    high = max([k + 1.0] + values)
    top.set(ylabel="accept length", ylim=(1, high + 0.02 * (high - 1)))
    top.set_title(title or "Acceptance length per GRPO step (tokens per verify step)", fontsize=9)
    top.legend(fontsize=8, loc="lower right")
    top.grid(alpha=0.3)
    if bottom is None:
        top.set_xlabel("GRPO step")
        return fig
    if values:
        lo, hi = min(values), max(values)
        pad = 0.05 * (hi - lo or 1.0)
        bottom.set_ylim(lo - pad, hi + pad)
    bottom.set(xlabel="GRPO step", ylabel="accept length (zoomed)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7, loc="lower left", ncol=2)
    return fig


def acceptance_table(runs: dict[str, Sequence[dict[str, Any]]]) -> list[str]:
    """Markdown table: each run's acceptance length over the first and last fifth of its steps,
    its mean and minimum, and the last fifth against the first run's."""
    lines = [
        "| run | steps | first fifth | last fifth | mean | min | last fifth / first run's |",
        "|---|---|---|---|---|---|---|",
    ]
    ref = None
    for name, rows in runs.items():
        first, last, n = start_end_means(rows, "spec/accept_length")
        accept = [a for a in _col(rows, "spec/accept_length") if a == a]
        ref = last if ref is None else ref
        lines.append(f"| {name} | {len(rows)} | {first:.3f} | {last:.3f} | {_mean(accept):.3f} | "
                     f"{min(accept) if accept else float('nan'):.3f} | {last / ref:.3f} |")
    return lines


def _batch_note(run_dir: str) -> str:
    """``", per step: P prompts x G samples"`` from the run's saved config (empty if absent)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return ""
    import yaml

    with open(path) as f:
        grpo = (yaml.safe_load(f) or {}).get("grpo", {})
    if "prompts_per_step" not in grpo or "grpo_group_size" not in grpo:
        return ""
    return f"; mean over {grpo['prompts_per_step']} prompts x {grpo['grpo_group_size']} samples per step"


def _evals(rows: list[dict]) -> list[tuple[int, float, float | None]]:
    """(steps trained, held-out reward, its standard error) of every evaluation (--eval-interval),
    the final one last; the standard error is None for a run from before ``eval/reward_se``."""
    evals = [(int(r["step"]) - 1, r["eval/reward"], r.get("eval/reward_se")) for r in rows
             if r.get("eval/reward") is not None]
    final = [r for r in rows if r.get("eval_final/reward") is not None]
    if final:
        evals.append(
            (int(final[-1]["step"]), final[-1]["eval_final/reward"], final[-1].get("eval_final/reward_se"))
        )
    return evals


def _eval_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(steps trained, held-out reward) of every evaluation, the final one last."""
    return [(step, value) for step, value, _ in _evals(rows)]


def _eval_lines(rows: list[dict]) -> list[str]:
    """The held-out evaluations, first -> final, with their standard errors and the lift from the
    first to the last in standard errors of the difference, when the run made them."""
    evals = _evals(rows)
    if not evals:
        return []
    n = next(r.get("eval/prompts") or r.get("eval_final/prompts") for r in rows
             if r.get("eval/prompts") or r.get("eval_final/prompts"))
    path = " -> ".join(f"{v:.3f}" + (f" ± {se:.3f}" if se is not None else "") for _, v, se in evals)
    line = (f"- held-out reward ({n} prompts, one sample each, same seed every time), after steps "
            f"{', '.join(str(s) for s, _, _ in evals)}: {path}")
    (_, first, se0), (_, last, se1) = evals[0], evals[-1]
    if len(evals) > 1 and se0 is not None and se1 is not None and (se0 or se1):
        lift = last - first
        line += f" (lift {lift:+.3f} = {lift / math.hypot(se0, se1):+.1f} standard errors)"
    return [line]
