"""Megatron DDP around the policy, and handing its gradients to a torch optimizer.

megatron-core's DDP keeps gradients in contiguous buffers (``param.main_grad``) and reduces
them across data-parallel ranks in ``finalize_model_grads`` (which also all-reduces
layer-norm gradients under sequence parallelism). On CPU, megatron's own optimizer needs
more patching than it is worth (docs/design.md, "megatron-core on CPU"), so the policy uses a
torch optimizer: :func:`finalize_grads` points each ``param.grad`` at its reduced ``main_grad``.

The draft model never goes through here: it has its own optimizer and DP all-reduce.
"""

from __future__ import annotations

import torch

from megatron_spec.compat import ensure_megatron_compat


def wrap_ddp(model: torch.nn.Module, *, bucket_size: int | None = None, grad_reduce_in_fp32: bool = True):
    """Wrap a GPTModel in megatron-core's DistributedDataParallel (no overlap, no dist-opt)."""
    ensure_megatron_compat()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    return ddp


def finalize_grads(ddp_model: torch.nn.Module, num_tokens: torch.Tensor | None = None, *,
                   as_param_grad: bool = True) -> None:
    """Reduce gradients across DP (and SP layer norms) and expose them as ``param.grad``.

    Args:
        num_tokens: if given, gradients are divided by this global token count (megatron's
            ``finalize_model_grads`` semantics) instead of averaged over DP ranks.
        as_param_grad: point ``param.grad`` at the reduced gradient (a copy in the parameter's
            dtype for bf16 weights). ``False`` leaves them in the fp32 ``main_grad`` buffers only,
            where :class:`megatron_spec.train.optimizer.MixedPrecisionAdamW` reads them.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model], num_tokens=num_tokens)
    if not as_param_grad:
        return
    for param in ddp_model.module.parameters():
        if param.requires_grad:
            param.grad = (
                param.main_grad.to(param.dtype) if param.main_grad.dtype != param.dtype else param.main_grad
            )


def zero_grads(ddp_model: torch.nn.Module) -> None:
    """Zero the DDP gradient buffers (and drop ``param.grad`` views)."""
    ddp_model.zero_grad_buffer()
    for param in ddp_model.module.parameters():
        param.grad = None
