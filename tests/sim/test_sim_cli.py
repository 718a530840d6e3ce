"""``megatron-spec simulate``: JSON contract, sweep outputs, and non-zero exits with a reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spec.cli import main

BASE = ["simulate", "--model", "qwen3-8b", "--hardware", "gb200", "--num-gpus", "32", "--mode", "sync",
        "--num-draft-tokens", "3", "--accept-length", "2.7", "--k-max", "4"]


def test_prints_one_json_object_with_the_contract_keys(capsys):
    assert main(BASE) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    d = json.loads(out[0])
    for key in ("rollout_speedup", "e2e_speedup", "step_time_ar_s", "step_time_spec_s", "optimal_k"):
        assert key in d
    for stage in ("data", "prepare", "gen", "logprob", "train", "step"):
        assert stage in d["stages_ar"] and stage in d["stages_spec"]
    assert d["step_time_ar_s"] == pytest.approx(d["stages_ar"]["step"])
    assert d["calibration"]["fit_max_abs_rel_error"] <= 0.10


def test_accept_rates_and_async(capsys):
    args = [a for a in BASE if a not in ("--accept-length", "2.7")]
    args = [*args[:args.index("sync")], "async", *args[args.index("sync") + 1:]]
    assert main(args + ["--accept-rates", "0.8,0.6,0.4", "--policy-lag", "2", "--train-gpus", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "async" and d["policy_lag"] == 2 and "exposed_gen" in d["stages_spec"]
    assert d["accept_length"] == pytest.approx(2.8)


def test_sweep_prints_table_and_writes_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(BASE + ["--sweep", "--output", str(png), "--k-max", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split()[:4] == ["model", "hardware", "profile", "k"]
    assert any("<- best k" in line for line in out)
    assert any(line.startswith("per-step speedup tau x t_decode / t_spec (qwen3-8b on gb200") for line in out)
    summary = json.loads(out[-1])
    assert set(summary["stops_paying_at_batch"]["qwen3-8b@gb200"]) == {"1", "2", "3"}
    assert summary["sweep_png"] == str(png) and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("change, message", [
    ({"--model": "qwen3-235b-a22b", "--hardware": "h100"}, "training qwen3-235b-a22b needs at least"),
    ({"--num-draft-tokens": "0"}, "must be >= 1"),
    ({"--accept-length": "5.0"}, "impossible with k=3"),
    ({"--model": "mystery-7b"}, "unknown model 'mystery-7b'"),
])
def test_impossible_configs_exit_non_zero_with_the_reason(change, message, capsys):
    args = list(BASE)
    for flag, value in change.items():
        args[args.index(flag) + 1] = value
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "megatron-spec simulate: error:" in err and message in err


def test_pinned_layout_that_does_not_fit_names_the_memory(capsys):
    args = [*BASE, "--tp", "1", "--ep", "1"]
    args[args.index("qwen3-8b")] = "qwen3-235b-a22b"
    args[args.index("32")] = "256"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "qwen3-235b-a22b does not fit: 471.1 GB of bf16 weights per device with tp=1 ep=1" in err


def test_no_layout_fits_says_so(capsys):
    args = list(BASE)
    args[args.index("qwen3-8b")] = "deepseek-v3"
    args[args.index("gb200")] = "h100"
    args[args.index("32")] = "8"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no rollout engine layout fits 'deepseek-v3' on 8 h100 generation GPUs" in err


def test_issue_example_prints_a_layout_and_sync_and_async_projections(capsys):
    """The command of issue 19, without --tp/--ep."""
    args = [
        "simulate",
        "--model",
        "qwen3-235b-a22b",
        "--hardware",
        "gb200",
        "--num-gpus",
        "512",
        "--mode",
        "sync",
        "--draft-kind",
        "eagle3",
        "--num-draft-tokens",
        "3",
        "--accept-length",
        "3",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert "megatron-spec simulate: sync: layout (MoE" in captured.err
    assert "megatron-spec simulate: async: layout (MoE" in captured.err
    lay = d["layout"]
    assert lay["spec"]["engines"] * lay["spec"]["devices_per_engine"] == 512
    fitting = [c for c in lay["candidates"] if c["fits"]]
    # the MoE choice is the throughput optimum of each mode over every fitting candidate
    assert lay["spec"]["gen_spec_s"] == pytest.approx(min(c["gen_spec_s"] for c in fitting), abs=1e-3)
    assert lay["ar"]["gen_ar_s"] == pytest.approx(min(c["gen_ar_s"] for c in fitting), abs=1e-3)
    assert any(not c["fits"] and "does not fit" in c["reason"] for c in lay["candidates"])  # tp=ep=1: 471 GB
    sync, async_ = d["projections"]["sync"], d["projections"]["async"]
    assert sync["gen_gpus"] == 512 and async_["gen_gpus"] + async_["train_gpus"] == 512
    assert async_["train_gpus"] == 128 and async_["policy_lag"] == 1
    for proj in (sync, async_):
        assert proj["rollout_speedup"] > 1.0 and proj["e2e_speedup"] > 1.0
        assert proj["layout_spec"]["engines"] * proj["layout_spec"]["devices_per_engine"] == proj["gen_gpus"]
    assert d["rollout_speedup"] == pytest.approx(sync["rollout_speedup"])


def test_rollout_num_engines_and_tensor_parallel_size_pin_the_layout(capsys):
    args = [*BASE, "--rollout-num-engines", "4", "--rollout-tensor-parallel-size", "2"]
    assert main(args) == 0
    eng = json.loads(capsys.readouterr().out)["engine"]
    assert (eng["engines"], eng["tp"], eng["gen_gpus"], eng["rollouts_per_engine"]) == (4, 2, 8, 4096 // 4)


def test_rates_outside_unit_interval(capsys):
    args = [a for a in BASE if a not in ("--accept-length", "2.7")] + ["--accept-rates", "0.9,1.4,0.2"]
    assert main(args) == 2
    assert "outside [0, 1]" in capsys.readouterr().err


def test_unknown_hardware_is_refused_by_argparse(capsys):
    args = list(BASE)
    args[args.index("--hardware") + 1] = "tpu"
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_console_entry_exits_non_zero():
    args = list(BASE)
    args[args.index("--accept-length") + 1] = "9"
    proc = subprocess.run([sys.executable, "-m", "megatron_spec", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "impossible" in proc.stderr and proc.stdout == ""


def test_missing_required_flags(capsys):
    assert main(["simulate", "--model", "qwen3-8b", "--hardware", "gb200", "--num-draft-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "--num-gpus" in err and "--accept-length or --accept-rates" in err


def test_validate_engine_bench_needs_only_the_file(tmp_path, capsys):
    bench = {"hardware": "cpu", "model": "qwen3-0.6b", "dtype": "bfloat16", "draft_kind": "ngram",
             "prompt_len": 16, "max_new_tokens": 32,
             "results": [{"batch_size": 2, "ar_tokens_per_s": 10.0,
                          "spec": [{"k": 2, "accept_length": 1.8, "tokens_per_s": 14.0}]}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert main(["simulate", "--validate-engine-bench", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["measured_speedup"] == pytest.approx(1.4) and out["tolerance"] == 0.2
