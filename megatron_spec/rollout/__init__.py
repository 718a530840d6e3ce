"""Rollout engines behind one interface.

``make_engine(config, backend)`` starts the embedded native engine (``native/``: pure
PyTorch in its own process, the default without a GPU) or the SGLang backend
(``sglang_backend``: ``sglang.Engine`` with EAGLE-3, GPU only). Both take
``types.GenerateRequest`` and return ``types.SampleOutput`` + ``types.GenerateStats``, and
both take weight updates as flattened-bucket payloads with a ``target``/``draft`` selector.
"""

from __future__ import annotations

from megatron_spec.rollout.config import EngineConfig


def default_backend() -> str:
    import torch

    return "sglang" if torch.cuda.is_available() else "native"


def make_engine(config: EngineConfig, backend: str | None = None, *, mem_fraction_static: float | None = None,
                tp_size: int = 1, temperatures: tuple[float, ...] = ()):
    """Start a rollout engine; the caller shuts it down (it is a context manager).

    Args:
        tp_size: the engine's tensor parallelism (SGLang; its GPUs are this process's device and
            the next ``tp_size - 1``: the colocated ranks of ``megatron_spec.rollout.fleet``). The
            native engine runs on one device and takes 1 only.
        mem_fraction_static: SGLang's share of the GPU for weights and KV cache (colocated runs
            leave the rest to the trainer, docs/memory_plan.md); ``None`` lets SGLang choose. The
            native engine sizes its KV cache from ``config`` and ignores it.
    """
    backend = backend or default_backend()
    if backend == "native":
        from megatron_spec.rollout.native.client import NativeEngine

        if tp_size != 1:
            raise ValueError(f"the native engine runs on one device: tp_size must be 1, got {tp_size}")
        return NativeEngine(config)
    if backend == "sglang":
        from megatron_spec.rollout.sglang_backend import SGLangEngine

        overrides = {} if mem_fraction_static is None else {"mem_fraction_static": mem_fraction_static}
        # --rollout-engine-kwargs: through ServerArgs and the lossless guard
        overrides.update(config.engine_kwargs)
        return SGLangEngine(config, tp_size=tp_size, server_overrides=overrides)
    if backend == "vllm":
        from megatron_spec.rollout.vllm_backend import VllmEngine

        if tp_size != 1:
            raise ValueError(
                f"the vLLM engine is driven with one TP rank here: tp_size must be 1, got {tp_size}"
            )
        return VllmEngine(config, python=config.vllm_python, temperatures=temperatures)
    raise ValueError(f"rollout backend must be 'native', 'sglang' or 'vllm', got {backend!r}")
