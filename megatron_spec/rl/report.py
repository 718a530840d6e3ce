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

The figures are drawn in ``rl/report_figures.py``, from the rows ``rl/report_rows.py`` reads; this
file saves them and writes the summary. Reads metrics only; it knows nothing about models.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from megatron_spec.rl.report_figures import (
    acceptance_figure,
    compare_acceptance_figure,
    reward_figure,
    sources_figure,
    stage_times_figure,
    step_time_figure,
)
from megatron_spec.rl.report_rows import (
    SOURCE_NAMES,
    col,
    distinct_labels,
    draft_sources,
    evals,
    mean,
    read_run,
)
from megatron_spec.telemetry import STAGES, read_metrics, start_end_means


def write_report(
    run_dir: str,
    baseline_dir: str | None = None,
    compare_dir: str | None = None,
    labels: Sequence[str] | None = None,
) -> dict[str, str]:
    """Plots and summary into ``run_dir/report``. ``baseline_dir``: the same job without speculation
    (step time); ``compare_dir``: another speculative run (acceptance per step on one figure),
    ``labels`` = (this run's, the other's) legend names (default: from the runs,
    :func:`~megatron_spec.rl.report_rows.run_label`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_run(run_dir)
    base = read_metrics(os.path.join(baseline_dir, "metrics.jsonl")) if baseline_dir else None
    other = read_run(compare_dir) if compare_dir else None
    if other is not None:
        labels = tuple(labels) if labels else distinct_labels(run_dir, rows, compare_dir, other)
        if len(labels) != 2:
            raise ValueError(f"labels names the two compared runs, got {len(labels)}: {labels}")
    out_dir = os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    files = {}

    def save(name: str, fig) -> None:
        files[name] = os.path.join(out_dir, f"{name}.png")
        fig.savefig(files[name], dpi=110)
        plt.close(fig)

    save("reward", reward_figure(rows, base))
    save("acceptance", acceptance_figure(rows))
    save("stage_times", stage_times_figure(rows))
    save("step_time", step_time_figure(rows, base))
    source_lines = _sources_section(rows, save)
    compare_lines = _compare_section(rows, other, labels, compare_dir, save) if other is not None else []

    lines = _summary_lines(run_dir, rows) + _baseline_lines(rows, base, baseline_dir)
    lines += source_lines
    lines += compare_lines
    lines += ["", "Plots: " + ", ".join(f"[{name}]({os.path.basename(p)})" for name, p in files.items())]
    files["summary"] = os.path.join(out_dir, "summary.md")
    with open(files["summary"], "w") as f:
        f.write("\n".join(lines) + "\n")
    return files


def _sources_section(rows: Sequence[dict[str, Any]], save: Callable[[str, Any], None]) -> list[str]:
    """When the run names draft sources: their figure, ``save``d, and the summary's table of them."""
    sources = draft_sources(rows)
    if not sources:
        return []
    save("draft_sources", sources_figure(rows, sources))
    return [
        "",
        "## Draft sources per step (accepted drafted tokens, acceptance length)",
        "",
        *sources_table(rows, sources),
    ]


def _compare_section(
    rows: Sequence[dict[str, Any]],
    other: Sequence[dict[str, Any]],
    labels: Sequence[str],
    compare_dir: str,
    save: Callable[[str, Any], None],
) -> list[str]:
    """This run's and ``other``'s acceptance per step: the figure, ``save``d, and the summary's table."""
    runs = {labels[0]: rows, labels[1]: other}
    save("acceptance_compare", compare_acceptance_figure(runs))
    return [
        "",
        f"## Acceptance length per step: {labels[0]} vs {labels[1]} ({os.path.abspath(compare_dir)})",
        "",
        *acceptance_table(runs),
    ]


def _summary_lines(run_dir: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The summary's head: reward, held-out reward, acceptance, draft loss, mismatch, weight sync and
    memory, then the mean seconds of every stage."""
    first, last = rows[0], rows[-1]
    reward_start, reward_end, k = start_end_means(rows, "reward/mean")
    lines = [
        f"# GRPO run report: {os.path.abspath(run_dir)}",
        "",
        f"- steps: {len(rows)} (policy version {last.get('policy_version')})",
        f"- reward: {reward_start:.3f} (first {k} steps) -> {reward_end:.3f} (last {k} steps)"
        + _batch_note(run_dir),
        *_eval_lines(rows),
        f"- acceptance length: {mean(col(rows, 'spec/accept_length')):.2f} tokens per verify step "
        f"(k = {first.get('spec/num_draft_tokens')})",
        f"- draft loss: {mean(col(rows, 'draft/loss')):.4f}"
        if any(r.get("draft/loss") is not None for r in rows)
        else "- draft loss: no online draft training",
        f"- train/rollout log-prob mismatch: mean {mean(col(rows, 'mismatch/logprob_abs_diff_mean')):.2e}, "
        f"max {max(col(rows, 'mismatch/logprob_abs_diff_max')):.2e}",
        f"- weight sync: {mean(col(rows, 'sync/bytes')) / 2**20:.1f} MiB in "
        f"{mean(col(rows, 'sync/seconds')):.3f} s per step",
        f"- resident memory: {rows[0].get('mem/rss_mb', float('nan')):.0f} -> "
        f"{last.get('mem/rss_mb', float('nan')):.0f} MiB",
        "",
        "| stage | mean seconds |",
        "|---|---|",
    ]
    for stage in (*STAGES, "step"):
        lines.append(f"| {stage} | {mean(col(rows, f'time/{stage}')):.3f} |")
    return lines


def _baseline_lines(
    rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]] | None, baseline_dir: str | None
) -> list[str]:
    """The generation and step speedups against the baseline run (none without one)."""
    if not base:
        return []
    gen_s, gen_b = mean(col(rows, "time/gen")), mean(col(base, "time/gen"))
    step_s, step_b = mean(col(rows, "time/step")), mean(col(base, "time/step"))
    return [
        "",
        f"- against the baseline {os.path.abspath(baseline_dir)}: generation {gen_b / gen_s:.2f}x, "
        f"step {step_b / step_s:.2f}x",
    ]


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
        accept = [a for a in col(rows, "spec/accept_length") if a == a]
        ref = last if ref is None else ref
        lines.append(
            f"| {name} | {len(rows)} | {first:.3f} | {last:.3f} | {mean(accept):.3f} | "
            f"{min(accept) if accept else float('nan'):.3f} | {last / ref:.3f} |"
        )
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


def _eval_lines(rows: list[dict]) -> list[str]:
    """The held-out evaluations, first -> final, with their standard errors and the lift from the
    first to the last in standard errors of the difference, when the run made them."""
    made = evals(rows)
    if not made:
        return []
    n = next(
        r.get("eval/prompts") or r.get("eval_final/prompts")
        for r in rows
        if r.get("eval/prompts") or r.get("eval_final/prompts")
    )
    path = " -> ".join(f"{v:.3f}" + (f" ± {se:.3f}" if se is not None else "") for _, v, se in made)
    line = (
        f"- held-out reward ({n} prompts, one sample each, same seed every time), after steps "
        f"{', '.join(str(s) for s, _, _ in made)}: {path}"
    )
    (_, first, se0), (_, last, se1) = made[0], made[-1]
    if len(made) > 1 and se0 is not None and se1 is not None and (se0 or se1):
        lift = last - first
        line += f" (lift {lift:+.3f} = {lift / math.hypot(se0, se1):+.1f} standard errors)"
    return [line]
