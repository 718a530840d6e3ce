"""``megatron-spec generate`` as a user meets it: output rows with text, clean errors for bad input."""

from __future__ import annotations

import json

import pytest

from megatron_spec.cli import main
from megatron_spec.models.tiny import make_hf_checkpoint
from tests.sync.conftest import random_eagle3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_spec.draft.modelopt_io import save_eagle3
    from megatron_spec.models.hf_config import DecoderConfig

    root = tmp_path_factory.mktemp("generate_cli")
    small = dict(
        family="qwen3", num_layers=1, intermediate_size=64, num_attention_heads=2, num_kv_heads=1, seed=3
    )
    target = make_hf_checkpoint(root / "target", hidden_size=32, **small)
    other = make_hf_checkpoint(root / "other", hidden_size=48, **small)
    save_eagle3(random_eagle3(DecoderConfig.from_pretrained(other), 5), root / "eagle3_other")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "12+3="})
        + "\n"
        + json.dumps({"id": "b", "input_ids": [5, 6]})
        + "\n"
    )
    return {"target": str(target), "eagle3_other": str(root / "eagle3_other"), "prompts": str(prompts)}


def _generate(models, out, *extra):
    return main(
        [
            "generate",
            "--model",
            models["target"],
            "--prompts",
            models["prompts"],
            "--output",
            str(out),
            "--max-new-tokens",
            "4",
            "--num-threads",
            "1",
            "--no-progress",
            *extra,
        ]
    )


def test_rows_carry_ids_logprobs_and_decoded_text(models, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert _generate(models, out, "--n", "2", "--ignore-eos") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["target"])
    for r in rows:
        assert len(r["output_ids"]) == len(r["logprobs"]) == 4
        assert r["text"] == tok.decode(r["output_ids"], skip_special_tokens=True)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_tokens"] == 16


def test_a_draft_for_another_model_is_one_error_line(models, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert _generate(models, out, "--draft-kind", "eagle3", "--draft-path", models["eagle3_other"]) == 2
    err = capsys.readouterr().err
    assert "megatron-spec generate: error:" in err and "hidden_size 48 != target hidden_size 32" in err
    assert "Traceback" not in err and not out.exists()


def test_a_prompt_longer_than_the_context_is_one_error_line(models, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert _generate(models, out, "--context-length", "5") == 2
    err = capsys.readouterr().err
    assert "exceeds the engine context of 5" in err and "Traceback" not in err and not out.exists()


def test_a_prompt_longer_than_the_model_is_refused_before_the_engine_starts(models, tmp_path, capsys):
    """Issue 28: a 5000-token prompt on a model with 512 positions ran without a word, its cache sized from
    the prompt instead of the model."""
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "input_ids": [5] * 5000}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", models["target"], "--prompts", str(long), "--output", str(out),
                 "--max-new-tokens", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "prompt 'long' has 5000 tokens" in err[0] and "the model's context of 512" in err[0]
    )
    assert not out.exists()


def test_n_above_the_batch_size_is_served_in_batches(models, tmp_path, capsys):
    """Issue 28: the engine's batch was sized to n (n=10000 on the real model got the engine killed for
    memory);
    n samples now run in batches of --batch-size, numbered 0..n-1 under their prompt."""
    out = tmp_path / "out.jsonl"
    assert (
        _generate(models, out, "--n", "7", "--batch-size", "3", "--ignore-eos", "--temperature", "1.0") == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [(p, i) for p in "ab" for i in range(7)]
    assert all(len(r["output_ids"]) == 4 for r in rows)


def test_a_missing_model_directory_is_named(models, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    missing = str(tmp_path / "nonexistent")
    assert main(["generate", "--model", missing, "--prompts", models["prompts"], "--output", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    # one line naming the directory, not the symptom (a text prompt and no tokenizer)
    assert err.strip().splitlines() == [
        f"megatron-spec generate: error: --hf-checkpoint {missing}: no such directory "
        "(an HF checkpoint directory)"
    ]
    assert not out.exists()


def test_dtype_defaults_to_auto_and_the_summary_says_what_ran(models, tmp_path, capsys, monkeypatch):
    from megatron_spec import isa
    from megatron_spec.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--prompts", "p", "--output", "o"])
    assert args.rollout_dtype == "auto"
    # the no-native-bf16 switch: an explicit bfloat16 runs fp32 (one warning), auto picks fp32
    monkeypatch.setenv(isa.NO_NATIVE_BF16_ENV, "1")
    for asked in ("auto", "bfloat16"):
        assert _generate(models, tmp_path / f"{asked}.jsonl", "--dtype", asked) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["dtype"] == "float32"
        assert summary["cpu_capability"] == isa.probe().capability
