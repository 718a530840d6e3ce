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
    assert (
        "reward: 0.150 (first 2 steps) -> 0.950 (last 2 steps); mean over 4 prompts x 2 samples per step"
        in summary
    )
    assert "after steps 0, 5, 10: 0.250 -> 0.500 -> 0.750" in summary
    assert "acceptance length: 3.00" in summary


def test_report_gives_held_out_standard_errors_and_the_lift_in_them(tmp_path):
    rows = [_row(s) for s in range(1, 5)]
    rows[0].update({"eval/reward": 0.25, "eval/reward_se": 0.03, "eval/prompts": 128})
    rows[-1].update({"eval_final/reward": 0.75, "eval_final/reward_se": 0.04, "eval_final/prompts": 128})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("grpo:\n  prompts_per_step: 4\n  grpo_group_size: 2\n")
    summary = open(write_report(str(tmp_path))["summary"]).read()
    # the difference's standard error: hypot(0.03, 0.04) = 0.05, so +0.5 is 10 of them
    assert "after steps 0, 4: 0.250 ± 0.030 -> 0.750 ± 0.040 (lift +0.500 = +10.0 standard errors)" in summary


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

    from megatron_spec.rl.report_figures import acceptance_figure

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
            "accept length (tokens / verify)",
            "P(draft 1 accepted)",
            "P(draft 2 accepted)",
            "P(draft 3 accepted)",
        ]
    finally:
        plt.close(fig)


def _write_run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_compare_plots_two_speculative_runs_on_one_figure(tmp_path):
    # online: 3.5 rising to 3.7 over 100 steps, draft trained (draft/step); frozen: 3.6 falling to 3.5
    online = [_row(s, **{"spec/accept_length": 3.5 + 0.002 * s, "draft/step": float(s),
                         "draft/heldout_tau": 3.5 + 0.002 * s}) for s in range(1, 101)]
    frozen = [_row(s, **{"spec/accept_length": 3.6 - 0.001 * s}) for s in range(1, 101)]
    for r in frozen:
        r.pop("draft/loss")
    frozen[-1].update({"spec/accept_length": 1.0, "spec/watchdog": "fallback"})
    a, b = _write_run(tmp_path / "online", online), _write_run(tmp_path / "frozen", frozen)
    files = write_report(a, compare_dir=b)
    data = open(files["acceptance_compare"], "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    summary = open(files["summary"]).read()
    # fifths of 100 steps: 20 each; online first = 3.5 + 0.002 * 10.5, last = 3.5 + 0.002 * 90.5
    assert "## Acceptance length per step: online draft vs frozen draft" in summary
    assert "| online draft | 100 | 3.521 | 3.681 | 3.601 | 3.502 | 1.000 |" in summary
    frozen_last = (sum(3.6 - 0.001 * s for s in range(81, 100)) + 1.0) / 20
    assert f"| frozen draft | 100 | 3.590 | {frozen_last:.3f} |" in summary
    assert f"| {frozen_last / 3.681:.3f} |" in summary
    # the figure: both runs, the held-out tau, the fallback marker; full scale on top
    from megatron_spec.rl.report_figures import compare_acceptance_figure

    fig = compare_acceptance_figure({"online draft": online, "frozen draft": frozen}, zoom=True)
    top, zoom = fig.axes
    assert top.get_ylim()[0] == 1.0 and 4.0 <= top.get_ylim()[1] < 4.2
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "online draft", "frozen draft", "frozen draft: watchdog fallback"]
    assert "online draft: held-out expected tau" in [t.get_text() for t in zoom.get_legend().get_texts()]
    # by default a run that fell back leaves no zoomed panel (nothing to zoom into)
    assert len(compare_acceptance_figure({"online draft": online, "frozen draft": frozen}).axes) == 1
    assert len(compare_acceptance_figure({"online draft": online}).axes) == 2
    # the same kind twice: named by directory; explicit labels win; bad input is named
    files = write_report(b, compare_dir=b)
    assert "frozen draft (frozen) vs frozen draft (frozen)" in open(files["summary"]).read()
    files = write_report(a, compare_dir=b, labels=("lr 3e-4", "ModelOpt"))
    assert "| lr 3e-4 | 100 |" in open(files["summary"]).read()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(a, compare_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="labels names the two compared runs"):
        write_report(a, compare_dir=b, labels=("one",))


def test_report_command_compare_flags(tmp_path, capsys):
    from megatron_spec.commands import report as cmd

    a = _write_run(tmp_path / "a", [_row(s, **{"draft/step": float(s)}) for s in range(1, 6)])
    b = _write_run(tmp_path / "b", [_row(s) for s in range(1, 6)])
    import argparse

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    assert cmd.run(p.parse_args([a, "--compare", b, "--labels", "online,frozen"])) == 0
    assert "acceptance_compare:" in capsys.readouterr().out
    assert cmd.run(p.parse_args([a, "--labels", "online,frozen"])) == 2
    assert "--labels takes two names, THIS,OTHER, and needs --compare" in capsys.readouterr().err


def test_report_shows_which_source_drafted_per_step(tmp_path):
    """Steps with EAGLE-3, the live group index and the history: a table per step (accepted drafted
    tokens, acceptance length) and a stacked-bar figure; a run without source metrics has neither."""
    rows = [_row(1, **{"spec/source_steps/eagle3": 100, "spec/source_tokens/eagle3": 150,
                       "spec/source_steps/live": 20, "spec/source_tokens/live": 60}),
            _row(2, **{"spec/source_steps/eagle3": 80, "spec/source_tokens/eagle3": 120,
                       "spec/source_steps/history": 10, "spec/source_tokens/history": 5})]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = write_report(str(tmp_path))
    assert open(files["draft_sources"], "rb").read()[:4] == b"\x89PNG"
    summary = open(files["summary"]).read()
    assert "| step | eagle3 | live group | history |" in summary
    assert "| 1 | 150 (2.50) | 60 (4.00) | - |" in summary
    assert "| 2 | 120 (2.50) | - | 5 (1.50) |" in summary
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    assert "draft_sources" not in write_report(str(plain))
