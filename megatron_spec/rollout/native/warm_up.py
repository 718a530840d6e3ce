"""Readies the native engine's modules for inference before its first call: linear weights pre-packed for
oneDNN (their panels moved to huge pages), each packed linear called once per decode-sized row count
(``EngineConfig.warm_up``), and with ``EngineConfig.compile`` the target's decoder layers compiled, one graph
per step-shape class.

This module does not know about requests, drafting or weight updates; it runs dummy forwards on the
engine's own cache, whose entries the next prefill overwrites.
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_spec.layers.compiled import compiling_pays
from megatron_spec.layers.decoder import use_fused_attention
from megatron_spec.layers.kv_cache import KVCache
from megatron_spec.layers.linear import pack_linears, warm_linears
from megatron_spec.layers.panel_memory import place_panels
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.model import CausalLM

logger = logging.getLogger(__name__)


def prepare_for_inference(target: CausalLM, draft: torch.nn.Module | None, cache: KVCache,
                          config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Pack the target's and the draft's linears, their panels on huge pages (``layers.panel_memory``), warm
    them up, and compile the target's layers where ``config`` asks for it and compiling pays
    (:func:`~megatron_spec.layers.compiled.compiling_pays`)."""
    for module in (target, draft):
        if module is not None:
            pack_linears(module)  # oneDNN-prepacked weights for inference (model.Linear)
    placed = place_panels((target, draft))  # the decode kernels' panels on huge pages
    logger.info("engine panels: %.0f MB on huge pages", placed / 1e6)
    if config.warm_up:
        t0 = time.perf_counter()
        calls = warm_linears([m for m in (target, draft) if m is not None],
                             config.max_batch_size * (config.k_verify + 1))
        logger.info("engine warm-up: %d linear calls in %.2f s", calls, time.perf_counter() - t0)
    if config.compile and device.type == "cpu" and not compiling_pays(dtype):
        logger.info("--rollout-compile: not in %s here, where the extension's C++ decoder layers are "
                    "faster (layers.compiled.compiling_pays)", dtype)
    elif config.compile and device.type == "cpu":
        target.compile_layers()
        if config.warm_up:
            t0 = time.perf_counter()
            warm_compiled(target, cache, config, device, dtype)
            logger.info(
                "engine warm-up: %d compiled layer graphs in %.1f s",
                target.compiled.compiles,
                time.perf_counter() - t0,
            )


def warm_compiled(target: CausalLM, cache: KVCache, config: EngineConfig, device: torch.device,
                  dtype: torch.dtype) -> None:
    """Compile the decoder layer for every class of step shape an engine can meet: one row or several,
    one token or several, and the attention kernel
    :func:`~megatron_spec.layers.decoder.use_fused_attention`
    picks (dynamo makes one graph per class; the sizes within it stay symbolic), each from the first
    of a few representative shapes that falls in it. On the engine's own cache: its sizes are
    constants of the graphs (another cache's would compile them again); the entries written at the
    first positions of the first slots are overwritten by the next prefill there."""
    t_max = config.k_verify + 1
    seen = set()
    with torch.inference_mode():
        for b in sorted({1, 2, 4, 8, config.max_batch_size}):
            for t in sorted({1, 2, 4, 8, t_max}):
                key = (b == 1, t == 1, use_fused_attention(dtype, b, t))
                if b > config.max_batch_size or t > t_max or key in seen:
                    continue
                seen.add(key)
                ids = torch.zeros(b, t, dtype=torch.long, device=device)
                pos = torch.arange(t, device=device).expand(b, t)
                target(ids, pos, cache, torch.full((b,), t, device=device))
