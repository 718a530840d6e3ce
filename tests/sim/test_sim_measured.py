"""Measured forward times as the simulator's calibration points (``megatron_spec/sim/measured.py``).

A GPU run of ``benchmarks/measure_forward_costs.py`` (step 5 of scripts/gpu_check.sh) writes seconds per
verify forward keyed by (k, B); the roofline answers with them where they apply, moved to the forward's
context by its own difference, and alone elsewhere.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_spec.sim.hardware import get_hardware
from megatron_spec.sim.measured import measured_for
from megatron_spec.sim.models import get_model
from megatron_spec.sim.rl_step import SimConfig, build_step_model, simulate

H100 = get_hardware("h100")
MODEL = get_model("qwen3-8b")
CTX = 1024
# hand-picked seconds: B=1 -> 10 ms, B=4 -> 14 ms at k=0; k=3 twice that
VERIFY = {"0": {"1": 0.010, "4": 0.014}, "3": {"1": 0.020, "4": 0.028}}


def write_doc(path, hardware="h100", model="qwen3-8b", dtype="bfloat16") -> str:
    doc = {
        "hardware": hardware,
        "device": "NVIDIA H100 80GB HBM3",
        "commit": "abc",
        "measured_at": "now",
        "entries": [
            {
                "model": model,
                "dtype": dtype,
                "tp": 1,
                "ctx_per_seq": CTX,
                "verify_s": VERIFY,
                "eagle3_draft_pass_s": {"1": 0.001, "4": 0.002},
                "eagle3_extend_s": {"3": {"1": 0.003}},
            }
        ],
    }
    path.write_text(json.dumps(doc))
    return str(path)


def step_model(path, **kw):
    cfg = SimConfig(model="qwen3-8b", hardware="h100", num_gpus=8, mode="sync", tp=1, accept_length=2.5,
                    num_draft_tokens=3, measured_path=path, **kw)
    return build_step_model(cfg)


def test_the_measurement_holds_at_its_own_context(tmp_path):
    steps = step_model(write_doc(tmp_path / "m.json"))
    f = steps.target.forward(np.array([1.0, 4.0]), 1, np.array([1.0, 4.0]) * CTX, 0.002)
    assert f["measured"].all()
    np.testing.assert_allclose(f["total"], [0.010, 0.014], rtol=1e-12)
    f = steps.target.forward(4.0, 4, 4.0 * CTX, 0.002)  # k = 3 verifies 4 tokens per row
    np.testing.assert_allclose(f["total"], 0.028, rtol=1e-12)


def test_between_batch_sizes_log_interpolated_and_the_context_moves_it_by_the_roofline(tmp_path):
    steps = step_model(write_doc(tmp_path / "m.json"))
    f = steps.target.forward(2.0, 1, 2.0 * CTX, 0.0)
    np.testing.assert_allclose(f["total"], 0.012, rtol=1e-12)  # log2(2) is halfway from log2(1) to log2(4)
    longer = steps.target.forward(2.0, 1, 2.0 * 4 * CTX, 0.0)
    plain = (
        steps.target._roofline(2.0, 1, 2.0 * 4 * CTX, 0.0)["total"]
        - steps.target._roofline(2.0, 1, 2.0 * CTX, 0.0)["total"]
    )
    # the KV reads the roofline adds
    np.testing.assert_allclose(longer["total"] - f["total"], plain, rtol=1e-9)


@pytest.mark.parametrize("b, q", [(8.0, 1), (1.0, 2)])
def test_outside_the_measured_points_the_roofline_alone(tmp_path, b, q):
    steps = step_model(write_doc(tmp_path / "m.json"))
    f = steps.target.forward(b, q, b * CTX, 0.002)
    assert not f["measured"]
    np.testing.assert_allclose(f["total"], steps.target._roofline(b, q, b * CTX, 0.002)["total"])


@pytest.mark.parametrize("change", [{"hardware": "h200"}, {"model": "llama-3.1-8b"}, {"dtype": "float32"}])
def test_another_gpu_model_or_dtype_is_not_matched(tmp_path, change):
    path = write_doc(tmp_path / "m.json", **change)
    assert step_model(path).target.measured is None


def test_the_draft_uses_its_own_points_and_simulate_says_so(tmp_path):
    path = write_doc(tmp_path / "m.json")
    steps = step_model(path)
    np.testing.assert_allclose(steps.draft.forward(4.0, 1, 4.0 * CTX, 0.0)["total"], 0.002, rtol=1e-12)
    cfg = SimConfig(model="qwen3-8b", hardware="h100", num_gpus=8, mode="sync", tp=1, accept_length=2.5,
                    num_draft_tokens=3, measured_path=path)
    detail = simulate(cfg).detail
    assert detail["measured_points"]["verify"]["q"] == [1, 4]
    assert detail["measured_points"]["draft"]["batch"] == [1, 4]
    assert simulate(cfg.replace(measured_path=False)).detail["measured_points"] == {
        "verify": None,
        "draft": None,
    }


def test_tp_above_one_is_not_matched(tmp_path):
    from megatron_spec.sim.roofline import Parallelism

    assert (
        measured_for(MODEL, H100, "bf16", Parallelism(2, 1), "target", write_doc(tmp_path / "m.json")) is None
    )
