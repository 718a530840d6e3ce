"""The step's speculation metrics under the names NeMo-RL's and SkyRL's dashboards read."""

from __future__ import annotations

import io
import time

import pytest

from megatron_spec.rl.step_records import dashboard_spec_metrics
from megatron_spec.rollout.types import GenerateStats


def test_dashboard_names_count_drafts_tokens_and_1_based_positions():
    st = GenerateStats(num_draft_tokens=3)
    for accepted, drafted in ((3, 3), (1, 3), (0, 3), (2, 2)):  # four request-steps that drafted
        st.add_step_k(drafted)
        st.add_spec_step(accepted, 3)
    st.add_step_k(0)  # a plain request-step (adaptive k = 0): no draft, not counted as one
    m = dashboard_spec_metrics(st)
    assert m["spec/num_drafts"] == m["vllm/spec_num_drafts"] == 4
    assert (
        m["spec/drafted_tokens"]
        == m["vllm/spec_num_draft_tokens"]
        == m["vllm/train/draft_num_draft_tokens"]
        == 11
    )
    assert m["spec/accepted_tokens"] == m["vllm/spec_num_accepted_tokens"] == 6
    assert m["spec/acceptance_rate"] == m["vllm/spec_acceptance_rate"] == pytest.approx(6 / 11)
    assert m["vllm/train/draft_acceptance_rate"] == pytest.approx(6 / 11)
    assert (
        m["vllm/spec_acceptance_length"] == m["vllm/train/draft_mean_acceptance_length"] == pytest.approx(2.5)
    )
    # position 1 is the first draft token: accepted in 3 of the 4 drafts (our spec/accept_rate_pos0)
    assert [m[f"vllm/spec_acceptance_rate-pos-{p}"] for p in (1, 2, 3)] == pytest.approx([0.75, 0.5, 0.25])
    assert [m[f"vllm/train/draft_acceptance_rate_pos_{p}"] for p in (1, 2, 3)] == st.accept_rate_per_position
    assert "vllm/spec_acceptance_rate-pos-0" not in m and "vllm/spec_acceptance_rate-pos-4" not in m


def test_without_draft_lengths_every_draft_is_k_tokens_and_no_drafts_no_keys():
    st = GenerateStats(num_draft_tokens=4)  # a backend that reports acceptance per step only (SGLang's)
    st.add_spec_step(2, 4)
    st.add_spec_step(4, 4)
    m = dashboard_spec_metrics(st)
    assert m["spec/drafted_tokens"] == 8 and m["spec/accepted_tokens"] == 6
    assert dashboard_spec_metrics(GenerateStats(num_draft_tokens=3)) == {}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_generation_bar_follows_samples_done_on_a_terminal_only():
    """The engines' ``on_progress(samples done)`` drives the bar; not a terminal (a log file), or disabled
    (rank > 0, --quiet): nothing is written."""
    from megatron_spec.telemetry import generation_bar

    tty = _Terminal()
    with generation_bar(8, delay_s=0.0, file=tty) as on_progress:
        for done in (1, 4, 8):
            time.sleep(0.15)  # past tqdm's refresh interval
            on_progress(done)
    assert "8/8" in tty.getvalue() and "generating" in tty.getvalue()
    for file, enabled in ((io.StringIO(), True), (_Terminal(), False)):
        with generation_bar(8, delay_s=0.0, file=file, enabled=enabled) as on_progress:
            on_progress(8)
        assert file.getvalue() == ""
