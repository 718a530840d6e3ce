"""What the run report reads from a run's metric rows (one dict per step, ``metrics.jsonl``).

A run's rows, one column with NaN where a step did not log the key, NaN-skipping and running means,
the held-out evaluations (``--eval-interval``), the draft sources a run names and the kind of draft it
used. It draws nothing and writes no Markdown (``rl/report_figures.py``, ``rl/report.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megatron_spec.telemetry import read_metrics

SOURCE_NAMES = {"live": "live group", "history": "history", "tree": "tree (draft + history)"}
"""The legend and table names of the draft sources that are not a model's name."""


def col(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """``key`` of every row as a float, NaN where the row has no value."""
    return [float(r[key]) if r.get(key) is not None else float("nan") for r in rows]


def mean(xs: Sequence[float]) -> float:
    """The mean of the values that are not NaN (NaN if none is)."""
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def running_mean(xs: Sequence[float], n: int) -> list[float]:
    """Per position, the NaN-skipping mean of the ``n`` values up to it."""
    out = []
    for i in range(len(xs)):
        out.append(mean(xs[max(0, i - n + 1) : i + 1]))
    return out


def read_run(run_dir: str) -> list[dict[str, Any]]:
    """The step records of ``run_dir/metrics.jsonl``; a missing or empty file is named."""
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


def distinct_labels(dir_a: str, rows_a, dir_b: str, rows_b) -> tuple[str, str]:
    """The two runs' :func:`run_label`, with their directories' names when the labels are the same."""
    a, b = run_label(rows_a), run_label(rows_b)
    if a == b:  # two runs of the same kind: name them by their directories too
        a, b = (f"{a} ({os.path.basename(os.path.normpath(d))})" for d in (dir_a, dir_b))
    return a, b


def draft_sources(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The draft sources a run's steps name (``spec/source_steps/<source>``: eagle3, mtp, model, ngram,
    history, live, tree), in order of first appearance."""
    out: list[str] = []
    for r in rows:
        for key in r:
            if key.startswith("spec/source_steps/") and key.split("/", 2)[2] not in out:
                out.append(key.split("/", 2)[2])
    return out


def evals(rows: list[dict]) -> list[tuple[int, float, float | None]]:
    """(steps trained, held-out reward, its standard error) of every evaluation (--eval-interval),
    the final one last; the standard error is None for a run from before ``eval/reward_se``."""
    out = [
        (int(r["step"]) - 1, r["eval/reward"], r.get("eval/reward_se"))
        for r in rows
        if r.get("eval/reward") is not None
    ]
    final = [r for r in rows if r.get("eval_final/reward") is not None]
    if final:
        out.append(
            (int(final[-1]["step"]), final[-1]["eval_final/reward"], final[-1].get("eval_final/reward_se"))
        )
    return out


def eval_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(steps trained, held-out reward) of every evaluation, the final one last."""
    return [(step, value) for step, value, _ in evals(rows)]
