"""The native engine's decoder layer compiled by ``torch.compile`` (inductor), for its CPU forwards.

A decode step of a small model on a CPU is the weights read once plus, per layer, some twenty small
ops (two RMSNorms, the rotation, the cache writes, attention, the residual adds, SwiGLU), each a
dispatch through PyTorch's eager machinery. On SmolLM2-135M (30 layers) those small ops were a
quarter of a batch-1 decode step (``benchmarks/profile_engine_step.py``), the part vLLM's CPU
build removes by compiling its model with inductor. :func:`layer_step` is one decoder layer as a
function of tensors; :class:`CompiledLayers` compiles it once (``dynamic=True``: one graph serves
every batch size, token count and cache length, apart from the sizes 0/1 that dynamo specialises)
and calls it for every layer with that layer's weights, so 30 layers share one compiled graph.
Inductor fuses the norms, the rotation and the activation into C++ loops; the projections stay the
oneDNN-prepacked matmuls of :class:`~megatron_spec.layers.linear.Linear` behind the custom op
:func:`packed_linear` (inductor's own oneDNN lowering wants the weights frozen into the graph as
constants, which would need one graph per layer and a recompile after every weight update).

The eager :class:`~megatron_spec.layers.decoder.DecoderLayer` stays the reference: the compiled
layer does the same arithmetic in the same dtypes, but inductor's fused reductions add in another
order, so fp32 logits differ from eager ones by rounding (~1e-5 relative; greedy tokens agree, a
test checks it on a real model). Compiled graphs are cached on disk by inductor
(``TORCHINDUCTOR_CACHE_DIR``), so a later engine process compiles much faster than the first.

It does not know about whole models, requests, sampling or drafting.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from megatron_spec.layers.decoder import (
    DecoderLayer,
    LayerPlan,
    attend,
    rms_norm,
    rotate,
    use_fused_attention,
)
from megatron_spec.layers.kv_cache import KVCache
from megatron_spec.layers.linear import packed_matmul

logger = logging.getLogger(__name__)


def compiling_pays(dtype: torch.dtype) -> bool:
    """Whether running the decoder layer compiled is worth it for a CPU engine in ``dtype``.

    Not where the extension's C++ decoder layers run for ``dtype`` (``megatron_spec::decoder_layers`` over its
    attention, RMSNorm, RoPE and linear kernels: ``fused_layers.fused_stack``): they call the same kernels
    without Python between them, while the compiled graph lets inductor fuse the norm and rotation and calls
    the linear through a Python custom op. Measured on SmolLM2-135M on a 2-core Zen 4 (greedy, 64 new tokens,
    ``benchmarks/bench_fused_layers.py``, tokens/s, C++ layers / compiled layer): fp32 78.6 / 64.6 at batch 1,
    295.5 / 283.7 at batch 16 (bf16 before the C++ layers: eager over the kernels 76.0-77.6, compiled
    59.7-61.2 at batch 1). Elsewhere (no extension, or bf16 without bf16 dot products) compiling gains
    1.1-1.2x at batch 1 (docs/benchmark_log.md)."""
    from megatron_spec.layers.fused_layers import fused_layers_available
    from megatron_spec.layers.linear import bf16_small_linear_available, small_linear_available

    panels = bf16_small_linear_available() if dtype == torch.bfloat16 else small_linear_available()
    return not (fused_layers_available(dtype) and panels)


@torch.library.custom_op("megatron_spec_compiled::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    small: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """:func:`~megatron_spec.layers.linear.packed_matmul` (the weights :meth:`Linear.pack` made) as an op
    the compiler calls rather than traces."""
    return packed_matmul(x, packed, small, bias, out_features)


@packed_linear.register_fake
def _packed_linear_fake(x, packed, small, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


LayerWeights = tuple
"""Per layer: ``(input norm, post-attention norm, qkv, qkv bias, o, gate_up, down, q norm, k norm)``, each
projection a pair ``(oneDNN packed or the plain fp32 weight, few-row panels or None)`` (:meth:`Linear.pack`);
the bias and the q/k norms may be None (the model has none)."""


def layer_step(x: torch.Tensor, weights: LayerWeights, dims: tuple, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
    """One decoder layer over ``x [b * t, H]`` (one rectangular segment of ``b`` rows of ``t`` tokens in slots
    ``0..b-1``, every row's output kept): :meth:`DecoderLayer.forward_flat` for one :class:`LayerPlan` without
    ``pack``, ``rows`` or a slot offset, with the layer's K/V written into ``k_cache, v_cache`` (this layer's
    ``[slots, nkv, max_len, d]`` tensors) at ``write_index``. ``dims``: ``(nq, nkv, head_dim, intermediate,
    eps)``; ``cos, sin [b, 1, t, d]``; ``mask [b, 1, t, read_len]``."""
    ln1, ln2, qkv_w, qkv_b, o_w, gate_up_w, down_w, q_norm, k_norm = weights
    nq, nkv, d, inter, eps = dims
    b, _, t, _ = cos.shape
    hidden = x.shape[-1]
    qkv = packed_linear(rms_norm(x, ln1, eps), *qkv_w, qkv_b, (nq + 2 * nkv) * d).view(b, t, -1)
    qk, v = qkv.split([(nq + nkv) * d, nkv * d], dim=-1)
    if q_norm is not None:
        q, k = qk.view(b, t, -1, d).split([nq, nkv], dim=2)
        q = rotate(rms_norm(q, q_norm, eps).transpose(1, 2), cos, sin)
        k = rotate(rms_norm(k, k_norm, eps).transpose(1, 2), cos, sin)
    else:
        q, k = rotate(qk.view(b, t, -1, d).transpose(1, 2), cos, sin).split([nq, nkv], 1)
    v = v.view(b, t, nkv, d).transpose(1, 2)
    k_cache.view(-1, d).index_copy_(0, write_index, k.reshape(-1, d).to(k_cache.dtype))
    v_cache.view(-1, d).index_copy_(0, write_index, v.reshape(-1, d).to(v_cache.dtype))
    length = mask.shape[-1]
    k_all, v_all = k_cache[:b, :, :length], v_cache[:b, :, :length]
    out = attend(q, k_all, v_all, mask, d ** -0.5)
    x = x + packed_linear(out.transpose(1, 2).reshape(b * t, nq * d), *o_w, None, hidden)
    gate, up = packed_linear(rms_norm(x, ln2, eps), *gate_up_w, None, 2 * inter).chunk(2, dim=-1)
    return x + packed_linear(F.silu(gate) * up, *down_w, None, hidden)


def layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """``layer``'s weights for :func:`layer_step`, or None when a projection is not packed for inference
    (a GPU, a dtype oneDNN does not pack, or weights being updated)."""
    a, m = layer.self_attn, layer.mlp
    lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
    if any(lin._packed is None for lin in lins) or a.o_proj.bias is not None:
        return None
    qkv, o, gate_up, down = ((lin._packed, lin._small) for lin in lins)
    return (
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        qkv,
        a.qkv_proj.bias,
        o,
        gate_up,
        down,
        None if a.q_norm is None else a.q_norm.weight,
        None if a.k_norm is None else a.k_norm.weight,
    )


class CompiledLayers:
    """:func:`layer_step` compiled once and run for a stack of :class:`DecoderLayer` s.

    ``compiles`` counts the graphs dynamo built during this instance's calls (one per specialisation:
    batch 1 or more, one token or more, a fused-attention choice; a guard that fails later, a
    recompile, counts too: dynamo's own ``unique_graphs`` counter) and ``compile_seconds`` the time of
    the calls that built one, so the engine can report what compiling cost it and tests can check that
    nothing is built mid-generation.
    """

    def __init__(self, layers: nn.ModuleList, dims: tuple):
        self.layers = layers

        def step(x, weights, cos, sin, k_cache, v_cache, write_index, mask):
            return layer_step(x, weights, dims, cos, sin, k_cache, v_cache, write_index, mask)

        # the model's sizes (hidden, heads, head dim) stay constants of the graph, so inductor writes loops
        # of known length; the sizes that vary (rows, tokens, cache length) are marked dynamic in run()
        self._fn = torch.compile(step, dynamic=False)
        # dynamo keeps the graphs of every instance under one code object (``step``'s), up to
        # ``recompile_limit`` (8) of them, then runs it eagerly: an engine makes 4-6, and several engines
        # in one process (benchmarks, tests) make more
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.compiles = 0
        self.compile_seconds = 0.0

    def weights(self) -> list[LayerWeights] | None:
        """Every layer's weights, or None when one is not packed (the caller runs the eager layers)."""
        out = []
        for layer in self.layers:
            w = layer_weights(layer)
            if w is None:
                return None
            out.append(w)
        return out

    def run(
        self,
        x: torch.Tensor,
        plan: LayerPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layers: range,
        weights: list[LayerWeights],
        aux_layers=(),
        aux: list | None = None,
    ) -> torch.Tensor:
        """Layers ``layers`` over ``x [b * t, H]`` of ``plan`` (no ``pack``, slot offset 0); the outputs of
        the layers in ``aux_layers`` are appended to ``aux``."""
        if not getattr(cache, "_static_for_compile", False):
            # the cache's sizes are fixed for the engine's life: static, so that dynamo neither makes them
            # symbols nor ties them to a batch size that happens to equal the slot count (a recompile)
            for t in cache.k + cache.v:
                torch._dynamo.mark_static(t)
            cache._static_for_compile = True
        # imported here, not with the module: dynamo takes ~1.7 s to import, and every engine imports this
        # module
        # to ask compiling_pays() whether to compile at all
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        for t, dims in (
            (x, (0,)),
            (cos, (0, 2)),
            (sin, (0, 2)),
            (plan.write_index, (0,)),
            (plan.mask, (0, 2, 3)),
        ):
            for dim in dims:
                if t.shape[dim] > 1:  # dynamo specialises sizes 0 and 1 whatever is marked
                    torch._dynamo.maybe_mark_dynamic(t, dim)
        for i in layers:
            x = self._fn(x, weights[i], cos, sin, cache.k[i], cache.v[i], plan.write_index, plan.mask)
            if i in aux_layers:
                aux.append(x)
        built = counters["stats"]["unique_graphs"] - graphs
        if built:
            self.compiles += built
            self.compile_seconds += time.perf_counter() - t0
            logger.info(
                "compiled decoder layer for %d rows x %d tokens (fused attention %s), %s: %.1f s",
                plan.b,
                plan.t,
                use_fused_attention(x.dtype, plan.b, plan.t),
                x.dtype,
                time.perf_counter() - t0,
            )
        return x
