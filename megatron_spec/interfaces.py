"""The interfaces every layer of the package may import: what the rest of the package calls on a rollout
engine and on an online draft learner, and the errors every engine raises.

Three declared interfaces, so no caller probes an object with ``getattr``/``hasattr``:

- :class:`WeightReceiver`: the weight-update half of an engine, all the
  :class:`~megatron_spec.sync.streamer.WeightStreamer` talks to. The engines implement it, and so
  do the payload gather/forwarder that stand in for an engine on its TP senders
  (``megatron_spec.sync.forward``).
- :class:`RolloutEngine`: a whole engine (generation, speculation switch, weight updates and their
  versions, memory release/resume, checksums, shutdown).
  :class:`~megatron_spec.rollout.native.client.NativeEngine`,
  :class:`~megatron_spec.rollout.vllm_backend.VllmEngine` and
  :class:`~megatron_spec.rollout.sglang_backend.SGLangEngine`
  implement every member with the same signature (``tests/rollout/test_api.py`` checks it member by member).
- :class:`DraftLearner`: the EAGLE-3 and MTP online trainers, which declare it
  (``megatron_spec.draft.trainer.Eagle3Trainer``, ``megatron_spec.draft.mtp.MtpTrainer``).

:class:`EngineError` and its subclasses are what every :class:`RolloutEngine` raises for an engine that is
gone (:class:`EngineDiedError`), stuck (:class:`EngineTimeoutError`) or failing a call
(:class:`EngineCallError`), whatever its backend: the rollout manager restarts an engine on the first two.

A class that subclasses :class:`WeightReceiver` explicitly inherits the defaults written here for
the members whose meaning is "nothing to do" for most receivers (no digest ledger, no start-up
fingerprint, no draft kept for a re-push); the engines override them where they do more.

Stdlib only at run time (the vLLM server imports the errors in vLLM's environment); the types named in
annotations are imported for type checkers alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from megatron_spec.capture.cache import DraftCache
    from megatron_spec.capture.config import CaptureConfig
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput
    from megatron_spec.sync.fingerprint import Fingerprint
    from megatron_spec.sync.verify import DigestLedger

class EngineError(RuntimeError):
    """Base class of rollout-engine failures seen by the caller."""


class EngineDiedError(EngineError):
    """The engine (its process) exited while, or before, serving a call."""


class EngineTimeoutError(EngineError):
    """A call took longer than its timeout; the engine was stopped."""


class EngineCallError(EngineError):
    """The engine raised an exception while serving a call."""

    def __init__(self, method: str, exc_type: str, message: str, tb: str, engine: str = "native engine"):
        super().__init__(f"{engine} {method} failed: {exc_type}: {message}")
        self.exc_type, self.engine_traceback = exc_type, tb


MEMORY_TAGS = ("kv_cache", "weights")
"""What ``release_memory``/``resume_memory`` hand back and take again by default."""


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes flattened-bucket weight updates for the ``target`` or ``draft`` group, in sessions.

    A session is ``begin_weight_update(selector)``, any number of ``update_weights_from_tensor``,
    then ``end_weight_update()`` (which returns the receiver's health: versions and checksums) or,
    after a failure part-way, ``abort_weight_update()``.
    """

    config: EngineConfig | None = None
    """The engine's settings; None where the receiver is not the engine itself (a TP sender's
    forwarder: its streamer is told the engine dtype)."""
    checksum_kind: str = "fingerprint"
    """``fingerprint``: ``health()`` reports the bits of the loaded weights, compared with what was
    sent; ``digest``: an opaque hash of the engine's own (SGLang ``check_weights``), compared
    through a :class:`~megatron_spec.sync.verify.DigestLedger`."""
    tp_size: int = 1
    """Payloads per ``update_weights_from_tensor``: one per engine TP rank."""
    digest_ledger: DigestLedger | None = None
    """The book of digests every streamer of a ``digest`` engine checks against (None: each
    streamer keeps its own)."""
    keeps_lent_buckets: bool = False
    """The receiver may compute with a CPU bucket the sender lends it (``"lent"`` in the payload) instead of
    copying it: its parameters become views of the bucket. The sender then gives every bucket of a group a
    buffer of its own and rewrites it only with the next complete update of that group."""

    def begin_weight_update(self, selector: str = "all") -> None:
        """Open a session for ``target``, ``draft`` or ``all``."""
        ...

    def update_weights_from_tensor(
        self,
        payloads: bytes | Sequence[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Load one bucket (``tp_size`` payloads) into ``selector``'s weights, tagged ``weight_version``."""
        ...

    def end_weight_update(self) -> dict[str, Any]:
        """Close the session; raises when an update is incomplete. Returns :meth:`health`."""
        ...

    def abort_weight_update(self) -> None:
        """Close a session whose update failed part-way, leaving the groups it touched without a
        valid version. Default: ``end_weight_update`` (whose completeness check marks them)."""
        try:
            self.end_weight_update()
        except RuntimeError:
            pass

    def remember_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Called after every verified draft sync. Default: nothing (receivers that lose the draft
        on a memory release keep a copy here to push it again on resume)."""

    def startup_fingerprint(self, group: str) -> Fingerprint | None:
        """Fingerprint of the weights ``group`` held at start-up (``digest`` receivers: used once,
        when a first sync leaves a digest unchanged). Default: None (not known)."""
        return None

    def lent_panel_names(self, shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
        """Of the target's fp32 tensors in ``shapes`` (HF name -> shape), those this receiver takes, in a lent
        bucket (:attr:`keeps_lent_buckets`), written in its linear kernel's panel layout (``out[p, c, j] =
        w[16 p + j, c]``) and computes with as they are, packing nothing. Default: none."""
        return frozenset()

    def health(self, timeout: float = 60.0) -> dict[str, Any]:
        """``weight_version``, ``draft_weight_version``, ``checksums`` per group, ``released``, ..."""
        ...


@runtime_checkable
class RolloutEngine(WeightReceiver, Protocol):
    """A rollout engine: the native engine's process handle, the vLLM engine or the SGLang engine (GPU)."""

    backend: ClassVar[str]
    """``native``, ``vllm`` or ``sglang``."""
    config: EngineConfig
    """The resolved settings it runs with (``EngineConfig.resolved``)."""
    info: dict[str, Any]
    """What it reported at start-up (backend, dtype, draft kind, k, ...)."""

    def is_alive(self) -> bool:
        ...

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        on_progress: Callable[[int], None] | None = None,
        timeout: float | None = None,
        seed: int | None = None,
    ) -> tuple[list[SampleOutput], GenerateStats]:
        """Every sample of ``requests``; ``on_progress(samples done)`` while it runs; ``seed`` makes
        the call's sampling independent of earlier calls (where the backend can)."""
        ...

    def set_speculation(self, enabled: bool) -> bool:
        """Speculative decoding on (True) or plain decoding (False); returns the new state."""
        ...

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Hand memory back (colocation); released weights must be pushed again."""
        ...

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take released memory again."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (idempotent)."""
        ...


@runtime_checkable
class DraftLearner(Protocol):
    """An online draft trainer: learns from the verifier's captured forward (through a detached
    branch, its own optimizer) and hands its weights to the engines."""

    step: int
    """Optimizer steps taken."""

    @property
    def module(self) -> torch.nn.Module:
        """The draft being trained (the EAGLE-3 head, the MTP layers)."""
        ...

    def capture_config(self, base: CaptureConfig | None = None) -> CaptureConfig:
        """``base`` with what this draft needs captured from the verifier's forward."""
        ...

    def train_step(self, cache: DraftCache | None) -> dict[str, float]:
        """One optimizer step on ``cache`` (collective over the trainer's groups); ``draft/*`` metrics."""
        ...

    def evaluate(self, cache: DraftCache, steps: int | None = None) -> dict[str, float]:
        """``draft/eval_*`` metrics of the current draft on ``cache`` (held out: before training on it)."""
        ...

    def named_update_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(engine name, tensor)`` of a draft weight update."""
        ...

    def export(self, path: str | os.PathLike) -> None:
        """Write the draft in the layout its engines load at start-up. Collective over the draft's
        groups (every rank calls it; the first one writes)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...
