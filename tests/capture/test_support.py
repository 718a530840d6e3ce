"""Vocab-parallel support masks (top-k / top-p / min-p) against process_logits, TP=1 and TP=2."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_torchrun


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2])
def test_support_mask_and_logprobs_match_process_logits(tp):
    assert f"OK tp={tp}" in run_torchrun("support_parity.py", tp, str(tp))
