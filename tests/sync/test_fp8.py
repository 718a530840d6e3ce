"""Which tensors travel as block FP8, their names, and the receiving side's dequantisation."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.ops import fp8_block_dequantize_reference, fp8_block_quantize_reference
from megatron_spec.sync.fp8 import (
    dequantize_named,
    is_fp8_weight,
    quantization_config,
    quantize_named,
    scale_name,
    scale_shape,
)


@pytest.mark.parametrize("name,expected", [
    ("model.layers.0.self_attn.q_proj.weight", True),
    ("model.layers.11.self_attn.o_proj.weight", True),
    ("model.layers.3.mlp.gate_proj.weight", True),
    ("model.layers.3.mlp.down_proj.weight", True),
    ("model.layers.0.self_attn.q_proj.bias", False),  # biases stay
    ("model.layers.0.self_attn.q_norm.weight", False),
    ("model.layers.0.input_layernorm.weight", False),
    ("model.embed_tokens.weight", False),
    ("lm_head.weight", False),
    ("model.norm.weight", False),
])
def test_selection(name, expected):
    shape = (256, 128) if name.endswith("weight") else (256,)
    assert is_fp8_weight(name, shape) is expected


def test_quantize_then_dequantize_matches_the_kernel_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.05  # partial blocks at both edges
    named = [("model.layers.0.mlp.up_proj.weight", w), ("model.norm.weight", torch.ones(200))]
    sent = list(quantize_named(named))
    assert [n for n, _ in sent] == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight_scale_inv",
        "model.norm.weight",
    ]
    q_ref, s_ref = fp8_block_quantize_reference(w)
    assert torch.equal(sent[0][1].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(sent[1][1], s_ref) and sent[1][1].shape == scale_shape((300, 200)) == (3, 2)
    back = dict(dequantize_named(sent, torch.float32))
    assert set(back) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert torch.equal(
        back["model.layers.0.mlp.up_proj.weight"],
        fp8_block_dequantize_reference(q_ref, s_ref, dtype=torch.float32),
    )
    err = (back["model.layers.0.mlp.up_proj.weight"] - w).abs().max() / w.abs().max()
    assert 0 < err < 0.07  # e4m3 keeps 3 mantissa bits: relative error below 2**-4 of the block amax


def test_unpaired_tensors_are_errors():
    w, s = fp8_block_quantize_reference(torch.randn(8, 8))
    with pytest.raises(ValueError, match="without .*weight_scale_inv"):
        dequantize_named([("model.layers.0.mlp.up_proj.weight", w)], torch.float32)
    with pytest.raises(ValueError, match="without its FP8 weight"):
        dequantize_named([(scale_name("model.layers.0.mlp.up_proj.weight"), s)], torch.float32)
    with pytest.raises(ValueError, match="not a linear weight"):
        dequantize_named([("model.embed_tokens.weight", w), ("model.embed_tokens.weight_scale_inv", s)],
                         torch.float32)


def test_quantization_config_is_sglangs_block_fp8():
    assert quantization_config() == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
