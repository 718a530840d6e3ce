"""``megatron-spec report``: plots and summary from a run's metrics, and the start/end windows."""

from __future__ import annotations

import json
import math

import pytest

from megatron_spec.rl.report import write_report
from megatron_spec.telemetry import start_end_means


def test_start_end_means_are_fifth_windows():
    rows = [{"r": float(i)} for i in range(10)]  # windows of 2 rows
    assert start_end_means(rows, "r") == (0.5, 8.5, 2)
    assert start_end_means(rows[:3], "r") == (0.0, 2.0, 1)  # at least one row each
    start, end, w = start_end_means([{"r": None}, {"r": 4.0}], "r")
    assert math.isnan(start) and end == 4.0 and w == 1


def _row(step: int, **extra) -> dict:
    row = {"step": step, "policy_version": step, "reward/mean": 0.1 * step, "reward/std": 0.1,
           "spec/accept_length": 3.0, "spec/num_draft_tokens": 3, "spec/accept_rate_pos0": 0.9,
           "draft/loss": 1.0, "mismatch/logprob_abs_diff_mean": 1e-3, "mismatch/logprob_abs_diff_max": 1e-2,
           "sync/bytes": 2.0 ** 20, "sync/seconds": 0.1, "mem/rss_mb": 100.0 + step,
           "time/gen": 1.0, "time/prepare": 0.1, "time/logprob": 0.3, "time/train": 1.5, "time/data": 0.0,
           "time/reward": 0.0, "time/step": 2.9}
    row.update(extra)
    return row


def test_report_writes_plots_and_a_summary_with_windows_and_held_out(tmp_path):
    rows = [_row(s) for s in range(1, 11)]
    rows[0].update({"eval/reward": 0.25, "eval/prompts": 16})
    rows[5].update({"eval/reward": 0.5, "eval/prompts": 16})
    rows[-1].update({"eval_final/reward": 0.75, "eval_final/prompts": 16})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("grpo:\n  prompts_per_step: 4\n  grpo_group_size: 2\n")
    files = write_report(str(tmp_path))
    for name in ("reward", "acceptance", "stage_times", "step_time"):
        data = open(files[name], "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    summary = open(files["summary"]).read()
    assert "- steps: 10 (policy version 10)" in summary
    assert "reward: 0.150 (first 2 steps) -> 0.950 (last 2 steps); mean over 4 prompts x 2 samples per step" in summary
    assert "after steps 0, 5, 10: 0.250 -> 0.500 -> 0.750" in summary
    assert "acceptance length: 3.00" in summary


def test_report_names_a_missing_or_empty_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no step records"):
        write_report(str(tmp_path))


def test_acceptance_axis_starts_at_one_and_the_legend_is_off_the_lines():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_spec.rl.report import acceptance_figure

    # accept length wanders in 3.50-3.66 (noise): the axis is 1 .. k+1 = 4, not zoomed to the data
    rows = [_row(s, **{"spec/accept_length": 3.5 + 0.16 * (s % 2), "spec/accept_rate_pos1": 0.8,
                       "spec/accept_rate_pos2": 0.7}) for s in range(1, 11)]
    fig = acceptance_figure(rows)
    try:
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        assert low == 1.0 and 4.0 <= high < 4.2
        assert ax.get_legend() is None and len(fig.legends) == 1
        fig.canvas.draw()
        legend_box = fig.legends[0].get_window_extent()
        assert not legend_box.overlaps(ax.get_window_extent())  # below the axes, never over a line
        assert [t.get_text() for t in fig.legends[0].get_texts()] == [
            "accept length (tokens / verify)", "P(draft 1 accepted)", "P(draft 2 accepted)", "P(draft 3 accepted)"]
    finally:
        plt.close(fig)
