"""One payload per engine TP rank, each from its own rank (torchrun, 2 ranks, gloo).

See tests/dist_scripts/forward_payloads.py: the owner's engine receives two payloads naming two
different buffers with equal tensors, loads the one rank 1 packed, and then scores like Megatron
(fp32, within 1e-5); an error of the owner's engine call fails the sync on both senders.
"""

from __future__ import annotations

import json

import pytest

from tests.dist_utils import run_torchrun

pytestmark = pytest.mark.dist


def test_each_sender_packs_its_own_payload(ckpts, tmp_path):
    out = tmp_path / "out.json"
    log = run_torchrun("forward_payloads.py", 2, ckpts.qwen3, ckpts.qwen3_other, str(out))
    assert "OK forward_payloads" in log
    res = json.loads(out.read_text())
    assert res["calls"] == res["buckets"] > 1
    assert res["max_abs"] < 1e-5
    assert all(t in ("WeightSyncError", "ForwardedCallError") for t in res["error_types"]), res
