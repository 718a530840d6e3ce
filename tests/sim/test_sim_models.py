"""Model profiles: parameter counts against the published sizes, KV bytes by hand."""

from __future__ import annotations

import json

import pytest

from megatron_spec.sim.models import draft_profile, eagle3_draft, get_model, mtp_draft


@pytest.mark.parametrize("name, total, active", [
    # published sizes: Qwen3 tech report / model cards, Llama 3.1 model cards, DeepSeek-V3 report
    ("qwen3-8b", 8.19e9, None),
    ("qwen3-32b", 32.8e9, None),
    ("qwen3-235b-a22b", 235e9, 22e9),
    ("llama-3.1-8b", 8.03e9, None),
    ("llama-3.1-70b", 70.6e9, None),
    ("deepseek-v3", 671e9, 37e9),  # 36.6B active incl. the 0.9B head, plus the 0.9B embedding
])
def test_parameter_counts_match_published_sizes(name, total, active):
    m = get_model(name)
    assert m.total_params == pytest.approx(total, rel=0.015)
    if active is not None:
        assert m.active_params == pytest.approx(active, rel=0.03)
    else:
        assert m.active_params < m.total_params  # the input embedding is a lookup


def test_kv_bytes_per_token_by_hand():
    # Qwen3-8B: 36 layers x (K and V) x 8 kv heads x 128 x 2 bytes
    assert get_model("qwen3-8b").kv_bytes_per_token(2) == 36 * 2 * 8 * 128 * 2 == 147456
    # DeepSeek-V3 MLA: 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes
    dsv3 = get_model("deepseek-v3")
    assert dsv3.is_mla and dsv3.kv_bytes_per_token(2) == 61 * 576 * 2
    # MLA caches one latent per token shared by all heads: TP cannot split it
    assert dsv3.kv_shard_limit == 1


def test_moe_structure():
    q = get_model("qwen3-235b-a22b")
    assert q.is_moe and q.moe_layers == 94 and q.num_experts == 128 and q.experts_per_tok == 8
    d = get_model("deepseek-v3")
    assert d.moe_layers == 58 and d.dense_layers == 3 and d.shared_experts == 1 and d.mtp_layers == 1


def test_custom_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = get_model(str(path))
    attn = 256 * 256 + 2 * 256 * 64 + 256 * 256  # q, k, v (2 heads x 32), o
    mlp = 3 * 256 * 512
    assert m.total_params == 4 * (attn + mlp) + 2 * 1000 * 256
    assert get_model(str(tmp_path)).total_params == m.total_params  # a directory works too


def test_unknown_and_broken_models(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="does not exist"):
        get_model(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_model(str(bad))
    nohidden = tmp_path / "nohidden.json"
    nohidden.write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="hidden_size"):
        get_model(str(nohidden))


def test_draft_profiles():
    t = get_model("qwen3-8b")
    e = eagle3_draft(t)
    h = t.hidden
    # one layer: q/k/v over 2H, o, MLP, fc (3H -> H), LM head over the 32000-token draft vocab
    expected = (2 * h * 4096 + 2 * 2 * h * 1024 + 4096 * h) + 3 * h * 12288 + 3 * h * h + 32000 * h
    assert e.total_params == pytest.approx(expected, rel=0.01)
    with pytest.raises(ValueError, match="no MTP layers"):
        mtp_draft(t)
    assert mtp_draft(get_model("deepseek-v3")).is_moe
    assert draft_profile("model", t).name == "qwen3-0.6b"
    with pytest.raises(ValueError, match="vocab_size"):
        draft_profile("model", t, draft_model="llama-3.2-1b")
    assert draft_profile("ngram", t) is None
