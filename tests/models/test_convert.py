"""HF <-> Megatron layouts without processes: round trips for several TP sizes, and errors."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_spec.models import CheckpointError, DecoderConfig, HFCheckpoint
from megatron_spec.models.convert import (
    canonical_name,
    expected_hf_shapes,
    hf_to_megatron_shards,
    megatron_rules,
    padded_vocab_size,
    validate_hf_names,
)

CFG = DecoderConfig.from_hf_dict({
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 37, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "rope_theta": 10000.0})


def _random_hf(cfg: DecoderConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(cfg).items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_concatenate_back_to_hf_bit_exact(tp):
    hf = _random_hf(CFG)
    padded = padded_vocab_size(CFG.vocab_size, tp, divisible_by=8)
    rules = megatron_rules(CFG, tp, padded)
    shards = {
        r: dict(hf_to_megatron_shards(CFG, hf.__getitem__, list(rules), r, tp, padded)) for r in range(tp)
    }
    back = {}
    for name, rule in rules.items():
        parts = [shards[r][name] for r in range(tp)]
        assert all(tuple(p.shape) == rule.shard_shape(tp) for p in parts), name
        full = parts[0] if rule.partition_dim is None else torch.cat(parts, dim=rule.partition_dim)
        back.update(rule.to_hf(full))
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_qkv_layout_is_grouped_per_query_group():
    """Rank 0 of TP=2 holds query groups 0-1: q heads 0-3 with k/v heads 0-1, interleaved per group."""
    hf = _random_hf(CFG)
    padded = padded_vocab_size(CFG.vocab_size, 2, 8)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    (_, shard0), = hf_to_megatron_shards(CFG, hf.__getitem__, [name], 0, 2, padded)
    d = CFG.head_dim  # 4; 2 query heads per group
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    expected = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(shard0, expected)


def test_fc1_shard_is_gate_then_up_of_the_rank():
    hf = _random_hf(CFG)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    (_, shard1), = hf_to_megatron_shards(CFG, hf.__getitem__, [name], 1, 2, 40)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(shard1, torch.cat([gate[24:], up[24:]]))


def test_vocab_padding_rows_are_zero():
    hf = _random_hf(CFG)
    padded = padded_vocab_size(CFG.vocab_size, 2, 8)  # 37 -> 48
    assert padded == 48
    (_, s1), = hf_to_megatron_shards(CFG, hf.__getitem__, ["output_layer.weight"], 1, 2, padded)
    assert torch.equal(s1[: 37 - 24], hf["lm_head.weight"][24:]) and not s1[37 - 24:].any()


def test_te_names_map_to_local():
    assert canonical_name("module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"


def test_validate_names_missing_shape_unknown():
    shapes = expected_hf_shapes(CFG)
    bad = dict(shapes)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight missing"):
        validate_hf_names(CFG, bad, "ckpt")
    bad = {**shapes, "model.layers.0.self_attn.k_proj.weight": (8, 32)}
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \(8, 32\), expected \(16, 32\)"):
        validate_hf_names(CFG, bad, "ckpt")
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.2.mlp.up_proj.weight"):
        validate_hf_names(CFG, {**shapes, "model.layers.2.mlp.up_proj.weight": (48, 32)}, "ckpt")
    ignored = validate_hf_names(CFG, {**shapes, "model.layers.0.self_attn.rotary_emb.inv_freq": (2,)}, "ckpt")
    assert ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq"]


def test_checkpoint_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        HFCheckpoint(tmp_path)
    save_file({"a": torch.zeros(2)}, os.fspath(tmp_path / "x.safetensors"))
    save_file({"a": torch.zeros(2)}, os.fspath(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointError, match="tensor a is in both"):
        HFCheckpoint(tmp_path)


def test_sharded_checkpoint_reads_lazily(hf_checkpoints):
    ckpt = HFCheckpoint(hf_checkpoints["llama_sharded"])
    assert os.path.isfile(os.path.join(ckpt.path, "model.safetensors.index.json"))
    cfg = ckpt.decoder_config
    assert set(ckpt.names()) == set(expected_hf_shapes(cfg))
    assert ckpt.shape("model.embed_tokens.weight") == (cfg.vocab_size, cfg.hidden_size)
    with pytest.raises(CheckpointError, match="tensor model.layers.9.mlp.up_proj.weight missing"):
        ckpt.get("model.layers.9.mlp.up_proj.weight")
