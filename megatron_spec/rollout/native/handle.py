"""The trainer-side handle of the native engine process (same shape as the SGLang backend).

:class:`NativeEngine` spawns the engine process, waits until it has loaded, and turns every
method call into a message over a pipe (``megatron_spec.rollout.process``: an engine that dies
raises :class:`EngineDiedError` within a poll interval, a call past its timeout
:class:`EngineTimeoutError`, an exception inside the engine :class:`EngineCallError` with the
engine's traceback).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

from megatron_spec.rollout.api import MEMORY_TAGS, RolloutEngine
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.process import (  # noqa: F401  (the error classes, importable from here as before)
    EngineCallError,
    EngineChannel,
    EngineDiedError,
    EngineError,
    EngineTimeoutError,
)
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput


class NativeEngine(RolloutEngine):
    """Start with ``NativeEngine(EngineConfig(...))``; use as a context manager or call ``shutdown``.

    A :class:`~megatron_spec.rollout.api.RolloutEngine` with fingerprint checksums (its ``health``
    reports the bits of the loaded weights), one TP rank, no digest ledger, and nothing to
    remember of the draft: it loses the draft with its weights on a release like the target, and
    the trainer pushes both again."""

    backend = "native"

    def __init__(self, config: EngineConfig):
        from megatron_spec.rollout.native.server import serve_process

        config = config.resolved()  # auto/bfloat16 -> what the engine's device computes well (megatron_spec.isa)
        self.config = config
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=serve_process, args=(config, child), name="megatron-spec-engine", daemon=True)
        self._proc.start()
        child.close()
        self._channel = EngineChannel(conn, self._proc, "native engine", timeout_flag="--rollout-call-timeout-s")
        self.info: dict[str, Any] = self._channel.wait_ready(config.startup_timeout_s, "--rollout-startup-timeout-s")

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
    def generate(self, requests: Sequence[GenerateRequest], *, on_progress: Callable[[int], None] | None = None,
                 timeout: float | None = None, seed: int | None = None) -> tuple[list[SampleOutput], GenerateStats]:
        """Generate all samples of ``requests``; ``on_progress(n_samples_done)`` while it runs.
        ``seed`` makes the call's sampling independent of earlier calls."""
        return self._call("generate", list(requests), on_progress=on_progress, timeout=timeout, seed=seed)

    def set_speculation(self, enabled: bool) -> bool:
        """Autoregressive fallback (False) or speculative decoding (True); returns the new state."""
        return self._call("set_speculation", enabled)

    def begin_weight_update(self, selector: str = "all") -> None:
        """Open a weight-update session for ``target``, ``draft`` or ``all``."""
        self._call("begin_weight_update", selector)

    def update_weights_from_tensor(self, payloads: bytes | Sequence[bytes], selector: str,
                                   weight_version: str | None = None, flush_cache: bool = True) -> dict[str, Any]:
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

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=1.0)
        except Exception:
            pass
