"""One source of engine settings (issue 29): the launcher's fields and flags, ``generate``'s flags and the
engine's record all come from ``megatron_spec.rollout.settings.SETTINGS``; ``generate``'s older flag names
keep working."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_spec import config as run_config
from megatron_spec.cli import build_parser
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.settings import SETTINGS, check_speculation, engine_kwargs, sampling_kwargs
from megatron_spec.rollout.types import SamplingParams

REQUIRED = ["--prompts", "p.jsonl", "--output", "o.jsonl"]


def _generate_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv, *REQUIRED])


def test_every_setting_is_a_launcher_field_with_the_same_default_help_and_choices():
    for s in SETTINGS:
        cls = run_config.SECTIONS[s.group]
        f = {f.name: f for f in dataclasses.fields(cls)}[s.name]
        assert f.default == s.default and f.metadata["help"] == s.help, s.name
        assert f.metadata.get("choices") == s.choices, s.name


def test_generate_takes_the_launchers_names_and_its_older_ones_alike(tmp_path):
    new = ["--hf-checkpoint", "m", "--spec-draft-kind", "ngram", "--spec-num-draft-tokens", "auto",
           "--spec-max-draft-tokens", "4", "--rollout-temperature", "0.7", "--rollout-top-k", "8",
           "--rollout-max-batch-size", "3", "--rollout-dtype", "float32", "--rollout-num-threads", "1",
           "--rollout-max-new-tokens", "9", "--rollout-backend", "native", "--spec-history-tree", "off"]
    old = [
        "--model",
        "m",
        "--draft-kind",
        "ngram",
        "--num-draft-tokens",
        "auto",
        "--max-draft-tokens",
        "4",
        "--temperature",
        "0.7",
        "--top-k",
        "8",
        "--batch-size",
        "3",
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--max-new-tokens",
        "9",
        "--backend",
        "native",
        "--history-tree",
        "off",
    ]
    assert vars(_generate_args(*new)) == vars(_generate_args(*old))
    args = _generate_args(*old)
    assert (args.spec_num_draft_tokens, args.rollout_num_threads, args.rollout_max_batch_size) == (
        "auto",
        1,
        3,
    )
    assert _generate_args("--model", "m", "--history").spec_history is True


def test_the_launcher_and_generate_build_the_same_engine_record(setup):
    """The same settings given to either command become the same EngineConfig and SamplingParams."""
    argv = [
        "--spec-draft-kind",
        "eagle3",
        "--spec-draft-path",
        setup.eagle3,
        "--spec-num-draft-tokens",
        "auto",
        "--spec-max-draft-tokens",
        "4",
        "--spec-history",
        "--rollout-temperature",
        "0.7",
        "--rollout-top-p",
        "0.9",
        "--rollout-max-batch-size",
        "5",
        "--rollout-num-threads",
        "1",
        "--rollout-dtype",
        "float32",
        "--rollout-max-new-tokens",
        "12",
        "--seed",
        "7",
    ]
    gen = vars(_generate_args("--hf-checkpoint", setup.target, *argv))
    parser = argparse.ArgumentParser()
    run_config.add_arguments(parser)
    cfg = run_config.from_args(
        parser.parse_args(["--hf-checkpoint", setup.target, "--prompt-data", "synthetic:sum", *argv])
    )
    launcher = {
        **dataclasses.asdict(cfg.model),
        **dataclasses.asdict(cfg.rollout),
        **dataclasses.asdict(cfg.draft),
        **dataclasses.asdict(cfg.spec),
    }
    launcher.pop("spec_mtp_num_layers")  # a launcher-only setting (the heads trained beside the policy)
    assert engine_kwargs(gen) == engine_kwargs(launcher)
    assert SamplingParams(**sampling_kwargs(gen)) == SamplingParams(**sampling_kwargs(launcher))
    e = EngineConfig(**engine_kwargs(gen))
    assert (e.draft_kind, e.num_draft_tokens, e.max_draft_tokens, e.history, e.max_batch_size, e.seed) == \
        ("eagle3", "auto", 4, True, 5, 7)


@pytest.mark.parametrize(
    "values, backend, match",
    [
        ({"spec_draft_kind": "eagle3"}, None, "--spec-draft-kind eagle3 needs --spec-draft-path"),
        ({"spec_draft_kind": "ngram", "spec_num_draft_tokens": 0}, None, "must be >= 1"),
        (
            {"spec_draft_kind": "ngram", "spec_history": True},
            None,
            "--spec-history needs --spec-num-draft-tokens auto",
        ),
        (
            {"spec_draft_kind": "history", "spec_num_draft_tokens": "auto", "spec_history": True},
            None,
            "other than none and history",
        ),
        ({"spec_draft_kind": "ngram", "spec_num_draft_tokens": "auto"}, "sglang", "need the native engine"),
        ({"spec_history_tree": "always"}, None, "--spec-history-tree must be one of"),
    ],
)
def test_one_check_of_the_speculation_rules_for_all_three(setup, values, backend, match):
    """The launcher, generate and EngineConfig refuse the same settings with the same words."""
    with pytest.raises(ValueError, match=match):
        check_speculation(values, backend)
    if backend is None:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**engine_kwargs({"hf_checkpoint": setup.target, **values}))
    argv = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in values.items()
    ]
    parser = argparse.ArgumentParser()
    run_config.add_arguments(parser)
    if values.get("spec_history_tree") == "always":
        with pytest.raises(SystemExit):  # not a choice of the flag at all
            parser.parse_args(["--hf-checkpoint", setup.target, "--prompt-data", "synthetic:sum", *argv])
        return
    args = parser.parse_args(["--hf-checkpoint", setup.target, "--prompt-data", "synthetic:sum", *argv,
                              *(["--rollout-backend", backend] if backend else [])])
    with pytest.raises(run_config.ConfigError, match=match):
        run_config.from_args(args)
