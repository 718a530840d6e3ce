"""What this package puts inside vLLM's worker: a weight-transfer backend for our buckets, and the calls
the server makes through ``collective_rpc``. Runs in the vLLM environment (its own Python), imported by
vLLM's worker (``worker_extension_cls``), never by the trainer.

vLLM 0.32's RL weight path is a session on the worker: ``start_weight_update`` (or
``start_draft_weight_update``, which points the session at the speculative draft), ``update_weights``
per chunk, ``finish_weight_update``; a :class:`~vllm.distributed.weight_transfer.base.WeightTransferEngine`
backend moves each chunk. Its ``ipc`` backend opens CUDA IPC handles only; this module registers one
more, ``megatron_spec_bucket``, whose chunk is one of our flattened-bucket payloads
(``megatron_spec.sync.transport``: a shared-memory file name on the CPU, a CUDA IPC handle on a GPU),
and loads it the way vLLM's own ``ipc`` backend does: ``initialize_layerwise_reload`` at the start,
``model.load_weights`` per chunk (each layer re-processed into its kernel format, e.g. the CPU build's
pre-packed GEMM weights, as soon as all its tensors arrived), ``finalize_layerwise_reload`` at the end.

What it adds to vLLM's session: the layers each session must deliver (a session that leaves one of them
waiting for its tensors fails at its end, naming it: :func:`unloaded`), and the fingerprint of the values it
loaded, in the model's dtype (``megatron_spec.sync.fingerprint``), which the trainer compares exactly with
what it sent. The fingerprint proves the bytes arrived whole; that the kernels compute with them is what the
backend's greedy health probe and its tests show (the CPU build's packed weights cannot be read back).

It knows nothing of the trainer, the server's protocol or our engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "megatron_spec_bucket"


@dataclasses.dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """No rendezvous: the payloads name their shared memory (or CUDA IPC handle) themselves."""


@dataclasses.dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    payload: bytes
    """One serialised flattened bucket (``megatron_spec.sync.transport.make_bucket_payload``)."""


def tied_layers(model) -> list:
    """Layers whose weight is another layer's (a tied LM head: ``ParallelLMHead.tie_weights`` shares the
    embedding's parameter), in the order ``model.modules()`` meets them after the owner.

    vLLM's layerwise reload processes a layer when its own weights arrive; a tied head receives none (the
    checkpoint names the embedding only), so reload places its old tensors back and does not process it
    again. On the CPU build that leaves the head's pre-packed GEMM weights (``dispatch_cpu_unquantized_gemm``,
    made from the start-up values) stale while the embedding changes: measured on SmolLM2 (tied), weights
    pushed into a dummy-initialised vLLM gave near-uniform log-probs (-10.7 per token, log 49152 = 10.8)
    until the head was processed again. :meth:`BucketWeightTransferEngine.finish_weight_update` does that.
    """
    owners: set[int] = set()
    tied = []
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owners and layer.__dict__.get("quant_method") is not None:
            tied.append(layer)
        owners.add(id(weight))
    return tied


NOT_STREAMED = ("draft_id_to_target_id",)
"""Parameters the trainer never sends: EAGLE-3's draft-to-target vocabulary map (``d2t``) is read once at
start-up (``WeightStreamer.sync_draft`` refuses it)."""


def owned_layers(model, other) -> dict[str, object]:
    """The layers of ``model`` (by name) that hold a parameter of their own: not the other model's (an
    EAGLE-3 draft shares the target's embedding), not an earlier layer's (a tied LM head), not one of
    :data:`NOT_STREAMED`. Every one of them must receive its tensors in a complete update."""
    foreign = {id(p) for p in other.parameters()} if other is not model else set()
    seen: set[int] = set()
    owned = {}
    for name, layer in model.named_modules():
        mine = [(n, p) for n, p in layer.named_parameters(recurse=False) if n not in NOT_STREAMED]
        if any(id(p) not in foreign and id(p) not in seen for _, p in mine):
            owned[name] = layer
        seen.update(id(p) for _, p in mine)
    return owned


def unloaded(owned: dict[str, object]) -> list[str]:
    """The layers of ``owned`` that vLLM's layerwise reload still waits on: nothing arrived, or (but for the
    vocabulary layers, whose padding rows never arrive) only part of their elements. A layer that received
    everything was processed and forgotten by the reload already."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for name, layer in owned.items():
        info = get_layerwise_info(layer)
        if not info.can_load() or not info.load_numel_total:
            continue
        padded = "Embedding" in type(layer).__name__ or "LMHead" in type(layer).__name__
        if info.load_numel == 0 or (info.load_numel < info.load_numel_total and not padded):
            out.append(name)
    return out


class BucketWeightTransferEngine(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """vLLM weight-transfer backend ``megatron_spec_bucket`` (see the module docstring)."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.checksums: dict[str, dict[str, Any]] = {}
        """The last completed session's fingerprint per group (``target``, ``draft``)."""
        self.last_error: str | None = None
        """Why the last session did not complete (None: it did)."""
        self._session: dict[str, Any] | None = None

    @property
    def group(self) -> str:
        """Which model the session loads: vLLM's ``start_draft_weight_update`` retargets it at the draft."""
        return "target" if self.model is self._default_model else "draft"

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from megatron_spec.sync.fingerprint import Fingerprint

        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        self._session = {"owned": owned_layers(self.model, self._default_model), "fingerprint": Fingerprint(),
                         "dtype": dtype, "group": self.group, "tied": tied_layers(self.model)}
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        from megatron_spec.sync.transport import read_bucket_payload

        s = self._session
        # copies: the layerwise loader keeps a layer's tensors until all of them arrived, possibly buckets
        # later, and the sender reuses a bucket's buffer as soon as this call returns (its double buffering)
        named = [(n, t.clone()) for n, t in read_bucket_payload(update_info.payload)]
        for _, t in named:
            s["fingerprint"].add(t, s["dtype"] if t.is_floating_point() else None)
        with disable_mtp_completeness_check():
            self.model.load_weights(iter(named))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        s, self._session = self._session, None
        missing = unloaded(s["owned"])  # before finalize, which forgets what each layer received
        finalize_layerwise_reload(self.model, self.model_config)
        from megatron_spec import faults

        # see tied_layers; the test hook leaves the head stale (what --rollout-reference-check must catch)
        for layer in [] if faults.test_hook("vllm_stale_tied_head") else s["tied"]:
            layer.quant_method.process_weights_after_loading(layer)
        if missing:  # reported, not raised: raising here would leave vLLM's worker inside its session
            self.checksums.pop(s["group"], None)
            self.last_error = (
                f"{s['group']} weight update incomplete: {len(missing)} of vLLM's layers did not "
                f"receive all their tensors, e.g. {missing[:3]}"
            )
            return
        self.last_error = None
        self.checksums[s["group"]] = s["fingerprint"].to_dict()

    def abort(self) -> None:
        """Close a session that failed part-way (the layers loaded so far keep their new values)."""
        if self._session is not None:
            group = self._session["group"]
            self._session = None
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self.checksums.pop(group, None)

    def shutdown(self) -> None:
        self._session = None


def register() -> None:
    """Make the backend known to vLLM's factory (idempotent; every process that builds a worker)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, BucketWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


register()


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): what the server asks of the worker
    besides vLLM's own session calls."""

    def megatron_spec_session_error(self) -> str | None:
        """Why the last weight-update session did not complete (None: it did)."""
        engine = self.weight_transfer_engine
        return engine.last_error if isinstance(engine, BucketWeightTransferEngine) else None

    def megatron_spec_checksums(self) -> dict[str, dict[str, Any]]:
        engine = self.weight_transfer_engine
        return dict(engine.checksums) if isinstance(engine, BucketWeightTransferEngine) else {}

    def megatron_spec_abort_weight_update(self) -> None:
        engine = self.weight_transfer_engine
        if isinstance(engine, BucketWeightTransferEngine) and engine._session is not None:
            engine.abort()
            engine.reset_weight_update_target()
            self._weight_update_active = False
