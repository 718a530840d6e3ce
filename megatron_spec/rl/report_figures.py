"""The run report's figures (matplotlib), each drawn from metric rows and returned to the caller.

Reward per step (with held-out evaluations and a baseline), stacked stage times, step time against
an autoregressive baseline, acceptance length and per-position rates, the draft sources of the
accepted tokens, and several runs' acceptance on one figure. The caller saves and closes them; nothing
here reads a file or writes Markdown (``rl/report.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_spec.rl.report_rows import SOURCE_NAMES, col, eval_points, running_mean
from megatron_spec.telemetry import STAGES


def reward_figure(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]] | None):
    """Mean reward per step with a +-1 std band, the held-out evaluations, and ``base``'s mean reward."""
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    mean, std = col(rows, "reward/mean"), col(rows, "reward/std")
    ax.plot(steps, mean, label="this run (training batch)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    evals = eval_points(rows)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="k", label="held-out (after step)")
    if base:
        ax.plot([int(r["step"]) for r in base], col(base, "reward/mean"), "--", label="baseline")
    ax.set(xlabel="step", ylabel="mean reward", title="Reward")
    ax.legend()
    fig.tight_layout()
    return fig


def stage_times_figure(rows: Sequence[dict[str, Any]]):
    """Stacked bars: per step, the seconds of each stage (``time/<stage>``)."""
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [x if x == x else 0.0 for x in col(rows, f"time/{stage}")]
        ax.bar(steps, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(xlabel="step", ylabel="seconds", title="Stage times per step")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    return fig


def step_time_figure(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]] | None):
    """Step and generation time per step of this run and, with ``base`` (the same job without
    speculation), of the autoregressive run beside it."""
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, col(rows, "time/step"), label="speculative: step")
    ax.plot(steps, col(rows, "time/gen"), label="speculative: gen")
    if base:
        bsteps = [int(r["step"]) for r in base]
        ax.plot(bsteps, col(base, "time/step"), "--", label="autoregressive: step")
        ax.plot(bsteps, col(base, "time/gen"), "--", label="autoregressive: gen")
    ax.set(
        xlabel="step",
        ylabel="seconds",
        title="Step time, speculative vs autoregressive" if base else "Step time",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def acceptance_figure(rows: Sequence[dict[str, Any]]):
    """Accept length (left axis) and per-position acceptance rates (right axis) over steps.

    The accept-length axis runs from 1 (every verify step emits at least the verifier's token) to
    k + 1, not zoomed to the data: a run that holds 3.50-3.66 reads as flat, not as drift. The
    legend sits below the axes, off the lines.
    """
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    accept = col(rows, "spec/accept_length")
    fig, ax = plt.subplots(figsize=(7, 4.6), layout="constrained")
    ax.plot(steps, accept, "k-", lw=2, label="accept length (tokens / verify)")
    positions = sorted(
        {
            int(k[len("spec/accept_rate_pos") :])
            for r in rows
            for k in r
            if k.startswith("spec/accept_rate_pos")
        }
    )
    ax2 = ax.twinx()
    for i in positions:
        ax2.plot(steps, col(rows, f"spec/accept_rate_pos{i}"), label=f"P(draft {i + 1} accepted)", alpha=0.8)
    k = max(
        [int(r["spec/num_draft_tokens"]) for r in rows if r.get("spec/num_draft_tokens") is not None]
        + [len(positions)]
    )
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
        fig, (top, bottom) = plt.subplots(
            2,
            1,
            figsize=(7.5, 6.2),
            sharex=True,
            layout="constrained",
            gridspec_kw={"height_ratios": [1, 1.2]},
        )
    else:
        fig, top = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
        bottom = None
    k, values = 1, []
    for i, (name, rows) in enumerate(runs.items()):
        accept = col(rows, "spec/accept_length")
        values += [a for a in accept if a == a]
        k = max([k] + [int(r["spec/num_draft_tokens"]) for r in rows if r.get("spec/num_draft_tokens")])
        _plot_run(top, bottom, name, rows, accept, color=f"C{i}", smooth=smooth)
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


def _plot_run(
    top, bottom, name: str, rows: Sequence[dict[str, Any]], accept: list[float], *, color: str, smooth: int
) -> None:
    """One run of :func:`compare_acceptance_figure`: its acceptance on the top panel (and its watchdog
    fallbacks), on the zoomed ``bottom`` panel (None: none) raw, running mean and held-out tau."""
    steps = [int(r["step"]) for r in rows]
    top.plot(steps, accept, color=color, lw=1.2, label=name)
    if bottom is not None:
        bottom.plot(steps, accept, color=color, lw=0.6, alpha=0.45)
        bottom.plot(
            steps,
            running_mean(accept, smooth),
            color=color,
            lw=2.0,
            label=f"{name}: {smooth}-step running mean",
        )
        tau = [
            (int(r["step"]), r["draft/heldout_tau"]) for r in rows if r.get("draft/heldout_tau") is not None
        ]
        if tau:
            bottom.plot(*zip(*tau), color=color, ls="--", lw=0.9, label=f"{name}: held-out expected tau")
    fallback = [int(r["step"]) for r in rows if r.get("spec/watchdog") == "fallback"]
    if fallback:
        top.plot(
            fallback,
            [1.0] * len(fallback),
            "x",
            color=color,
            clip_on=False,
            label=f"{name}: watchdog fallback",
        )
