"""Every op refuses tensor arguments on two devices with an error naming the argument (issue 27, defect 3)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec import ops


def _verify_args(B: int = 3, k: int = 2, V: int = 11):
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g), -1)
    return {"target_logprobs": lp, "draft_tokens": torch.randint(0, V, (B, k), generator=g),
            "draft_probs": torch.softmax(torch.randn(B, k, V, generator=g), -1), "d2t": None,
            "greedy": torch.zeros(B, dtype=torch.bool),
            "u_accept": torch.rand(B, k, dtype=torch.float64, generator=g),
            "u_sample": torch.rand(B, dtype=torch.float64, generator=g)}


@pytest.mark.parametrize("name", ["draft_tokens", "draft_probs", "greedy", "u_accept", "u_sample"])
def test_verify_refuses_a_tensor_on_another_device(name):
    """Issue 27, defect 3: the dispatcher picks the CUDA kernel when any argument is on a GPU, and a host
    tensor beside it reached the kernel as a host pointer (an illegal-address crash). The wrapper names
    the argument; ``meta`` stands in for the other device here (the CUDA binding's own check runs in
    tests/ops/test_ops_cuda.py)."""
    args = _verify_args()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"verify_chain: {name} is on meta, target_logprobs on cpu"):
        ops.verify_chain_op(**args)


def test_fp8_refuses_tensors_on_two_devices():
    w = torch.randn(4, 8)
    q, s = ops.fp8_block_quantize(w)
    with pytest.raises(ValueError, match="fp8_block_dequantize: scale_inv is on meta"):
        ops.fp8_block_dequantize(q, s.to("meta"))
    with pytest.raises(ValueError, match=r"fp8_block_quantize: out\[1\] is on meta"):
        ops.fp8_block_quantize(w, out=(torch.empty_like(q), s.to("meta")))
