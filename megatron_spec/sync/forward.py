"""One payload per engine TP rank, each from the trainer rank on the same device.

An engine of tensor parallelism T (SGLang ``tp_size``) takes ``update_weights_from_tensor``
with a list of T payloads: engine TP rank i deserialises entry i. Its senders, the T trainer
ranks colocated with its GPUs (``megatron_spec.rollout.fleet.EngineLayout.senders``), each run a
:class:`~megatron_spec.sync.streamer.WeightStreamer` over the same tensors (all-gathered in their
trainer TP groups), packing every bucket on their own device. A payload is a few hundred bytes (a
CUDA IPC handle or a shared-memory name), never the weights: the owner collects the T payloads of
a bucket with ``gather_object`` over the senders' gloo group and makes the one engine call, then
tells the senders the engine has copied the bucket, so each may rewrite its buffer. No weight
crosses from one GPU to another, and none crosses nodes.

:class:`PayloadGather` wraps the owner's engine handle; :class:`PayloadForwarder` stands in for
the engine on the other senders. Every engine call is one round over the group (begin, each
bucket, end), so all senders must stream the same tensors in the same buckets (the streamer does:
its buckets depend only on names, shapes and dtypes). An error on the owner's side reaches every
sender. A sender that fails while packing leaves the others waiting in the group's collective
until its timeout; the run then stops with that error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.interfaces import RolloutEngine, WeightReceiver


class ForwardedCallError(RuntimeError):
    """The owner's engine call failed; raised on every sender of the round."""


def _round(group, owner: int, status: Any) -> Any:
    box = [status]
    dist.broadcast_object_list(box, src=owner, group=group)
    return box[0]


class PayloadGather(WeightReceiver):
    """The owner's engine handle, seen by its streamer as an engine that takes one payload per call.

    Args:
        engine: the real engine handle (``tp_size`` payloads per update).
        group: the gloo group of the engine's senders, owner first.
        owner: the owner's global rank.
    """

    tp_size = 1  # each sender's streamer makes its own payload; this object makes the list

    def __init__(self, engine: RolloutEngine, group: dist.ProcessGroup, owner: int, num_senders: int):
        self.engine = engine
        self.group = group
        self.owner = owner
        self.num_senders = num_senders
        # what the streamer reads of the engine itself (local: no round)
        self.config = engine.config
        self.checksum_kind = engine.checksum_kind
        self.digest_ledger = engine.digest_ledger

    def remember_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self.engine.remember_draft(named_tensors, version)

    def startup_fingerprint(self, group: str):
        return self.engine.startup_fingerprint(group)

    def health(self, timeout: float = 60.0) -> dict[str, Any]:
        return self.engine.health(timeout)

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            result = fn(*args, **kwargs)
            status = ("ok", result)
        except Exception as exc:  # re-raised here and on every sender
            _round(self.group, self.owner, ("error", f"{type(exc).__name__}: {exc}"))
            raise
        _round(self.group, self.owner, status)
        return result

    def begin_weight_update(self, selector: str = "all") -> None:
        self._call(self.engine.begin_weight_update, selector)

    def update_weights_from_tensor(
        self,
        payloads: Sequence[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Any:
        if len(payloads) != 1:
            raise ValueError(f"each sender makes one payload per bucket, got {len(payloads)}")
        gathered: list[Any] = [None] * self.num_senders
        dist.gather_object(payloads[0], gathered, dst=self.owner, group=self.group)
        return self._call(self.engine.update_weights_from_tensor, gathered, selector=selector,
                          weight_version=weight_version, flush_cache=flush_cache)

    def end_weight_update(self) -> Any:
        return self._call(self.engine.end_weight_update)

    def abort_weight_update(self) -> None:
        """Local (no round): close the engine's session after a failed bucket."""
        self.engine.abort_weight_update()


class PayloadForwarder(WeightReceiver):
    """A non-owner sender's stand-in for the engine: forwards payloads to the owner.

    Its streamer should run with ``verify=False`` (the owner compares checksums); versions are
    still checked on the health the owner passes on.
    """

    def __init__(self, group: dist.ProcessGroup, owner: int):
        self.group = group
        self.owner = owner

    def _wait(self, method: str) -> Any:
        kind, payload = _round(self.group, self.owner, None)
        if kind != "ok":
            raise ForwardedCallError(f"the engine owner (rank {self.owner}) failed {method}: {payload}")
        return payload

    def begin_weight_update(self, selector: str = "all") -> None:
        self._wait("begin_weight_update")

    def update_weights_from_tensor(
        self,
        payloads: Sequence[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Any:
        if len(payloads) != 1:
            raise ValueError(f"each sender makes one payload per bucket, got {len(payloads)}")
        dist.gather_object(payloads[0], None, dst=self.owner, group=self.group)
        return self._wait("update_weights_from_tensor")

    def end_weight_update(self) -> Any:
        return self._wait("end_weight_update")

    def abort_weight_update(self) -> None:
        """Local: after a failed round every sender stops at the same bucket (all saw the error);
        the owner closes the engine's session."""

    def health(self, timeout: float = 60.0) -> dict:
        raise RuntimeError("a forwarding sender has no engine to ask; the owner verifies")
