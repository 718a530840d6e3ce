"""Megatron policy vs transformers, across TP and DP sizes (torchrun, gloo).

See tests/dist_scripts/gpt_parity.py and dp_parity.py for what each launch asserts.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_torchrun

pytestmark = pytest.mark.dist


NAMES = ["llama_sharded", "llama_tied_rope_scaling", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def parity_runs(hf_checkpoints, tmp_path_factory):
    """One launch per TP size over every checkpoint: {tp: (log, out dir)}."""
    runs = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"parity_tp{tp}")
        runs[tp] = (
            run_torchrun("gpt_parity.py", tp, str(tp), str(out), *(hf_checkpoints[n] for n in NAMES)),
            out,
        )
    return runs


@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_logits_logprobs_tp1_tp2(parity_runs, name):
    """Bit-exact HF round trip, logits within 1e-5 of transformers, log-probs TP2 == TP1 (1e-6)."""
    lp = {}
    for tp, (log, out) in parity_runs.items():
        assert f"OK {name} tp={tp}" in log
        lp[tp] = torch.load(out / f"{name}.pt")["logprobs"]
    assert (lp[1] - lp[2]).abs().max().item() < 1e-6


def test_ddp_dp2_equals_dp1_on_concatenated_batch(hf_checkpoints, tmp_path):
    """Two AdamW steps with Megatron DDP: DP=2 on halves == DP=1 on the whole batch."""
    res = {}
    for n in (1, 2):
        path = tmp_path / f"dp{n}.pt"
        run_torchrun("dp_parity.py", n, hf_checkpoints["qwen3"], "1", str(path))
        res[n] = torch.load(path)
    for name, p1 in res[1]["params"].items():
        torch.testing.assert_close(res[2]["params"][name], p1, rtol=0, atol=2e-6, msg=name)
    for name, g1 in res[1]["grads"].items():
        scale = g1.abs().max().clamp_min(1e-12)
        assert ((res[2]["grads"][name] - g1).abs().max() / scale).item() < 1e-5, name
