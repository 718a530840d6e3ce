"""Digest-consistency checks (engines that hash their own layout) and the acceptance watchdog."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from megatron_spec.rl.watchdog import AcceptanceWatchdog, Action
from megatron_spec.sync.fingerprint import fingerprint_tensors
from megatron_spec.sync.verify import DigestLedger, WeightSyncError, check_untouched

A = fingerprint_tensors([torch.ones(3)])
B = fingerprint_tensors([torch.zeros(3)])


def test_ledger_accepts_consistent_digests():
    led = DigestLedger()
    led.check("target", A, before="d0", after="dA")
    led.check("target", B, before="dA", after="dB")
    led.check("target", A, before="dB", after="dA")  # the same content again: the same digest


def test_ledger_catches_a_dropped_update():
    led = DigestLedger()
    led.check("draft", A, before="d0", after="dA")
    with pytest.raises(
        WeightSyncError, match="draft weight sync failed: .*older version \\(update dropped\\)"
    ):
        led.check("draft", B, before="dA", after="dA")
    with pytest.raises(WeightSyncError, match="draft weight sync failed: engine digest did not change"):
        DigestLedger().check("draft", B, before="d0", after="d0")  # start-up weights unknown


def test_ledger_catches_stale_and_partial_contents():
    led = DigestLedger()
    led.check("target", A, before=None, after="dA")
    led.check("target", B, before="dA", after="dB")
    with pytest.raises(WeightSyncError, match="equals that of weights sent earlier"):
        led.check("target", fingerprint_tensors([torch.full((3,), 2.0)]), before=None, after="dA")
    with pytest.raises(WeightSyncError, match="differs from the last time these exact weights"):
        led.check("target", A, before="dB", after="dPartial")


def test_unchanged_digest_on_first_sync_is_resolved_by_the_startup_weights():
    led = DigestLedger()
    led.check("target", A, before="d0", after="d0", startup_fingerprint=lambda: A)  # identical to start-up
    with pytest.raises(WeightSyncError, match="did not change"):
        DigestLedger().check("target", A, before="d0", after="d0", startup_fingerprint=lambda: B)
    with pytest.raises(WeightSyncError, match="did not change"):
        DigestLedger().check("target", A, before="d0", after="d0", startup_fingerprint=lambda: None)


def test_untouched_group():
    check_untouched(
        "draft",
        ("d1", {"digest": "x"}),
        {"draft_weight_version": "d1", "checksums": {"draft": {"digest": "x"}}},
    )
    # released
    check_untouched("draft", ("d1", {"digest": "x"}), {"draft_weight_version": None, "checksums": {}})
    with pytest.raises(WeightSyncError, match="draft weight sync failed: changed while the other group"):
        check_untouched("draft", ("d1", {"digest": "x"}),
                        {"draft_weight_version": "d1", "checksums": {"draft": {"digest": "y"}}})


def test_watchdog_warns_once_then_keeps_advising(caplog):
    wd = AcceptanceWatchdog(window=3, fallback=False)
    with caplog.at_level(logging.WARNING, logger="megatron_spec.rl.watchdog"):
        # 1.08 after 1.25 is not sudden (gain 0.08 > a quarter of 0.25): the window of 3 applies
        actions = [wd.observe(a) for a in (1.25, 1.08, 1.0, 1.05, 1.0, 1.01)]
    assert actions == [Action.OK, Action.OK, Action.OK, Action.WARN, Action.WARN, Action.WARN]
    assert sum("acceptance collapsed" in r.message for r in caplog.records) == 1
    assert wd.observe(1.9) is Action.OK and wd.streak == 0  # one healthy step resets it
    assert json.dumps({"spec/watchdog": Action.WARN}) == '{"spec/watchdog": "warn"}'


def test_watchdog_fallback_and_arguments():
    wd = AcceptanceWatchdog(window=2, fallback=True, threshold=1.2)
    assert [wd.observe(a) for a in (1.15, 1.2)] == [Action.OK, Action.FALLBACK]
    with pytest.raises(ValueError, match="window must be >= 1"):
        AcceptanceWatchdog(window=0)
    with pytest.raises(ValueError, match="accept length"):
        AcceptanceWatchdog(threshold=0.5)
    with pytest.raises(ValueError, match="must be a number"):
        wd.observe(float("nan"))


def test_watchdog_falls_back_at_once_on_a_sudden_collapse(caplog):
    wd = AcceptanceWatchdog(window=3, fallback=True)
    with caplog.at_level(logging.WARNING, logger="megatron_spec.rl.watchdog"):
        actions = [wd.observe(a) for a in (3.6, 3.5, 3.62, 1.03, 1.0, 1.0)]
    # healthy gain ~2.57 tokens; 0.03 is below a quarter of it: the first collapsed step acts
    assert actions == [Action.OK] * 3 + [Action.FALLBACK] * 3
    assert sum("fell to 1.030 from 3.573" in r.message for r in caplog.records) == 1
    assert wd.observe(2.0) is Action.OK and wd.streak == 0 and not wd.tripped
    # without fallback the same collapse warns on its first step
    warn = AcceptanceWatchdog(window=3)
    assert [warn.observe(a) for a in (2.2, 1.0)] == [Action.OK, Action.WARN]


def test_watchdog_keeps_its_window_for_slow_decay():
    wd = AcceptanceWatchdog(window=3, fallback=True)
    # a gradual fall: the first collapsed step (1.09, gain 0.09) is above a quarter of the recent
    # healthy gain (mean of 1.45, 1.3, 1.18 -> 0.31; a quarter 0.078): not sudden, the window applies
    decay = (1.6, 1.45, 1.3, 1.18, 1.09, 1.06, 1.04, 1.03)
    assert [wd.observe(a) for a in decay] == [Action.OK] * 6 + [Action.FALLBACK] * 2
    # no healthy step seen yet (a draft that never worked): the window applies too
    cold = AcceptanceWatchdog(window=3, fallback=True)
    assert [cold.observe(a) for a in (1.0, 1.0, 1.0)] == [Action.OK, Action.OK, Action.FALLBACK]
    # a single noisy dip that is not a collapse to ~1 never acts, however steep
    noisy = AcceptanceWatchdog(window=3, fallback=True)
    assert [noisy.observe(a) for a in (3.6, 1.2, 3.5)] == [Action.OK] * 3
    # a step that verified no draft (None) is no evidence: the streak stands, the verdict repeats
    idle = AcceptanceWatchdog(window=2, fallback=True)
    assert [idle.observe(a) for a in (1.3, None, 1.2, None, 1.09, None)] == [Action.OK] * 6
    assert idle.streak == 1 and idle.observe(1.0) is Action.FALLBACK and idle.observe(None) is Action.FALLBACK
    # the immediate path can be switched off: windowed only
    windowed = AcceptanceWatchdog(window=2, fallback=True, sudden_fraction=-1)
    assert [windowed.observe(a) for a in (3.6, 1.0, 1.0)] == [Action.OK, Action.OK, Action.FALLBACK]
    with pytest.raises(ValueError, match="sudden_fraction must be < 1"):
        AcceptanceWatchdog(sudden_fraction=1.0)


@pytest.mark.dist
def test_corrupted_draft_update_falls_back_within_one_step(setup, tmp_path):
    """In the GRPO loop: the online draft's update of step 2 is corrupted (``corrupt_draft=2``);
    step 3 drafts with it and its acceptance collapses, the watchdog (window 3) says fallback on
    step 3's row, and step 4 decodes without drafts."""
    from tests.rl.test_grpo_e2e import grpo, metrics

    run = tmp_path / "run"
    grpo(setup, run, "--train-iters", "4", "--rollout-temperature", "0", "--rollout-dtype", "float32",
         "--rollout-max-new-tokens", "24", "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3,
         "--spec-online-draft-training", "--spec-watchdog-steps", "3", "--spec-watchdog-fallback",
         env={"MEGATRON_SPEC_FAULTS": "corrupt_draft=2", "MEGATRON_SPEC_FAULTS_DIR": str(tmp_path)})
    m = metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    # steps 1-2: the ModelOpt draft (then its online updates) works, greedy
    assert all(r["spec/accept_length"] > 1.3 and r["spec/watchdog"] == "ok" for r in m[:2]), m[:2]
    # step 3 drafts with the corrupted update: acceptance collapses, the watchdog acts on this row
    # although its window is 3 steps (a sudden collapse)
    assert m[2]["spec/accept_length"] < 1.05 and m[2]["spec/num_draft_tokens"] == 3, m[2]
    assert m[2]["spec/watchdog"] == "fallback"
    # step 4 decodes without drafts: no speculative verify step at all
    assert m[3]["spec/accept_length"] == 1.0 and m[3]["spec/tokens_per_verify"] == 1.0, m[3]
    assert (
        m[3]["spec/num_draft_tokens"] == 0
        and "spec/accept_rate_pos0" not in m[3]
        and "spec/k_mean" not in m[3]
    )
    assert m[3]["spec/watchdog"] == "fallback"
    assert (tmp_path / "fired-corrupt_draft").exists()
