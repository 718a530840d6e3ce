"""CUDA kernels == CPU references (runs only where a GPU and a CUDA build of _C exist)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec import ops
from megatron_spec.ops import fp8_block_quantize_reference, verify_chain_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not ops.compiled_kernel_for("verify_chain", torch.device("cuda")),
        reason="needs a CUDA device and megatron_spec._C built with CUDA",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cuda_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (127, 129), (300, 1000), (1024, 4096)]:
        w = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]).to(dtype)
        q, s = torch.ops.megatron_spec.fp8_block_quantize(w.cuda(), 128, 128)
        q_r, s_r = fp8_block_quantize_reference(w)
        assert torch.equal(q.cpu(), q_r.view(torch.uint8))
        assert torch.equal(s.cpu(), s_r)
        d = torch.ops.megatron_spec.fp8_block_dequantize(q, s, 128, 128, dtype)
        assert torch.equal(d.cpu(), ops.fp8_block_dequantize_reference(q_r, s_r, 128, 128, dtype))


@pytest.mark.parametrize("mode", ["point", "dense", "mapped"])
def test_verify_cuda_matches_cpu_reference(mode):
    g = torch.Generator().manual_seed(1)
    for B, k, V in [(1, 0, 7), (17, 3, 1000), (64, 3, 32768), (8, 5, 152064)]:
        lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g) * 3, -1)
        x = torch.randint(0, V, (B, k), generator=g)
        q = d2t = None
        if mode == "dense":
            q = torch.softmax(torch.randn(B, k, V, generator=g) * 3, -1)
        elif mode == "mapped":
            Vd = V // 2 + 1
            d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
            q = torch.softmax(torch.randn(B, k, Vd, generator=g) * 3, -1)
        greedy = torch.rand(B, generator=g) < 0.3
        ua = torch.rand(B, k, dtype=torch.float64, generator=g)
        us = torch.rand(B, dtype=torch.float64, generator=g)
        args = (lp, x, q, d2t, greedy, ua, us)
        cuda_args = tuple(a.cuda() if a is not None else None for a in args)
        t, n = torch.ops.megatron_spec.verify_chain(*cuda_args)
        t_r, n_r = verify_chain_reference(*args)
        assert torch.equal(t.cpu(), t_r) and torch.equal(n.cpu(), n_r)


def test_verify_cuda_refuses_what_the_reference_refuses():
    """The input checks of issue 18 (tests/ops/test_ops_verify.py run them on the CPU kernels)."""
    g = torch.Generator().manual_seed(2)
    B, k, V = 4, 2, 3000
    lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1)
    x = lp[:, :k].argmax(-1)
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    sampled, greedy = torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)
    nan_greedy = lp.clone()
    nan_greedy[2, 1, 2999] = float("nan")
    shifted = lp.clone()
    shifted[1] += 0.01
    positive = lp.clone()
    positive[3, 0, x[3, 0]] = 0.5
    cases = [
        ((lp * 3 + 1, x, None, None, sampled, ua, us), r"target_logprobs\[0, \d(, \d+)?\]"),
        ((nan_greedy, x, None, None, greedy, ua, us), r"target_logprobs\[2, 1\] contains NaN \(greedy row\)"),
        (
            (shifted, torch.full_like(x, -1), None, None, sampled, ua, us),
            r"target_logprobs\[1, 0\] is not normalised",
        ),
        ((positive, x, None, None, sampled, ua, us), r"target_logprobs\[3, 0, \d+\] = 0\.5"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            verify_chain_reference(*args)
        with pytest.raises(ValueError, match=match):
            torch.ops.megatron_spec.verify_chain(*(a.cuda() if a is not None else None for a in args))
    # a NaN the chain never reads (rows rejected at position 0 never read position 1) is not looked at
    unread = lp.clone()
    unread[:, 1, 0] = float("nan")
    x0 = x.clone()
    x0[:, 0] = (x[:, 0] + 1) % V  # rejected at position 0
    t, n = torch.ops.megatron_spec.verify_chain(
        unread.cuda(), x0.cuda(), None, None, greedy.cuda(), ua.cuda(), us.cuda()
    )
    t_r, n_r = verify_chain_reference(unread, x0, None, None, greedy, ua, us)
    assert torch.equal(t.cpu(), t_r) and torch.equal(n.cpu(), n_r)
    t, n = torch.ops.megatron_spec.verify_chain(
        lp.cuda(), x.cuda(), None, None, greedy.cuda(), ua.cuda(), us.cuda()
    )
    t_r, n_r = verify_chain_reference(lp, x, None, None, greedy, ua, us)
    assert torch.equal(t.cpu(), t_r) and torch.equal(n.cpu(), n_r)


@pytest.mark.parametrize("name", ["draft_tokens", "draft_probs", "greedy", "u_accept", "u_sample"])
def test_cuda_binding_refuses_a_host_tensor(name):
    """Issue 27, defect 3: a host tensor beside CUDA inputs reached the kernel as a host pointer and
    killed the process (illegal address). Both the wrapper and the binding itself name the argument."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 3, 2, 50
    args = {
        "target_logprobs": torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1),
        "draft_tokens": torch.randint(0, V, (B, k), generator=g),
        "draft_probs": torch.softmax(torch.randn(B, k, V, generator=g), -1),
        "d2t": None,
        "greedy": torch.zeros(B, dtype=torch.bool),
        "u_accept": torch.rand(B, k, dtype=torch.float64, generator=g),
        "u_sample": torch.rand(B, dtype=torch.float64, generator=g),
    }
    cuda_args = {n: (a.cuda() if a is not None and n != name else a) for n, a in args.items()}
    with pytest.raises(ValueError, match=f"{name} is on cpu"):
        torch.ops.megatron_spec.verify_chain(*cuda_args.values())
    with pytest.raises(ValueError, match=f"{name} is on cpu"):
        ops.verify_chain_op(**cuda_args)
    torch.cuda.synchronize()  # the context survived: nothing reached the kernel


def test_fp8_cuda_binding_refuses_a_host_scale():
    w = torch.randn(256, 256, device="cuda")
    q, s = torch.ops.megatron_spec.fp8_block_quantize(w, 128, 128)
    with pytest.raises(ValueError, match="scale_inv is on cpu"):
        torch.ops.megatron_spec.fp8_block_dequantize(q, s.cpu(), 128, 128, torch.float32)
    with pytest.raises(ValueError, match="scale_inv is on cpu"):
        torch.ops.megatron_spec.fp8_block_quantize_out(
            w, 128, 128, out=torch.empty_like(q), scale_inv=s.cpu()
        )
    torch.cuda.synchronize()
