"""The native engine process: builds the engine, serves calls from :class:`NativeEngine`.

Calls mirror SGLang's engine API: ``generate``, ``begin_weight_update`` /
``update_weights_from_tensor`` / ``end_weight_update``, ``release_memory`` /
``resume_memory``, ``health``. Weight updates carry a selector (``target`` or ``draft``) and a
version; after ``end_weight_update`` every group that was touched must be complete, and
``health`` reports each group's version and checksum so the trainer can verify what the
engine really holds.

Memory release drops the KV caches and, with the ``weights`` tag, the weights themselves
(as SGLang's release_memory_occupation does without a CPU backup): generation is refused
until both groups have been pushed again. This is the failure peers hit silently (a draft
lost across sleep); here it is an error.

Runs in a spawned process; the only way in is the connection from the handle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from megatron_spec.dtypes import torch_dtype
from megatron_spec.exit import exit_now
from megatron_spec.host_memory import keep_heap
from megatron_spec.interfaces import WeightReceiver
from megatron_spec.layers.linear import pack_linears
from megatron_spec.layers.panel_memory import placed_bytes
from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.drafter_factory import build_drafter, draft_module
from megatron_spec.rollout.native.engine import EngineCore
from megatron_spec.rollout.native.model import CausalLM
from megatron_spec.rollout.native.warm_up import prepare_for_inference
from megatron_spec.rollout.native.weight_session import SYNC_TIMINGS, WeightSession
from megatron_spec.rollout.types import GenerateRequest, check_ready_to_generate
from megatron_spec.sync.fingerprint import Fingerprint

logger = logging.getLogger(__name__)


def tensor_group_checksum(tensors) -> dict:
    """Exact, layout-independent fingerprint of a group of tensors (``megatron_spec.sync.fingerprint``:
    per dtype, element count and sums of the bit patterns and their squares). Equal to the
    trainer's fingerprint of what it sent exactly when the same values are held, whatever the fusion."""
    from megatron_spec.sync.fingerprint import fingerprint_dict

    return fingerprint_dict(tensors)


def _engine_device(config: EngineConfig) -> torch.device:
    """The engine's device (this process's current CUDA device when it is one), after setting the
    process's torch threads where ``config`` fixes them."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"engine device {config.device} but torch sees no CUDA device in the engine process"
            )
        # this process's CUDA context and allocator on the trainer's GPU
        torch.cuda.set_device(device)
    return device


class EngineServer(WeightSession, WeightReceiver):
    """Engine state and the calls the handle makes; in-process, a
    :class:`~megatron_spec.interfaces.WeightReceiver` itself (tests stream into it directly)."""

    keeps_lent_buckets = True  # the target's parameters become views of lent CPU buckets (load_weights)

    def lent_panel_names(self, shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
        from megatron_spec.rollout.native.hf_weights import lent_panel_names

        return lent_panel_names(self.config, shapes)

    def __init__(self, config: EngineConfig):
        config = config.resolved()  # already resolved by the handle; direct users get the same choice
        self.config = config
        self.device = _engine_device(config)
        self.dtype = torch_dtype(config.dtype)
        ckpt = HFCheckpoint(config.model_path)
        self.target_cfg = ckpt.decoder_config
        self.target = CausalLM(self.target_cfg, max_positions=config.context_length + config.k_verify + 1)
        self.target.to(device=self.device, dtype=self.dtype).eval()
        self.versions: dict[str, str | None] = {"target": None, "draft": None}
        if config.load_weights:
            self.target.load_weights((n, ckpt.get(n)) for n in ckpt.weight_names())
            self.versions["target"] = "init"
        built = build_drafter(config, self.target, self.device, self.dtype)
        self.drafter = built.drafter
        self.versions["draft"] = built.version
        self.core = self._build_core()
        self.core.allocate()
        prepare_for_inference(self.target, self._draft_module(), self.core.cache, config, self.device,
                              self.dtype)
        if self.device.type == "cpu":  # the weights and the cache in place: what the forwards allocate stays
            keep_heap()  # on the heap (megatron_spec.host_memory)
        self._updating: dict[str, set[str]] | None = None
        self._session_groups: set[str] = set()  # the groups of the open (or last) weight-update session
        self._generate_calls = 0  # counts generate calls for the fault points (megatron_spec.faults)
        # the last two bucket buffers received (see update_weights_from_tensor)
        self._mapped: list[torch.Tensor] = []
        self._keep_mapped = self.device.type == "cpu"
        """Keep the two mapped buckets between updates (CPU: the sender reuses its shared-memory buffers,
        and a mapping found in torch's cache costs no page faults). On a GPU the trainer frees its buckets
        after each sync, and torch keeps a sent CUDA block alive until every receiver lets go: the engine
        drops its mappings at the end of each update so the trainer's ``torch.cuda.ipc_collect()`` can free
        them."""
        self._released: set[str] = set()
        self._checksums: dict[str, dict] = {}
        """Each group's checksum, computed once after the group's weights changed (dropped on every write)."""
        self._load_fingerprints: dict[str, Fingerprint | None] = {}
        """A weight update's sums of what each group's loads wrote (None: a tensor was written twice)."""
        self._owed: dict[str, set[str]] = {}
        self._linears: dict[str, list] = {}
        self._timings: dict[str, float] = dict.fromkeys(SYNC_TIMINGS, 0.0)
        self._param_shapes = {id(m): {n: tuple(p.shape) for n, p in m.named_parameters()}
                              for m in (self.target, self._draft_module()) if m is not None}

    def _build_core(self) -> EngineCore:
        """The scheduler over the target and the drafter, with the history drafter beside it if asked for
        and the adaptive controller's decision trace."""
        config = self.config
        history = None
        if config.history:
            from megatron_spec.rollout.native.history_drafter import HistoryDrafter

            history = HistoryDrafter(live=config.history_live)
        core = EngineCore(self.target, self.drafter, num_draft_tokens=config.k, adaptive=config.adaptive,
                          history=history, history_max_draft_tokens=config.history_max_draft_tokens,
                          history_tree=config.history_tree, share_prefix=config.share_prefix,
                          max_batch_size=config.max_batch_size, context_length=config.context_length,
                          seed=config.seed, eos_token_ids=self.target_cfg.eos_token_ids)
        if config.spec_trace and core.controller is not None:
            from megatron_spec.rollout.native.decision_trace import DecisionTrace

            core.controller.trace = DecisionTrace(config.spec_trace)
        return core

    def _draft_module(self) -> torch.nn.Module | None:
        return draft_module(self.drafter)

    # ------------------------------------------------------------------ calls
    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "architecture": self.target_cfg.architecture,
            "draft_kind": self.config.draft_kind,
            "num_draft_tokens": self.config.k,
            "adaptive": self.config.adaptive,
            "history": self.config.history,
            "dtype": self.config.dtype,
            "device": str(self.device),
            "max_batch_size": self.config.max_batch_size,
            "context_length": self.config.context_length,
            "torch_threads": torch.get_num_threads(),
            "panels_on_huge_pages_mb": round(placed_bytes((self.target, self._draft_module())) / 1e6, 1),
            "compiled_graphs": self.target.compiled.compiles if self.target.compiled else 0,
            "compile_seconds": round(self.target.compiled.compile_seconds, 2)
            if self.target.compiled
            else 0.0,
        }

    def set_speculation(self, enabled: bool) -> bool:
        """Turn speculative decoding off (autoregressive fallback) or back on; returns the new state."""
        self.core.spec_enabled = bool(enabled) and self.drafter is not None
        return self.core.spec_enabled

    def generate(self, requests: list[GenerateRequest], progress=None, seed: int | None = None):
        missing = [g for g in ("target", "draft") if self._has_group(g) and self.versions[g] is None]
        check_ready_to_generate(updating=self._updating is not None, released=self._released, missing=missing)
        from megatron_spec import faults

        self._generate_calls += 1
        if faults.should_fire("engine_exit_at_generate", self._generate_calls) or faults.should_fire(
            f"engine{self.config.engine_index}_exit_at_generate", self._generate_calls
        ):
            os._exit(3)
        if faults.should_fire(f"engine{self.config.engine_index}_stall_at_generate", self._generate_calls):
            time.sleep(600)  # a generation that never ends (for the trainer's wait timeout)
        self.core.set_weight_versions(self.versions["target"], self.versions["draft"])
        done = [0]

        def on_done(_sample):
            done[0] += 1
            if progress is not None:
                progress(done[0])

        return self.core.generate(requests, on_done, seed=seed)

    def release_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        for tag in tags:
            if tag not in ("kv_cache", "weights"):
                raise ValueError(f"unknown memory tag {tag!r}")
        if "kv_cache" in tags:
            self.core.release()
        if "weights" in tags:
            self._mapped = []
            self._checksums = {}
            for module in (self.target, self._draft_module()):
                if module is None:
                    continue
                pack_linears(module, enable=False)
                for p in module.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.versions = {"target": None, "draft": None}
        if self.device.type == "cuda":  # hand the freed blocks back: the trainer is another process
            torch.cuda.empty_cache()
        self._released |= set(tags)

    def resume_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        """Re-allocate what was released. Weights come back as zeros with no version: they must
        be pushed again (target *and* draft) before ``generate`` is accepted."""
        if "weights" in tags and "weights" in self._released:
            for module in (self.target, self._draft_module()):
                if module is not None:
                    for name, p in module.named_parameters():
                        p.data = torch.zeros(
                            self._param_shapes[id(module)][name], dtype=p.dtype, device=p.device
                        )
        if "kv_cache" in tags and self.core.cache is None:
            self.core.allocate()
        self._released -= {"kv_cache"} & set(tags)

    @property
    def mapped_bucket_bytes(self) -> int:
        """Bytes of the sender's bucket buffers this process still maps (docs/memory_plan.md)."""
        return sum(t.untyped_storage().nbytes() for t in self._mapped)

    def health(self) -> dict[str, Any]:
        """Liveness, each group's version and checksum (of the values held; kept until the group is written
        again), the KV cache and mapped bucket sizes."""
        out = {"alive": True, "pid": os.getpid(), "weight_version": self.versions["target"],
               "draft_weight_version": self.versions["draft"], "released": sorted(self._released),
               "kv_cache_bytes": self.core.cache_bytes, "mapped_bucket_bytes": self.mapped_bucket_bytes,
               "checksums": {}}
        for group in ("target", "draft"):
            module = self.target if group == "target" else self._draft_module()
            if module is not None and self.versions[group] is not None:
                if group not in self._checksums:
                    self._checksums[group] = tensor_group_checksum(module.parameters())
                out["checksums"][group] = self._checksums[group]
        return out


def serve_process(config: EngineConfig, conn) -> None:
    """The engine process's target: :func:`serve`, then the process ends without the interpreter's
    finalisation (``megatron_spec.exit``; 2-3 s the trainer would wait for at every shutdown)."""
    serve(config, conn)
    conn.close()
    exit_now(0)


def serve(config: EngineConfig, conn) -> None:
    """Entry point of the engine process."""
    from megatron_spec.rollout.process import serve as serve_calls

    logging.basicConfig(level=os.environ.get("MEGATRON_SPEC_ENGINE_LOG", "WARNING"))
    serve_calls(lambda: EngineServer(config), conn, "native engine")
