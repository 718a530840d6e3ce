"""``megatron_spec::decoder_layers`` (csrc/decoder_cpu.cpp): the engine's decoder layers run from C++ give the
bits of the Python layers (``layers.decoder.DecoderLayer``) in every case the model hands over to it, leave
the same KV cache behind, and are not used where the Python layer would call other ops."""

from __future__ import annotations

import pytest
import torch

import megatron_spec.ops  # noqa: F401  (the fake kernels)
from megatron_spec.isa import probe
from megatron_spec.layers import fused_layers, linear
from megatron_spec.layers.linear import pack_linears
from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.rollout.native.model import CausalLM

_RUN_FUSED = CausalLM._run_fused


def make_model(dtype: torch.dtype, family: str = "llama", layers: int = 3, qk_norm: bool = False) -> CausalLM:
    cfg = DecoderConfig(
        architecture={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
            family
        ],
        family=family,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_layers=layers,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=family == "qwen2",
        qk_norm=qk_norm,
    )
    g = torch.Generator().manual_seed(3)
    m = CausalLM(cfg, max_positions=256)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = 0.3 if name.endswith("embed_tokens.weight") else 0.08
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_((base + scale * torch.randn(p.shape, generator=g)).bfloat16().float())  # bf16 numbers
    m = m.to(dtype).eval()
    pack_linears(m)
    return m


def run(m: CausalLM, fused: bool, monkeypatch, aux_layers=(0, 1)):
    """A prefill of three rows (39 rows), decode steps with rows of different lengths, a verify of 4 tokens a
    row (every position's logits), a segment at a slot offset, then a prefill of 142 rows (over the kernels'
    row limit), all with aux layers; returns every output, the caches, and how many layers each forward ran
    in C++."""
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", fused)
    ran = []

    def counting(self, *a, **kw):
        done, x = _RUN_FUSED(self, *a, **kw)
        ran.append(done)
        return done, x

    monkeypatch.setattr(CausalLM, "_run_fused", counting)
    g = torch.Generator().manual_seed(11)
    v = m.cfg.vocab_size
    cache = m.new_cache(5, 96)
    outs = []
    with torch.inference_mode():
        lens = torch.tensor([9, 5, 13])
        ids = torch.randint(0, v, (3, 13), generator=g)
        pos = torch.arange(13).expand(3, 13)
        outs += m(ids, pos, cache, lens, logits_index=(lens - 1).view(3, 1), aux_layers=aux_layers)
        for _ in range(3):  # decode
            ids = torch.randint(0, v, (3, 1), generator=g)
            outs += m(ids, lens.view(3, 1), cache, lens + 1, aux_layers=aux_layers)
            lens = lens + 1
        ids = torch.randint(0, v, (3, 4), generator=g)  # verify: every position's logits
        pos = lens.view(3, 1) + torch.arange(4)
        outs += m(ids, pos, cache, lens + 4, aux_layers=aux_layers)
        outs += m(ids[:2, :2], pos[:2, :2], cache, lens[:2] + 2, slot_offset=3)  # rows in slots 3 and 4
        big = torch.randint(0, v, (2, 71), generator=g)  # over the row limit: the Python layers
        outs += m(big, torch.arange(71).expand(2, 71), cache, torch.tensor([71, 71]),
                  logits_index=torch.tensor([[70], [70]]), aux_layers=aux_layers, slot_offset=3)
    return [o for o in outs if o is not None], [c.clone() for c in cache.k + cache.v], ran


@pytest.mark.parametrize("dtype,family", [(torch.float32, "llama"), (torch.float32, "qwen2"),
                                          (torch.bfloat16, "llama"), (torch.bfloat16, "qwen2")])
def test_same_bits_as_the_python_layers(dtype, family, monkeypatch, kernel_variant):
    if not fused_layers.fused_layers_available(dtype):
        pytest.skip(f"the extension's {dtype} kernels do not all run here")
    if dtype == torch.bfloat16 and not probe().native_bf16:  # oneDNN cannot pack bf16: no bf16 engine here
        pytest.skip("no native bf16 on this CPU (or MEGATRON_SPEC_NO_NATIVE_BF16=1)")
    m = make_model(dtype, family)
    if m.layers[0].mlp.down_proj._small is None:
        pytest.skip(f"no {dtype} panels here (bf16 needs bf16 dot products)")
    want, want_cache, ran_py = run(m, False, monkeypatch)
    got, got_cache, ran = run(m, True, monkeypatch)
    assert not any(ran_py)
    # every forward of at most the row limit ran its layers in C++ (a prefill's last layer, which computes
    # only the rows whose logits are wanted, stays in Python); the 142-row prefill ran none
    assert ran == [2, 3, 3, 3, 3, 3, 0]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(got_cache, want_cache):
        assert torch.equal(a, b)


def test_not_where_the_python_layer_calls_other_ops(monkeypatch):
    """Under autograd, with unpacked weights, with Qwen3's q/k norms, or for more rows than the panels serve,
    the model keeps its Python layers."""
    if not fused_layers.fused_layers_available(torch.float32):
        pytest.skip("the extension's fp32 kernels do not all run here")
    m = make_model(torch.float32)
    x = torch.zeros(4, 64)
    with torch.inference_mode():
        assert fused_layers.fused_stack(m.layers, x) is not None
        assert fused_layers.fused_stack(m.layers, torch.zeros(linear.SMALL_MAX_ROWS + 1, 64)) is None
        assert fused_layers.fused_stack([], x) is None
        monkeypatch.setattr(fused_layers, "FUSED_LAYERS", False)
        assert fused_layers.fused_stack(m.layers, x) is None
        monkeypatch.setattr(fused_layers, "FUSED_LAYERS", True)
    with torch.enable_grad():
        assert fused_layers.fused_stack(m.layers, x) is None
    with torch.inference_mode():
        assert fused_layers.fused_stack(m.layers, x.bfloat16()) is None  # fp32 weights, bf16 input
        pack_linears(m, enable=False)
        assert fused_layers.fused_stack(m.layers, x) is None
        assert fused_layers.fused_stack(make_model(torch.float32, "qwen3", qk_norm=True).layers, x) is None


def test_refuses_inconsistent_arguments():
    if not fused_layers.fused_layers_available(torch.float32):
        pytest.skip("the extension's fp32 kernels do not all run here")
    m = make_model(torch.float32, layers=2)
    with torch.inference_mode():
        weights, biases = fused_layers.fused_stack(m.layers, torch.zeros(2, 64))
    cache = m.new_cache(2, 8)
    cos, sin = m.rotary.tables(torch.zeros(2, 1, dtype=torch.long), torch.float32)
    args = {"write_index": cache.write_index(torch.zeros(2, 1, dtype=torch.long)), "cos": cos, "sin": sin,
            "mask": torch.ones(2, 1, 1, 8, dtype=torch.bool), "b": 2, "t": 1, "read_len": 8, "slot_offset": 0,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate": 80, "eps": 1e-5, "scale": 0.25}
    op = torch.ops.megatron_spec.decoder_layers
    with pytest.raises(RuntimeError, match="6 weights|need"):
        op(torch.zeros(2, 64), weights[:-1], biases, cache.k, cache.v, aux_layers=[], **args)
    with pytest.raises(RuntimeError, match="aux layer"):
        op(torch.zeros(2, 64), weights, biases, cache.k, cache.v, aux_layers=[2], **args)
    with pytest.raises(RuntimeError, match=r"\[b \* t, H\]"):
        op(torch.zeros(3, 64), weights, biases, cache.k, cache.v, aux_layers=[], **args)


def test_repacked_weights_reach_the_cpp_layers(monkeypatch):
    """The model keeps the C++ layers' argument lists between forwards; new weights packed after a load (as
    the
    engine does after every update) are what the next forward runs."""
    if not fused_layers.fused_layers_available(torch.float32):
        pytest.skip("the extension's fp32 kernels do not all run here")
    m = make_model(torch.float32)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5).expand(2, 5)

    def forward():
        with torch.inference_mode():
            return m(ids, pos, m.new_cache(2, 16), torch.tensor([5, 5]))[0]

    before = forward()
    with torch.no_grad():
        for layer in m.layers:
            layer.mlp.down_proj.weight.mul_(0.5)  # still bf16 numbers
    pack_linears(m)
    after = forward()
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", False)
    assert torch.equal(after, forward()) and not torch.equal(after, before)
