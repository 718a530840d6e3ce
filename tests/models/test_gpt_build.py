"""Building and loading the Megatron policy in-process (TP=1): errors name the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_spec.models import CheckpointError, HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel


@pytest.fixture(scope="module")
def parallel():
    info = init_parallel(tp_size=1, seed=0)
    yield info
    destroy_parallel()


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return os.fspath(dst)


def test_load_and_export_tp1(parallel, hf_checkpoints):
    ckpt = HFCheckpoint(hf_checkpoints["qwen3"])
    model = build_gpt_model(ckpt.decoder_config)
    load_hf_weights(model, ckpt)
    exported = export_hf_state_dict(model)
    for name in ckpt.names():
        assert torch.equal(exported[name], ckpt.get(name)), name


def test_missing_tensor_named(parallel, hf_checkpoints, tmp_path):
    path = _copy(hf_checkpoints["qwen2"], tmp_path / "ck")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ckpt = HFCheckpoint(path)
    model = build_gpt_model(ckpt.decoder_config)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.v_proj.bias missing"):
        load_hf_weights(model, ckpt)


def test_wrong_shape_named(parallel, hf_checkpoints, tmp_path):
    path = _copy(hf_checkpoints["qwen3"], tmp_path / "ck")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :64].contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ckpt = HFCheckpoint(path)
    model = build_gpt_model(ckpt.decoder_config)
    with pytest.raises(CheckpointError, match=r"down_proj.weight has shape \(64, 64\), expected \(64, 128\)"):
        load_hf_weights(model, ckpt)


def test_checkpoint_of_another_model_refused(parallel, hf_checkpoints):
    model = build_gpt_model(HFCheckpoint(hf_checkpoints["qwen3"]).decoder_config)
    with pytest.raises(CheckpointError, match="differs from the model's config"):
        load_hf_weights(model, HFCheckpoint(hf_checkpoints["qwen2"]))


def test_unsupported_architecture_named(parallel, hf_checkpoints, tmp_path):
    path = _copy(hf_checkpoints["qwen3"], tmp_path / "ck")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["GemmaForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="GemmaForCausalLM.*not supported"):
        HFCheckpoint(path).decoder_config


def test_tp_size_that_does_not_divide_heads(parallel, hf_checkpoints):
    cfg = HFCheckpoint(hf_checkpoints["qwen3"]).decoder_config  # 8 heads, 2 kv heads
    with pytest.raises(ValueError, match="does not divide num_key_value_heads 2"):
        build_gpt_model(cfg, tp_size=4)
