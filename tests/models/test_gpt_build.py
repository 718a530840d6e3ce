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
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][
        :, :64
    ].contiguous()
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
        _ = HFCheckpoint(path).decoder_config


def test_tp_size_that_does_not_divide_heads(parallel, hf_checkpoints):
    cfg = HFCheckpoint(hf_checkpoints["qwen3"]).decoder_config  # 8 heads, 2 kv heads
    with pytest.raises(ValueError, match="does not divide num_key_value_heads 2"):
        build_gpt_model(cfg, tp_size=4)


def _off_device(module: torch.nn.Module, device: torch.device) -> list[str]:
    """Every parameter and buffer of ``module`` that is not on ``device``."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [f"{n} on {t.device}" for n, t in named if t.device != device]


@pytest.mark.parametrize("name", ["qwen3", "llama_tied_rope_scaling"])
def test_policy_is_built_on_the_requested_device(parallel, hf_checkpoints, name):
    """Issue 27, defect 1: megatron-core makes the local spec's norms (``torch.nn.RMSNorm`` behind
    ``WrappedTorchNorm``) on the CPU whatever ``use_cpu_initialization`` says, so a GPU policy kept
    its norms on the host and failed at its first forward. ``meta`` stands in for the GPU here: a
    model built for it must hold every parameter and buffer there."""
    cfg = HFCheckpoint(hf_checkpoints[name]).decoder_config
    model = build_gpt_model(cfg, device="meta")
    assert _off_device(model, torch.device("meta")) == []
    # norms were checked
    assert any(".layernorm" in n or "final_layernorm" in n for n, _ in model.named_parameters())


def test_policy_defaults_to_the_current_device(parallel, hf_checkpoints):
    from megatron_spec.models.gpt import default_model_device

    model = build_gpt_model(HFCheckpoint(hf_checkpoints["qwen3"]).decoder_config)
    device = default_model_device()
    assert device == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))
    assert _off_device(model, device) == []


def test_mtp_draft_follows_the_policys_device(parallel, hf_checkpoints):
    """The MTP head beside the policy: its norms are made on the CPU by megatron-core too."""
    from megatron_spec.draft.mtp_draft import MtpDraft

    policy = build_gpt_model(HFCheckpoint(hf_checkpoints["qwen3"]).decoder_config, device="meta")
    draft = MtpDraft(policy, 1, use_te=False)
    assert _off_device(draft, torch.device("meta")) == []
