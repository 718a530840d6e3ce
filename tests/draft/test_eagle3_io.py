"""Loading and saving ModelOpt EAGLE-3 exports: round trips, legacy naming, and every validation error."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_spec.draft import Eagle3Config, load_eagle3, read_eagle3_config, save_eagle3
from megatron_spec.draft.eagle3 import default_aux_layer_ids

pytestmark = pytest.mark.modelopt

MODELOPT_NAMES = {
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
}


def edited_copy(src: str, dst: str, *, tensors=None, config=None) -> str:
    """Copy an export and edit its tensors (``fn(dict) -> dict``) and/or config (``fn(dict) -> None``)."""
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = tensors(load_file(os.path.join(dst, "model.safetensors")))
        save_file(sd, os.path.join(dst, "model.safetensors"))
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_export_names_are_modelopt_047(drafts, which):
    names = set(load_file(os.path.join(getattr(drafts, which).path, "model.safetensors")))
    assert names == (MODELOPT_NAMES | {"d2t"} if which == "reduced" else MODELOPT_NAMES)


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_round_trip_bit_exact(drafts, tmp_path, which):
    src = getattr(drafts, which).path
    head = load_eagle3(src, drafts.target_cfg)
    save_eagle3(head, tmp_path / "saved")
    original, saved = (
        load_file(os.path.join(src, "model.safetensors")),
        load_file(tmp_path / "saved" / "model.safetensors"),
    )
    assert set(saved) == set(original)
    for name, t in original.items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name], t), name
    again = load_eagle3(tmp_path / "saved", drafts.target_cfg)
    assert again.cfg == head.cfg
    for (n1, t1), (n2, t2) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    with open(os.path.join(src, "config.json")) as f:
        cfg_src = json.load(f)
    with open(tmp_path / "saved" / "config.json") as f:
        cfg_saved = json.load(f)
    # ModelOpt writes its default "bfloat16" over float32 tensors; we write the truth
    cfg_src.pop("torch_dtype")
    assert cfg_saved.pop("torch_dtype") == "float32"
    assert cfg_saved == cfg_src


def test_legacy_midlayer_naming(drafts, tmp_path):
    src = drafts.reduced.path
    legacy = edited_copy(src, tmp_path / "legacy", tensors=lambda sd: {
        ("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()})
    assert any(k.startswith("midlayer.") for k in load_file(os.path.join(legacy, "model.safetensors")))
    a, b = load_eagle3(src, drafts.target_cfg), load_eagle3(legacy, drafts.target_cfg)
    for (n, t1), (_, t2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(t1, t2), n
    save_eagle3(b, tmp_path / "resaved")  # written back under ModelOpt 0.47's names
    assert set(load_file(tmp_path / "resaved" / "model.safetensors")) == MODELOPT_NAMES | {"d2t"}


def test_bf16_load_and_save(drafts, tmp_path):
    head = load_eagle3(drafts.reduced.path, drafts.target_cfg, dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.int64
    save_eagle3(head, tmp_path / "bf16")
    sd = load_file(tmp_path / "bf16" / "model.safetensors")
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
    assert json.load(open(tmp_path / "bf16" / "config.json"))["torch_dtype"] == "bfloat16"


def test_default_aux_ids_when_absent(drafts, tmp_path):
    def drop(cfg):
        del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    path = edited_copy(drafts.reduced.path, tmp_path / "noids", config=drop)
    assert default_aux_layer_ids(4) == (0, 1) and default_aux_layer_ids(32) == (1, 15, 28)
    assert load_eagle3(path, drafts.target_cfg).cfg.aux_layer_ids == (0, 1)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        read_eagle3_config(path)  # no target: nothing to derive the default from


# ----------------------------------------------------------------------------- validation errors
def test_error_hidden_size(drafts):
    target = dataclasses.replace(drafts.target_cfg, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match=r"draft hidden_size 64 != target hidden_size 32"):
        load_eagle3(drafts.reduced.path, target)


def test_error_vocab(drafts):
    target = dataclasses.replace(drafts.target_cfg, vocab_size=100)
    with pytest.raises(ValueError, match=r"draft vocab_size 84 != target vocab_size 100"):
        load_eagle3(drafts.reduced.path, target)


def test_error_aux_id_out_of_range(drafts, tmp_path):
    def ids(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 4]

    path = edited_copy(drafts.full.path, tmp_path / "ids", config=ids)
    with pytest.raises(
        ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 4\] out of range.*4 layers"
    ):
        load_eagle3(path, drafts.target_cfg)


@pytest.mark.parametrize("bad", ["range", "negative", "duplicate"])
def test_error_d2t(drafts, tmp_path, bad):
    def edit(sd):
        d2t = sd["d2t"].clone()
        if bad == "range":
            d2t[5] = 84 - 5  # draft id 5 -> target id 84 == vocab_size
        elif bad == "negative":
            d2t[0] = -1
        else:
            d2t[1] = (0 + d2t[0]) - 1  # draft id 1 -> the same target id as draft id 0
        sd["d2t"] = d2t
        return sd

    path = edited_copy(drafts.reduced.path, tmp_path / bad, tensors=edit)
    msg = {
        "range": r"d2t out of range: draft id 5 maps to target id 84",
        "negative": r"d2t out of range: draft id 0",
        "duplicate": r"d2t maps several draft ids to the same target id",
    }[bad]
    with pytest.raises(ValueError, match=msg):
        load_eagle3(path, drafts.target_cfg)


@pytest.mark.parametrize("name", ["layers.0.mlp.up_proj.weight", "d2t", "norm.weight"])
def test_error_missing_tensor(drafts, tmp_path, name):
    path = edited_copy(
        drafts.reduced.path,
        tmp_path / "missing",
        tensors=lambda sd: {k: v for k, v in sd.items() if k != name},
    )
    with pytest.raises(ValueError, match=rf"missing tensor {name}"):
        load_eagle3(path, drafts.target_cfg)


def test_error_unexpected_tensor(drafts, tmp_path):
    path = edited_copy(drafts.reduced.path, tmp_path / "extra",
                       tensors=lambda sd: {**sd, "layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match=r"unexpected tensor layers.0.self_attn.q_norm.weight"):
        load_eagle3(path, drafts.target_cfg)
    path = edited_copy(drafts.full.path, tmp_path / "d2t_full",
                       tensors=lambda sd: {**sd, "d2t": torch.zeros(84, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"unexpected tensor d2t .*draft_vocab_size == vocab_size"):
        load_eagle3(path, drafts.target_cfg)


def test_error_misshapen_tensor(drafts, tmp_path):
    path = edited_copy(
        drafts.full.path,
        tmp_path / "shape",
        tensors=lambda sd: {**sd, "fc.weight": sd["fc.weight"][:, :128].contiguous()},
    )
    with pytest.raises(ValueError, match=r"tensor fc.weight .* has shape \(64, 128\), expected \(64, 192\)"):
        load_eagle3(path, drafts.target_cfg)


def test_error_both_namings(drafts, tmp_path):
    path = edited_copy(
        drafts.full.path,
        tmp_path / "both",
        tensors=lambda sd: {**sd, "midlayer.hidden_norm.weight": sd["layers.0.hidden_norm.weight"].clone()},
    )
    with pytest.raises(ValueError, match=r"layers.0.hidden_norm.weight appears twice"):
        load_eagle3(path, drafts.target_cfg)


@pytest.mark.parametrize("edit, msg", [
    (lambda c: c["eagle_config"].update(use_last_layernorm=False), "use_last_layernorm=false"),
    (lambda c: c["eagle_config"].update(norm_before_fc=True), "norm_before_fc=true"),
    (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers 2"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 draft"),
])
def test_error_unsupported_config(drafts, tmp_path, edit, msg):
    path = edited_copy(drafts.reduced.path, tmp_path / "cfg", config=edit)
    with pytest.raises(ValueError, match=msg):
        load_eagle3(path, drafts.target_cfg)


def test_config_round_trip_from_scratch():
    cfg = Eagle3Config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=(1, 3, 5),
        norm_output=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    again = Eagle3Config.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
