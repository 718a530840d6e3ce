"""Policy isolation under torchrun (gloo): capture + online draft training on vs off, TP=1 (DP=2) and TP=2.

What each launch asserts is in tests/dist_scripts/draft_isolation.py (bit-identical policy
gradients and parameters, autograd-graph walks, SP gather). Here the two layouts, which see the
same global batch, must also agree on what was captured and on the trained draft weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.models.tiny import make_hf_checkpoint
from tests.dist_utils import run_torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    ckpt = make_hf_checkpoint(
        root / "target",
        family="qwen3",
        num_layers=5,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=31,
        init_std=0.05,
    )
    out = {}
    for tp in (1, 2):
        prefix = str(root / f"tp{tp}")
        log = run_torchrun("draft_isolation.py", 2, ckpt, str(tp), prefix)
        assert f"OK tp={tp} dp={2 // tp}" in log
        out[tp] = {
            "drafts": torch.load(f"{prefix}.drafts.pt"),
            "ranks": [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)],
        }
    return out


def test_policy_bit_identical_at_tp1_and_tp2(layouts):
    assert set(layouts) == {1, 2}  # each launch asserted bit-identity on every rank


def test_tp_sharded_capture_covers_the_batch_once(layouts):
    """TP=2 keeps every other segment per rank; together they are what DP=2 x TP=1 captured."""

    def segments(rank_state):
        c = rank_state["cache"]
        cu = c["cu_seqlens"].tolist()
        return [
            {
                k: c[k][cu[i] : cu[i + 1]]
                for k in (
                    "tokens",
                    "aux",
                    "teacher_ids",
                    "teacher_logprobs",
                    "teacher_log_mass",
                    "next_logprobs",
                )
            }
            for i in range(len(cu) - 1)
        ]

    dp_layout = segments(layouts[1]["ranks"][0]) + segments(layouts[1]["ranks"][1])  # sequences 0,1 | 2,3
    r0, r1 = segments(layouts[2]["ranks"][0]), segments(layouts[2]["ranks"][1])
    assert len(r0) == len(r1) == 2
    tp_layout = [r0[0], r1[0], r0[1], r1[1]]  # round robin over TP ranks
    for a, b in zip(dp_layout, tp_layout):
        assert torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["teacher_ids"], b["teacher_ids"])
        torch.testing.assert_close(a["teacher_logprobs"], b["teacher_logprobs"], atol=1e-5, rtol=0)
        # TP reductions
        torch.testing.assert_close(a["teacher_log_mass"], b["teacher_log_mass"], atol=1e-5, rtol=0)
        assert torch.all(a["teacher_log_mass"] < 0)  # a reduced draft vocabulary holds part of the mass
        torch.testing.assert_close(a["next_logprobs"], b["next_logprobs"], atol=1e-5, rtol=0)  # the same pass
        torch.testing.assert_close(a["aux"], b["aux"], atol=1e-5, rtol=0)


def test_draft_training_agrees_across_layouts(layouts):
    """EAGLE-3 trained over the world group and MTP over DP=2 (TP=1) or TP=2 (DP=1): same weights."""
    for kind in ("eagle", "mtp"):
        a, b = layouts[1]["drafts"][kind], layouts[2]["drafts"][kind]
        assert set(a) == set(b)
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=0, msg=f"{kind} {name}")
