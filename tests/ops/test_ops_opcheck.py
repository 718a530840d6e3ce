"""torch.library.opcheck for every compiled op: schema, fake kernel, dispatch and aliasing rules."""

from __future__ import annotations

import pytest
import torch

from megatron_spec import ops

pytestmark = pytest.mark.skipif(
    not ops.compiled_kernel_for("verify_chain", torch.device("cpu")),
    reason="compiled ops unavailable: megatron_spec._C not built (pip install --no-build-isolation -e .) or "
           "MEGATRON_SPEC_FORCE_REFERENCE=1",
)


def verify_samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for B, k, V, mode in [(4, 3, 50, "dense"), (3, 2, 300, "mapped"), (5, 1, 17, "point"), (0, 2, 8, "point"),
                          (2, 0, 9, "point")]:
        lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1)
        x = torch.randint(0, V, (B, k), generator=g)
        q = d2t = None
        if mode == "dense":
            q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
        elif mode == "mapped":
            Vd = V // 3
            d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
            q = torch.softmax(torch.randn(B, k, Vd, generator=g), -1)
        greedy = torch.arange(B) % 2 == 0
        ua = torch.rand(B, k, dtype=torch.float64, generator=g)
        us = torch.rand(B, dtype=torch.float64, generator=g)
        out.append((lp, x, q, d2t, greedy, ua, us))
    return out


@pytest.mark.parametrize("args", verify_samples())
def test_opcheck_verify_chain(args):
    torch.library.opcheck(torch.ops.megatron_spec.verify_chain.default, args)


@pytest.mark.parametrize("shape", [(0, 0), (5, 0), (127, 129), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_fp8_quantize_and_dequantize(shape, dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.library.opcheck(torch.ops.megatron_spec.fp8_block_quantize.default, (w, 128, 128))
    q, s = torch.ops.megatron_spec.fp8_block_quantize(w, 128, 128)
    torch.library.opcheck(torch.ops.megatron_spec.fp8_block_dequantize.default, (q, s, 128, 128, dtype))
    assert q.dtype == torch.uint8  # e4m3 bytes at the op level
    out = torch.empty_like(q)
    scale = torch.empty_like(s)
    torch.library.opcheck(torch.ops.megatron_spec.fp8_block_quantize_out.default, (w, 128, 128),
                          {"out": out, "scale_inv": scale})


def test_opcheck_spec_exp():
    x = torch.linspace(-100, 5, 1000)
    torch.library.opcheck(torch.ops.megatron_spec.spec_exp.default, (x,))
    torch.library.opcheck(torch.ops.megatron_spec.spec_exp.default, (x.view(10, 100).t(),))


def test_ops_trace_under_torch_compile_with_fake_kernels():
    def step(w):
        q, s = torch.ops.megatron_spec.fp8_block_quantize(w, 128, 128)
        return torch.ops.megatron_spec.fp8_block_dequantize(q, s, 128, 128, torch.float32)

    w = torch.randn(200, 300)
    eager = step(w)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(w)
    assert torch.equal(eager, compiled)
