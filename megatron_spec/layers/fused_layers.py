"""When a stack of :class:`~megatron_spec.layers.decoder.DecoderLayer` may run as one call of the extension's
``megatron_spec::decoder_layers`` (``csrc/decoder_cpu.cpp``: the same ops in the same order, called from C++;
the same bits), and the argument lists that call takes.

It does not run the layers, know which rows a forward holds or cache the lists
(``megatron_spec.rollout.native.model.CausalLM`` does), and it does not know models or weight names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_spec.layers.decoder import (
    KERNEL_SUFFIX,
    DecoderLayer,
    attention_kernel_available,
    kernel_available,
    norm_rope_kernels_available,
)
from megatron_spec.layers.linear import SMALL_MAX_ROWS, SMALL_MAX_ROWS_BF16

FUSED_LAYERS = True
"""Let :func:`fused_stack` hand eligible layer stacks to ``megatron_spec::decoder_layers``. False keeps every
layer in Python (benchmarks compare both)."""


def fused_layers_available(dtype: torch.dtype) -> bool:
    """Whether ``megatron_spec::decoder_layers`` and the kernels it calls for ``dtype`` (fp32 or bf16) run
    here."""
    return (attention_kernel_available(dtype) and norm_rope_kernels_available(dtype)
            and kernel_available("decoder_layers"))


def fused_input(x: torch.Tensor) -> bool:
    """The part of :func:`fused_stack`'s conditions that depends on the call, not on the layers: the switch,
    the CPU, fp32 or bf16 with the extension's kernels, no gradient, not compiling, at most the panels'
    rows."""
    dt = x.dtype
    return (FUSED_LAYERS and x.device.type == "cpu" and dt in KERNEL_SUFFIX and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and fused_layers_available(dt)
            and x.shape[0] <= (SMALL_MAX_ROWS_BF16 if dt == torch.bfloat16 else SMALL_MAX_ROWS))


def fused_stack(layers: Sequence[DecoderLayer], x: torch.Tensor) -> tuple[list[torch.Tensor], list] | None:
    """The arguments of ``megatron_spec::decoder_layers`` for running ``layers`` over ``x [N, H]`` (weights,
    6 a layer, and each layer's q/k/v bias), or None where the Python layer must run them.

    They may run there only where :meth:`DecoderLayer.forward_flat` would call exactly the ops the C++ layer
    calls: no gradient, not under torch.compile, on the CPU in fp32 or bf16 with the extension's norm, RoPE
    and attention kernels; every projection packed into the extension's panels for ``x.dtype``
    (:meth:`Linear.pack`) and at most the rows they take (:data:`SMALL_MAX_ROWS`, :data:`SMALL_MAX_ROWS_BF16`:
    decode and verify sizes, not prefills); no per-head q/k norms (Qwen3). The caller keeps to one segment
    with no packed or dropped rows (:class:`~megatron_spec.layers.decoder.LayerPlan`).

    Why: ~45 ops a layer called from Python cost 3-4 ms of a SmolLM2 decode step between the ops (14 ms at
    batch 1, bf16 on a 2-core Zen 4: ``benchmarks/profile_engine_step.py``)."""
    if not layers or not fused_input(x):
        return None
    dt = x.dtype
    dims = 4 if dt == torch.bfloat16 else 3  # linear_pack_bf16's panels, or linear_pack_f32 / _bf16w's
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m._packed is None or m._small is None or m._small.dim() != dims or m.weight.dtype != dt
               for m in linears):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != dt or w.device.type != "cpu" for w in norms):
            return None
        weights += [norms[0], attn.qkv_proj._small, attn.o_proj._small, norms[1], mlp.gate_up_proj._small,
                    mlp.down_proj._small]
        biases.append(attn.qkv_proj.bias)
    return weights, biases
