"""The trainer's handle of an engine that runs in a process of its own (the native engine, vLLM): every
:class:`~megatron_spec.interfaces.RolloutEngine` call a message over an
:class:`~megatron_spec.rollout.process.EngineChannel`. A subclass starts the process and sets ``config``,
``info``, ``_proc`` and ``_channel``; the calls are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_spec.interfaces import MEMORY_TAGS, RolloutEngine
from megatron_spec.rollout.process import EngineChannel, EngineProcess
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput


class ProcessEngine(RolloutEngine):
    """The calls of an out-of-process engine (see the module docstring); a context manager."""

    _proc: EngineProcess
    _channel: EngineChannel

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def _call(self, method: str, *args, timeout: float | None = None,
              on_progress: Callable[[int], None] | None = None, **kwargs):
        return self._channel.call(method, *args, timeout=timeout or self.config.call_timeout_s,
                                  on_progress=on_progress, **kwargs)

    # ------------------------------------------------------------------ engine API
    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        on_progress: Callable[[int], None] | None = None,
        timeout: float | None = None,
        seed: int | None = None,
    ) -> tuple[list[SampleOutput], GenerateStats]:
        """Generate all samples of ``requests``; ``on_progress(n_samples_done)`` while it runs.
        ``seed`` makes the call's sampling independent of earlier calls."""
        return self._call("generate", list(requests), on_progress=on_progress, timeout=timeout, seed=seed)

    def set_speculation(self, enabled: bool) -> bool:
        """Autoregressive fallback (False) or speculative decoding (True); returns the new state."""
        return self._call("set_speculation", enabled)

    def begin_weight_update(self, selector: str = "all") -> None:
        """Open a weight-update session for ``target``, ``draft`` or ``all``."""
        self._call("begin_weight_update", selector)

    def update_weights_from_tensor(
        self,
        payloads: bytes | Sequence[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Load one bucket payload (or one per engine TP rank) into the ``target`` or ``draft`` weights.

        The caller keeps the tensors behind the payload alive until this returns.
        """
        if isinstance(payloads, (bytes, bytearray)):
            payloads = [bytes(payloads)]
        return self._call("update_weights_from_tensor", list(payloads), selector, weight_version, flush_cache)

    def end_weight_update(self) -> dict[str, Any]:
        return self._call("end_weight_update")

    def abort_weight_update(self) -> None:
        """Close a session that failed part-way; the groups it touched are left without a version."""
        self._call("abort_weight_update")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("release_memory", tuple(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("resume_memory", tuple(tags))

    def health(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._call("health", timeout=timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._channel.close(timeout)

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=1.0)
        except Exception:
            pass
