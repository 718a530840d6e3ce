"""Prompt data, rewards, synthetic tasks and the run configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import pytest

from megatron_spec.config import ConfigError, RunConfig, add_arguments, from_args
from megatron_spec.rl.data import PromptSampler, load_prompts
from megatron_spec.rl.rewards import Reward, RewardError, get_reward, score
from megatron_spec.rl.synthetic_tasks import corrupt_solution, final_answer, generate


def test_sum_task_solutions_are_correct_and_rewarded():
    for ex in generate("sum", 50, seed=3):
        terms = [int(t) for t in ex.prompt[:-1].split("+")]
        assert ex.answer == str(sum(terms))
        assert final_answer(ex.solution) == ex.answer
        assert get_reward("synthetic")(ex.prompt, ex.solution, ex.answer) == 1.0
        assert get_reward("synthetic")(ex.prompt, ex.solution + "1", ex.answer) == 0.0
    assert final_answer("3+4=7;7+1=8") is None


def test_corrupted_sum_solutions_slip_once_and_are_not_rewarded():
    """Noisy SFT targets (launch/sft_base.py --noisy-frac): same steps and format, the last
    step's result one too high, so the final answer is wrong and the reward 0."""
    import random

    rng = random.Random(0)
    for ex in generate("sum", 50, seed=4):
        bad = corrupt_solution(ex, rng)
        good_steps, bad_steps = ex.solution.split("#")[0].split(";"), bad.split("#")[0].split(";")
        assert len(good_steps) == len(bad_steps)
        slips = [i for i, s in enumerate(bad_steps)
                 if eval(s.split("=")[0]) != int(s.split("=")[1])]  # digits and + only
        assert slips == [len(bad_steps) - 1]
        assert int(final_answer(bad)) == int(ex.answer) + 1
        assert get_reward("synthetic")(ex.prompt, bad, ex.answer) == 0.0


def test_math_reward_uses_math_verify():
    math = get_reward("math")
    assert math("", "so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math("", "the answer is \\boxed{3}", "4") == 0.0


def test_math_reward_reads_a_bare_list_as_one_answer():
    # mathematics_dataset's comparison__sort answers: a bare list scored 0 even when identical
    math = get_reward("math")
    assert math("", "-80, -6, -1", "-80, -6, -1") == 1.0
    assert math("", " 37, 4, 3, -4, -26", "37, 4, 3, -4, -26") == 1.0
    assert math("", "-80, -6, -2", "-80, -6, -1") == 0.0
    assert math("", "5, 6", "5") == 0.0
    assert math("", "The answer is 5", "5") == 1.0


def test_reward_by_import_path_and_errors():
    assert get_reward("megatron_spec.rl.rewards:exact_reward")("", " a ", "a") == 1.0
    with pytest.raises(ValueError, match="neither a registered name"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_reward("megatron_spec.rl.rewards:missing")

    def boom(p, r, a):
        raise KeyError("x")

    with pytest.raises(RewardError, match="reward function 'boom' raised on sample 1"):
        score(
            Reward.of(lambda p, r, a: 1.0 if r == "ok" else boom(p, r, a), "boom"),
            ["p", "q"],
            ["ok", "bad"],
            ["a", "a"],
        )
    with pytest.raises(RewardError, match="returned nan"):
        score(Reward.of(lambda p, r, a: float("nan"), "nanny"), ["p"], ["r"], ["a"])


def test_reward_from_a_file_the_working_directory_metadata_and_batches(tmp_path, monkeypatch):
    """``path/file.py:fn``; ``module:fn`` from the working directory (torchrun does not put it on sys.path);
    the
    dataset's other columns as ``metadata``; a batched function gets the round's lists."""
    (tmp_path / "my_rewards.py").write_text(
        "def by_source(prompt, response, answer, metadata):\n"
        "    return float(response == answer) + (0.5 if metadata['data_source'] == 'gsm8k' else 0.0)\n"
        "def lengths(prompts, responses, answers):\n"
        "    return [len(r) for r in responses]\n"
        "lengths.batched = True\n"
        "def short(prompts, responses, answers):\n"
        "    return [1.0]\n"
        "short.batched = True\n"
        "def word(prompt, response, answer):\n"
        "    return 'yes'\n")
    r = get_reward(f"{tmp_path / 'my_rewards.py'}:by_source")
    assert r.wants_metadata and not r.batched
    meta = [{"data_source": "gsm8k"}, {"data_source": "math"}]
    assert score(r, ["p", "q"], ["7", "7"], ["7", "8"], meta) == [1.5, 0.0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    b = get_reward("my_rewards:lengths")
    assert b.batched and score(b, ["p", "q"], ["ab", "abc"], ["", ""]) == [2.0, 3.0]
    with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
        score(get_reward("my_rewards:short"), ["p", "q"], ["a", "b"], ["", ""])
    with pytest.raises(RewardError, match="returned 'yes' on sample 0, not a number"):
        get_reward("my_rewards:word")("p", "r", "a")
    with pytest.raises(ValueError, match="no such file"):
        get_reward("missing/rewards.py:fn")


def test_jsonl_and_parquet_prompt_sets(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    jl = tmp_path / "p.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(str(jl), cache_dir=str(tmp_path))
    assert [(e.prompt, e.answer) for e in got] == [(r["prompt"], r["answer"]) for r in rows]
    import datasets

    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    assert len(load_prompts(str(pq), cache_dir=str(tmp_path))) == 5
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_prompts(str(empty), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no column 'question'"):
        load_prompts(str(jl), prompt_key="question", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_sampler_is_resumable_and_covers_epochs():
    a = PromptSampler(7, seed=1)
    first = a.next(5)
    state = a.state_dict()
    rest = a.next(9)
    b = PromptSampler(7, seed=1)
    b.load_state_dict(state)
    assert b.next(9) == rest
    assert sorted(first + rest[:2]) == list(range(7))  # one full epoch
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, seed=1)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv))


def test_flags_yaml_and_validation(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("grpo:\n  grpo_group_size: 4\n  lr: 0.001\nspec:\n  spec_num_draft_tokens: 5\n")
    cfg = _parse(
        [
            "--hf-checkpoint",
            "m",
            "--prompt-data",
            "synthetic:sum",
            "--config",
            str(y),
            "--lr",
            "0.002",
            "--spec-draft-kind",
            "ngram",
            "--no-rollout-release-memory",
        ]
    )
    assert isinstance(cfg, RunConfig)
    assert cfg.grpo.grpo_group_size == 4 and cfg.grpo.lr == 0.002  # the flag overrides the file
    assert cfg.spec.spec_num_draft_tokens == 5 and cfg.rollout.rollout_release_memory is False
    assert "spec_draft_kind: ngram" in cfg.to_yaml()
    with pytest.raises(ValueError, match="needs --spec-draft-path"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--spec-draft-kind", "eagle3"])
    with pytest.raises(ValueError, match="does not divide"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--grpo-num-minibatches", "3"])
    with pytest.raises(ValueError, match="--log-interval -1 must be >= 0"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--log-interval", "-1"])
    assert (
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--log-interval", "0"]).logging.log_interval
        == 0
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  nope: 1\n")
    with pytest.raises(ValueError, match="unknown key grpo.nope"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--config", str(bad)])


def test_a_config_written_the_usual_way(tmp_path):
    """PyYAML reads ``1e-5`` as text and keys may drop their section's prefix (NeMo-RL's, verl's files):
    values take the key's type, unknown keys get the closest names, dotted overrides win over flag and
    file."""
    y = tmp_path / "nemo.yaml"
    y.write_text("grpo:\n  lr: 1e-5\n  group_size: '4'\nrollout:\n  max_batch_size: \"24\"\n  top_k: -1\n"
                 "spec:\n  draft_kind: ngram\n  num_draft_tokens: auto\n  history: 'true'\n")
    cfg = _parse(
        [
            "--hf-checkpoint",
            "m",
            "--prompt-data",
            "x",
            "--config",
            str(y),
            "--rollout-max-new-tokens",
            "32",
            "grpo.lr=3e-6",
            "rollout.max_new_tokens=48",
            "spec.spec_max_draft_tokens=7",
        ]
    )
    assert cfg.grpo.lr == 3e-6 and isinstance(cfg.grpo.lr, float)  # the override over the file
    assert cfg.grpo.grpo_group_size == 4 and cfg.rollout.rollout_max_batch_size == 24
    assert cfg.rollout.rollout_top_k == 0  # -1 = off
    assert cfg.rollout.rollout_max_new_tokens == 48  # the override over the flag
    assert cfg.spec.spec_num_draft_tokens == "auto" and cfg.spec.spec_history is True
    assert cfg.spec.spec_max_draft_tokens == 7
    assert _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--config", str(y)]).grpo.lr == 1e-5
    for text, message in (
        ("grpo:\n  lr: fast\n", "grpo.lr must be a float, got 'fast'"),
        ("rollout:\n  max_batch_size: 1.5\n", "rollout.rollout_max_batch_size must be an int"),
        (
            "rollout:\n  max_batchsize: 8\n",
            "unknown key rollout.max_batchsize; did you mean rollout_max_batch_size?",
        ),
        ("rolout:\n  max_batch_size: 8\n", "unknown section 'rolout'; did you mean rollout?"),
        ("rollout:\n  backend: tensorrt\n", "rollout.rollout_backend must be one of native, sglang, vllm"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--config", str(bad)])
    for override, message in (
        ("grpo.lr", "expected section.key=value"),
        ("lr=1e-5", "expected section.key=value"),
        ("grpo.lrr=1", "unknown key grpo.lrr; did you mean lr"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            _parse(["--hf-checkpoint", "m", "--prompt-data", "x", override])
    with pytest.raises(ConfigError, match="--rollout-top-k -2"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--rollout-top-k", "-2"])
    with pytest.raises(ConfigError, match=re.escape("--logger jsonl,mlflow: unknown ['mlflow']")):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--logger", "jsonl,mlflow"])
    with pytest.raises(ConfigError, match="the native engine takes no engine arguments"):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--rollout-backend", "native",
                "--rollout-engine-kwargs", '{"chunked_prefill_size": 8}'])
    kw = '{"chunked_prefill_size": 8}'
    assert _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--rollout-backend", "sglang",
                   "--rollout-engine-kwargs", kw]).rollout.rollout_engine_kwargs == kw


def test_the_draft_has_a_section_of_its_own_and_spec_keys_still_find_it(tmp_path):
    """``draft:`` holds the draft's fields (keys without ``spec_draft_`` / ``spec_``); files written when they
    were ``spec``'s still load, into the draft section; an unknown key in either names the closest ones."""
    new = tmp_path / "new.yaml"
    new.write_text("draft:\n  kind: eagle3\n  path: /d\n  online_draft_training: true\n  lr: 1e-4\n"
                   "spec:\n  num_draft_tokens: 2\n")
    old = tmp_path / "old.yaml"
    old.write_text("spec:\n  spec_draft_kind: eagle3\n  draft_path: /d\n  spec_online_draft_training: true\n"
                   "  draft_lr: 1e-4\n  num_draft_tokens: 2\n")
    for y in (new, old):
        cfg = _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--config", str(y)])
        d = cfg.draft
        assert (d.spec_draft_kind, d.spec_draft_path, d.spec_online_draft_training, d.spec_draft_lr) == (
            "eagle3", "/d", True, 1e-4)
        assert cfg.spec.spec_num_draft_tokens == 2 and "spec_draft_kind" not in dataclasses.asdict(cfg.spec)
    overridden = _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "spec.draft_kind=ngram"])
    assert overridden.draft.spec_draft_kind == "ngram"
    with pytest.raises(ConfigError, match=re.escape("unknown key draft.knd; did you mean spec_draft_kind?")):
        _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "draft.knd=ngram"])


def test_a_section_checks_itself_when_made_and_the_run_across_sections():
    """A section's own rule fires when the section is made (and again in ``validate``, after a change); a
    rule between sections fires in ``validate`` only."""
    from megatron_spec.config import DraftConfig, GRPOConfig, LoggingConfig, RolloutConfig, SpecConfig

    with pytest.raises(ConfigError, match="--grpo-num-minibatches 3 does not divide the 64 rollouts"):
        GRPOConfig(grpo_num_minibatches=3)
    with pytest.raises(ConfigError, match="--spec-online-draft-training needs --spec-draft-kind eagle3"):
        DraftConfig(spec_online_draft_training=True)
    with pytest.raises(ConfigError, match=re.escape("--logger jsonl,mlflow: unknown ['mlflow']")):
        LoggingConfig(logger="jsonl,mlflow")
    assert RolloutConfig(rollout_top_k=-1).rollout_top_k == 0  # -1 = off, made one spelling when made
    assert SpecConfig(spec_num_draft_tokens="4").spec_k_max == 4
    cfg = RunConfig()
    cfg.model.hf_checkpoint, cfg.data.prompt_data = "m", "x"
    cfg.grpo.micro_batch_size = 0  # changed after the section was made: validate checks it again
    with pytest.raises(ConfigError, match="--micro-batch-size must be >= 1"):
        cfg.validate()
    cfg.grpo.micro_batch_size = 8
    cfg.draft.spec_draft_kind = "eagle3"  # fine alone; the rule needing a path for it spans draft and spec
    DraftConfig(spec_draft_kind="eagle3")
    with pytest.raises(ConfigError, match="--spec-draft-kind eagle3 needs --spec-draft-path"):
        cfg.validate()
    cfg.draft.spec_draft_kind, cfg.logging.eval_interval = "none", 2
    with pytest.raises(ConfigError, match="--eval-interval with a file prompt set needs --eval-data"):
        cfg.validate()


def test_engine_sizes_default_by_device(monkeypatch):
    """A GPU engine is not held to the CPU demo's 16 rows and 64 tokens; a value given wins on either."""
    import torch

    cpu = _parse(["--hf-checkpoint", "m", "--prompt-data", "x"]).rollout
    assert (cpu.rollout_max_batch_size, cpu.rollout_max_new_tokens) == (16, 64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--rollout-backend", "native"]).rollout
    assert (gpu.rollout_max_batch_size, gpu.rollout_max_new_tokens) == (256, 1024)
    given = _parse(["--hf-checkpoint", "m", "--prompt-data", "x", "--rollout-backend", "native",
                    "--rollout-max-batch-size", "8", "rollout.max_new_tokens=100"]).rollout
    assert (given.rollout_max_batch_size, given.rollout_max_new_tokens) == (8, 100)


def test_help_names_values_not_destinations():
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = p.format_help()
    assert "--rollout-max-batch-size N" in text and "--lr X" in text and "ROLLOUT." not in text
