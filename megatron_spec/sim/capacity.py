"""Whether a simulated RL step's layout can run at all, and how many sequences its engines hold.

The split of the GPUs between generation and training, the engines the generation GPUs make (``tp`` and
``ep`` against the model's heads and experts), and the memory of one engine device (target and draft weights,
the KV cache left for sequences, hence the concurrency) and of one training device (Megatron's training
state). A layout that cannot hold the weights or one sequence raises :class:`LayoutError`; any other problem,
``ValueError``.

It does not time anything (``megatron_spec.sim.roofline``, ``megatron_spec.sim.rl_step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_spec.sim.hardware import HardwareProfile
from megatron_spec.sim.models import ModelProfile
from megatron_spec.sim.params import EngineSettings
from megatron_spec.sim.roofline import ForwardModel, Parallelism
from megatron_spec.sim.workload import Workload

if TYPE_CHECKING:
    from megatron_spec.sim.rl_step import SimConfig

#: bytes per parameter of Megatron training state: bf16 weights, fp32 grads, fp32 master
#: weights, Adam m and v (Megatron distributed optimizer).
TRAIN_BYTES_PER_PARAM = 18


class LayoutError(ValueError):
    """The engine layout (tp, ep, engines) cannot hold the model's weights or one sequence's KV
    cache. The layout search (:mod:`megatron_spec.sim.layout`) skips such layouts; any other
    ValueError is a problem with the configuration as a whole."""


@dataclass(frozen=True)
class EnginePlacement:
    """How the GPUs of one simulated step are used."""

    gen_gpus: int
    """GPUs the engines generate on (fewer than the split leaves to generation when ``num_engines`` is
    pinned)."""
    train_gpus: int
    """GPUs that train (in sync mode all of them, colocated with generation)."""
    engines: int
    """Rollout engines of ``tp x ep`` devices on the generation GPUs."""


def split_gpus(cfg: SimConfig, engine_devices: int) -> tuple[int, int]:
    """(generation GPUs, training GPUs)."""
    if cfg.mode == "sync":
        if cfg.train_gpus not in (None, cfg.num_gpus):
            raise ValueError("--train-gpus applies to async mode only (sync mode colocates generation "
                             "and training on all GPUs)")
        return cfg.num_gpus, cfg.num_gpus
    train = cfg.train_gpus if cfg.train_gpus is not None else max(1, cfg.num_gpus // 4)
    if not 1 <= train < cfg.num_gpus:
        raise ValueError(f"async mode needs 1 <= train_gpus < num_gpus, got train_gpus={train} of "
                         f"num_gpus={cfg.num_gpus}")
    return cfg.num_gpus - train, train


def check_parallelism(model: ModelProfile, par: Parallelism) -> None:
    """``tp`` divides the attention heads; ``ep`` > 1 only for an MoE model, dividing its experts."""
    if model.heads % par.tp:
        raise ValueError(f"tp={par.tp} does not divide the {model.heads} attention heads of {model.name!r}")
    if par.ep > 1 and not model.is_moe:
        raise ValueError(f"ep={par.ep} needs an MoE model; {model.name!r} is dense")
    if model.is_moe and model.num_experts % par.ep:
        raise ValueError(f"ep={par.ep} does not divide the {model.num_experts} experts of {model.name!r}")


def place_engines(cfg: SimConfig, par: Parallelism) -> EnginePlacement:
    """The GPU split (:func:`split_gpus`) and the engines the generation GPUs hold (``cfg.num_engines`` pins
    fewer, leaving the rest idle)."""
    gen_gpus, train_gpus = split_gpus(cfg, par.engine_devices)
    if gen_gpus % par.engine_devices and cfg.num_engines is None:
        raise ValueError(f"{gen_gpus} generation GPUs are not a multiple of the {par.engine_devices} "
                         f"devices per engine (max(tp={par.tp}, ep={par.ep})); pin --rollout-num-engines "
                         "to leave the rest idle")
    engines = gen_gpus // par.engine_devices
    if cfg.num_engines is not None:
        if not 1 <= cfg.num_engines <= engines:
            raise ValueError(f"num_engines={cfg.num_engines} engines of {par.engine_devices} devices need "
                             f"{cfg.num_engines * par.engine_devices} GPUs; {gen_gpus} generate "
                             f"(at most {engines} engines)")
        engines = cfg.num_engines
        gen_gpus = engines * par.engine_devices
    return EnginePlacement(gen_gpus, train_gpus, engines)


def engine_memory(cfg: SimConfig, model: ModelProfile, hw: HardwareProfile, settings: EngineSettings,
                  target: ForwardModel, draft: ForwardModel | None, wl: Workload, train_gpus: int) -> dict:
    """Weights per engine device, the KV cache the engines hold (tokens) and the sequences they run at once
    (``concurrency``); raises where the weights, one sequence or the training state do not fit."""
    usable = hw.memory_bytes * settings.mem_util - settings.workspace_bytes
    w = target.weight_bytes_per_device()
    if draft is not None:
        dw = draft.weight_bytes_per_device()
        if cfg.draft_kind == "mtp":  # the MTP module shares the target's LM head
            dw -= draft.model.lm_head_params * draft.wbytes / draft.par.tp
        w += dw
    par = target.par
    if w > usable:
        raise LayoutError(
            f"{model.name} does not fit: {w / 1e9:.1f} GB of {target.dtype} weights per device with "
            f"tp={par.tp} ep={par.ep}, but one {hw.name} offers {usable / 1e9:.1f} GB "
            f"({hw.memory_bytes / 1e9:.0f} GB x mem_util {settings.mem_util} - "
            f"{settings.workspace_bytes / 1e9:.1f} GB workspace); raise --tp/--ep")
    kv_tok = target.kv_bytes_per_token_per_device()
    if draft is not None:
        kv_tok += draft.kv_bytes_per_token_per_device()
    group_tokens = (usable - w) / kv_tok  # tokens one attention group can cache
    need = wl.prompt_len + wl.max_response_len + cfg.num_draft_tokens + 1
    if group_tokens < need:
        raise LayoutError(
            f"{model.name} on {hw.name} with tp={par.tp} ep={par.ep}: the KV cache holds "
            f"{group_tokens:.0f} tokens per engine group but one sequence needs prompt_len + "
            f"max_response_len + k + 1 = {need}; raise --tp or shorten responses")
    mean_seq = wl.prompt_len + wl.mean_response_len()
    concurrency = int(min(settings.max_num_seqs * par.attn_groups,
                          math.floor(group_tokens / mean_seq) * par.attn_groups))
    train_need = TRAIN_BYTES_PER_PARAM * model.total_params / train_gpus
    if train_need > hw.memory_bytes:
        raise ValueError(
            f"training {model.name} needs at least {train_need / 1e9:.0f} GB per device "
            f"({TRAIN_BYTES_PER_PARAM} B/param of weights, grads and Adam states, fully sharded over "
            f"{train_gpus} training devices) but one {hw.name} has {hw.memory_bytes / 1e9:.0f} GB; "
            "use more GPUs")
    return {"weights_gb_per_device": w / 1e9, "kv_capacity_tokens": group_tokens * par.attn_groups,
            "concurrency": concurrency}
