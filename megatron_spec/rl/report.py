"""Plots and a Markdown summary of a GRPO run from its metrics JSONL.

Writes into ``RUN_DIR/report/``:

* ``reward.png``: mean reward per step with a +-1 std band;
* ``acceptance.png``: acceptance length and per-position acceptance rates over steps;
* ``stage_times.png``: stacked stage times per step (data, prepare, gen, reward, logprob, train);
* ``step_time.png``: step time of this run and, with a baseline run (same job with
  ``--spec-draft-kind none``), the autoregressive step time beside it;
* ``summary.md``: start/end reward, acceptance, mean stage times, speedups against the
  baseline, train/rollout mismatch, weight-sync bytes and seconds, memory.

Reads metrics only; it knows nothing about models.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megatron_spec.telemetry import STAGES, read_metrics, start_end_means


def _col(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) is not None else float("nan") for r in rows]


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def write_report(run_dir: str, baseline_dir: str | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} has no step records")
    base = read_metrics(os.path.join(baseline_dir, "metrics.jsonl")) if baseline_dir else None
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
    ax.set(xlabel="step", ylabel="seconds", title="Step time, speculative vs autoregressive" if base else "Step time")
    ax.legend(fontsize=8)
    files["step_time"] = os.path.join(out_dir, "step_time.png")
    fig.tight_layout()
    fig.savefig(files["step_time"], dpi=110)
    plt.close(fig)

    first, last = rows[0], rows[-1]
    reward_start, reward_end, k = start_end_means(rows, "reward/mean")
    lines = [f"# GRPO run report: {os.path.abspath(run_dir)}", "",
             f"- steps: {len(rows)} (policy version {last.get('policy_version')})",
             f"- reward: {reward_start:.3f} (first {k} steps) -> {reward_end:.3f} (last {k} steps)"
             + _batch_note(run_dir),
             *_eval_lines(rows),
             f"- acceptance length: {_mean(_col(rows, 'spec/accept_length')):.2f} tokens per verify step "
             f"(k = {first.get('spec/num_draft_tokens')})",
             f"- draft loss: {_mean(_col(rows, 'draft/loss')):.4f}" if any(r.get('draft/loss') is not None for r in rows)
             else "- draft loss: no online draft training",
             f"- train/rollout log-prob mismatch: mean {_mean(_col(rows, 'mismatch/logprob_abs_diff_mean')):.2e}, "
             f"max {max(_col(rows, 'mismatch/logprob_abs_diff_max')):.2e}",
             f"- weight sync: {_mean(_col(rows, 'sync/bytes')) / 2**20:.1f} MiB in "
             f"{_mean(_col(rows, 'sync/seconds')):.3f} s per step",
             f"- resident memory: {rows[0].get('mem/rss_mb', float('nan')):.0f} -> {last.get('mem/rss_mb', float('nan')):.0f} MiB",
             "", "| stage | mean seconds |", "|---|---|"]
    for stage in (*STAGES, "step"):
        lines.append(f"| {stage} | {_mean(_col(rows, f'time/{stage}')):.3f} |")
    if base:
        gen_s, gen_b = _mean(_col(rows, "time/gen")), _mean(_col(base, "time/gen"))
        step_s, step_b = _mean(_col(rows, "time/step")), _mean(_col(base, "time/step"))
        lines += ["", f"- against the baseline {os.path.abspath(baseline_dir)}: generation {gen_b / gen_s:.2f}x, "
                      f"step {step_b / step_s:.2f}x"]
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
    ax.set(xlabel="step", ylabel="accept length", title="Speculative acceptance", ylim=(1, top + 0.02 * (top - 1)))
    ax2.set(ylabel="acceptance rate", ylim=(0, 1.02))
    lines, labels = (a + b for a, b in zip(ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()))
    fig.legend(lines, labels, fontsize=8, loc="outside lower center", ncol=min(len(labels), 3), frameon=False)
    return fig


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


def _eval_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(steps trained, held-out reward) of every evaluation (--eval-interval), the final one last."""
    evals = [(int(r["step"]) - 1, r["eval/reward"]) for r in rows if r.get("eval/reward") is not None]
    final = [r for r in rows if r.get("eval_final/reward") is not None]
    if final:
        evals.append((int(final[-1]["step"]), final[-1]["eval_final/reward"]))
    return evals


def _eval_lines(rows: list[dict]) -> list[str]:
    """The held-out evaluations, first -> final, when the run made them."""
    evals = _eval_points(rows)
    if not evals:
        return []
    n = next(r.get("eval/prompts") or r.get("eval_final/prompts") for r in rows
             if r.get("eval/prompts") or r.get("eval_final/prompts"))
    path = " -> ".join(f"{v:.3f}" for _, v in evals)
    return [f"- held-out reward ({n} prompts, one sample each, same seed every time), after steps "
            f"{', '.join(str(s) for s, _ in evals)}: {path}"]
