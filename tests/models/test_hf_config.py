"""Parsing HF config.json dialects and refusing what cannot be built."""

from __future__ import annotations

import json

import pytest

from megatron_spec.models.hf_config import DecoderConfig, UnsupportedModelError

BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def test_legacy_and_v5_rope_fields_agree():
    legacy = DecoderConfig.from_hf_dict(BASE)
    v5 = dict(BASE)
    del v5["rope_theta"]
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert DecoderConfig.from_hf_dict(v5) == legacy
    assert legacy.qk_norm and not legacy.qkv_bias and legacy.tie_word_embeddings


def test_qwen2_has_qkv_bias_llama_not():
    q2 = DecoderConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    ll = DecoderConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert q2.qkv_bias and not q2.qk_norm
    assert not ll.qkv_bias and not ll.qk_norm


def test_llama3_rope_scaling_parsed():
    cfg = DecoderConfig.from_hf_dict(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_scaling_factor == 8.0


@pytest.mark.parametrize("patch, message", [
    ({"architectures": ["MixtralForCausalLM"]}, "not supported"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}, "high_freq_factor"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_are_named(patch, message):
    with pytest.raises(UnsupportedModelError, match=message):
        DecoderConfig.from_hf_dict({**BASE, **patch})


def test_missing_field_named(tmp_path):
    cfg = dict(BASE)
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="missing required field 'hidden_size'"):
        DecoderConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("tp, message", [(3, "num_attention_heads"), (4, "num_key_value_heads"), (0, ">= 1")])
def test_tp_must_divide_heads(tp, message):
    cfg = DecoderConfig.from_hf_dict(
        {**BASE, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 144}
    )
    with pytest.raises(ValueError, match=message):
        cfg.check_tensor_parallel(tp)
