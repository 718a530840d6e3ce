"""The vLLM backend's pure mappings (no vLLM needed): what it refuses, the LLM and sampling arguments it
builds from ours, and how a vLLM completion becomes a SampleOutput."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from megatron_spec.rollout import vllm_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.settings import check_speculation
from megatron_spec.rollout.types import SamplingParams, stats_from_samples


@pytest.fixture()
def model_dir(tmp_path):
    return str(tmp_path)


def test_sampled_speculation_on_the_cpu_is_refused_in_one_line(model_dir):
    cfg = EngineConfig(model_path=model_dir, draft_kind="ngram")
    proto.check_supported(cfg, [0.0])  # greedy speculation: allowed
    proto.check_supported(EngineConfig(model_path=model_dir), [1.0])  # plain sampling: allowed
    with pytest.raises(ValueError) as e:
        proto.check_supported(cfg, [0.0, 0.7])
    msg = str(e.value)
    assert "\n" not in msg and "vllm#55005" in msg
    for way_out in ("--rollout-temperature 0", "--spec-draft-kind none", "--rollout-backend native"):
        assert way_out in msg
    # GPU path
    proto.check_supported(EngineConfig(model_path=model_dir, draft_kind="ngram", device="cuda"), [1.0])


@pytest.mark.parametrize("kwargs, words", [
    ({"draft_kind": "mtp"}, "--spec-draft-kind mtp"),
    ({"draft_kind": "history"}, "--spec-draft-kind history"),
    ({"draft_kind": "ngram", "num_draft_tokens": "auto"}, "fixed k"),
    ({"fp8_weights": True}, "fp8"),
])
def test_native_only_settings_are_refused(model_dir, kwargs, words):
    with pytest.raises(ValueError, match=words):
        proto.check_supported(EngineConfig(model_path=model_dir, **kwargs))


def test_the_launcher_rules_name_vllm():
    with pytest.raises(ValueError, match="vLLM's speculative worker fixes k"):
        check_speculation({"spec_draft_kind": "ngram", "spec_num_draft_tokens": "auto"}, "vllm")


def test_llm_arguments(model_dir, tmp_path):
    cfg = EngineConfig(model_path=model_dir, draft_kind="ngram", num_draft_tokens=3, max_batch_size=8,
                       context_length=300, load_weights=False, seed=5)
    kw = proto.llm_kwargs(cfg, speculation=True, draft_dir=None)
    assert kw["load_format"] == "dummy" and kw["max_num_seqs"] == 8 and kw["max_model_len"] == 300
    assert kw["seed"] == 5 and kw["enforce_eager"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["weight_transfer_config"] == {"backend": "megatron_spec_bucket"}
    assert kw["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    assert kw["per_request_spec_decode_metrics"] == "detailed"
    assert kw["enable_prefix_caching"] is True
    unshared = dataclasses.replace(cfg, share_prefix=False)  # --no-rollout-share-prefix
    assert proto.llm_kwargs(unshared, speculation=True, draft_dir=None)["enable_prefix_caching"] is False
    plain = proto.llm_kwargs(cfg, speculation=False, draft_dir=None)
    # vLLM refuses it
    assert "speculative_config" not in plain and "per_request_spec_decode_metrics" not in plain
    eagle = EngineConfig(model_path=model_dir, draft_kind="eagle3", draft_path=model_dir, num_draft_tokens=2)
    assert proto.speculative_config(eagle, "/d") == {
        "method": "eagle3",
        "model": "/d",
        "num_speculative_tokens": 2,
    }


def test_engine_kwargs_pass_through_and_ours_are_refused(model_dir):
    """``--rollout-engine-kwargs``: vLLM's own keywords reach ``LLM(...)``; those our flags or the weight
    sync set
    are refused naming the flag; the native engine takes none; not JSON or not an object is one line."""
    from megatron_spec.rollout.config import parse_engine_kwargs

    extra = parse_engine_kwargs('{"gpu_memory_utilization": 0.5, "enable_chunked_prefill": false}', "vllm")
    kw = proto.llm_kwargs(
        EngineConfig(model_path=model_dir, engine_kwargs=extra), speculation=False, draft_dir=None
    )
    assert kw["gpu_memory_utilization"] == 0.5 and kw["enable_chunked_prefill"] is False
    with pytest.raises(
        ValueError, match="'max_num_seqs' is set by megatron-spec from --rollout-max-batch-size"
    ):
        parse_engine_kwargs('{"max_num_seqs": 4}', "vllm")
    with pytest.raises(
        ValueError, match="'weight_transfer_config' is set by megatron-spec \\(the weight sync"
    ):
        parse_engine_kwargs('{"weight_transfer_config": {}}', "vllm")
    with pytest.raises(
        ValueError, match="'speculative_num_steps' is set by megatron-spec from --spec-num-draft"
    ):
        parse_engine_kwargs('{"speculative_num_steps": 4}', "sglang")
    with pytest.raises(ValueError, match="the native engine takes no engine arguments"):
        parse_engine_kwargs('{"x": 1}', "native")
    with pytest.raises(ValueError, match="is not JSON"):
        parse_engine_kwargs("{x: 1}", "vllm")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_engine_kwargs("[1]", "vllm")
    assert parse_engine_kwargs(None, "native") == {} and parse_engine_kwargs("{}", "native") == {}


def test_eagle3_dir_shifts_the_aux_layer_ids(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}})
    )
    (draft / "model.safetensors").write_bytes(b"x")
    out = proto.vllm_eagle3_dir(str(draft), str(tmp_path))
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert os.path.realpath(os.path.join(out, "model.safetensors")) == str(draft / "model.safetensors")


def test_sampling_arguments():
    s = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, stop_token_ids=(5,))
    kw = proto.sampling_kwargs(s, 4, 123)
    assert kw == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "max_tokens": 12,
                  "ignore_eos": False, "logprobs": 0, "detokenize": False, "skip_special_tokens": False,
                  "stop_token_ids": [5], "seed": 123}
    assert "seed" not in proto.sampling_kwargs(s, 1, None)
    # every request's n samples (seed + i) stay clear of the next request's
    assert proto.sample_seed(7, 1) - proto.sample_seed(7, 0) == 65_536


def test_a_completion_with_speculative_counters():
    lp = lambda v: SimpleNamespace(logprob=v)  # vLLM's Logprob
    # 7 tokens: prefill 1, steps accepting 2, 0, 3 (3 + 1 + 4 = 8 > 6: the last step cut by the length limit)
    s = proto.sample_output(
        "r",
        1,
        [4, 5, 6, 7, 8, 9, 10],
        [{t: lp(-0.5)} for t in [4, 5, 6, 7, 8, 9, 10]],
        "length",
        {"per_step_accepted": [2, 0, 3], "per_step_drafted": [3, 3, 3]},
        target_version="v2",
        draft_version="d1",
    )
    assert s.num_verify_steps == 7 - 5 and s.accepted_per_step == [2, 0, 3] and s.draft_lengths == [3, 3, 3]
    assert s.logprobs == [-0.5] * 7 and s.weight_version == "v2" and s.draft_sources == ["vllm"] * 3
    st = stats_from_samples([s], 1.0, 3)
    assert st.spec_steps == 3 and st.accepted_at_least == [2, 2, 1]
    plain = proto.sample_output("r", 0, [4, 5], [{4: lp(-1.0)}, {5: lp(-2.0)}], "stop", None,
                                target_version=None, draft_version=None)
    assert plain.num_verify_steps == 2 and plain.accepted_per_step == []


@pytest.mark.parametrize("tokens, logprobs, finish, words", [
    ([4, 5], [{4: -1.0}, {6: -1.0}], "stop", "log-prob 1 is for tokens \\[6\\]"),
    ([4, 5], [{4: -1.0}], "stop", "1 log-probs for 2 tokens"),
    ([4], [{4: -1.0}], "abort", "finish_reason 'abort'"),
])
def test_a_contradictory_completion_raises(tokens, logprobs, finish, words):
    with pytest.raises(proto.VllmOutputError, match=words):
        proto.sample_output("r", 0, tokens, logprobs, finish, None, target_version=None, draft_version=None)


def test_kv_cache_is_whole_gib(model_dir):
    cfg = EngineConfig(model_path=model_dir, max_batch_size=16, context_length=512)
    # SmolLM2: 30 layers x 3 KV heads x 64 x fp32 x 2 x 512 x 16 = 360 MiB -> 1 GiB
    assert proto.kv_cache_gib(cfg, 30, 3, 64) == 1
    big = EngineConfig(model_path=model_dir, max_batch_size=64, context_length=4096)
    assert proto.kv_cache_gib(big, 30, 3, 64) == 15  # 11.25 GiB x 1.25 slack, rounded up
