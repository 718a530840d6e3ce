"""The trainer-side handle of the native engine process (same shape as the SGLang backend).

:class:`NativeEngine` spawns the engine process, waits until it has loaded, and turns every
method call into a message over a pipe. Waiting is never blind: while a call is in flight
the handle polls the pipe *and* the process, so an engine that dies (killed, out of memory,
a crash in native code) raises :class:`EngineDiedError` within a poll interval, and a call
that exceeds its timeout raises :class:`EngineTimeoutError` (the process is killed so it
cannot answer late). Exceptions raised inside the engine come back as
:class:`EngineCallError` with the engine's traceback.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_spec.rollout.api import MEMORY_TAGS, RolloutEngine
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput

_POLL_S = 0.1


class EngineError(RuntimeError):
    """Base class of rollout-engine failures seen by the caller."""


class EngineDiedError(EngineError):
    """The engine process exited while (or before) serving a call."""


class EngineTimeoutError(EngineError):
    """A call took longer than its timeout; the engine process was stopped."""


class EngineCallError(EngineError):
    """The engine raised an exception while serving a call."""

    def __init__(self, method: str, exc_type: str, message: str, tb: str):
        super().__init__(f"native engine {method} failed: {exc_type}: {message}")
        self.exc_type, self.engine_traceback = exc_type, tb


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
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=serve_process, args=(config, child), name="megatron-spec-engine", daemon=True)
        self._proc.start()
        child.close()
        self._ids = itertools.count()
        self._closed = False
        # one call at a time over the pipe: a second thread's call (e.g. a speculation switch while
        # an async generate is in flight) waits for the first instead of reading its reply
        self._lock = threading.RLock()
        self.info: dict[str, Any] = self._wait_ready(config.startup_timeout_s)

    # ------------------------------------------------------------------ plumbing
    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def _died(self, what: str) -> EngineDiedError:
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return EngineDiedError(f"native engine process {self._proc.pid} died ({how}) {what}")

    def _recv(self, deadline: float, what: str):
        while True:
            try:
                if self._conn.poll(_POLL_S):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise self._died(what) from None
            if not self._proc.is_alive():
                # the process may have written its last message just before exiting
                if self._conn.poll(0):
                    return self._conn.recv()
                raise self._died(what)
            if time.monotonic() > deadline:
                self._kill()
                raise EngineTimeoutError(f"native engine did not answer {what} within its timeout; process stopped")

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        kind, payload = self._recv(time.monotonic() + timeout, "while starting")
        if kind == "fatal":
            self._proc.join(timeout=5)
            raise EngineCallError("startup", "StartupError", payload.splitlines()[0], payload)
        return payload

    def _call(self, method: str, *args, timeout: float | None = None,
              on_progress: Callable[[int], None] | None = None, **kwargs):
        with self._lock:
            return self._call_locked(method, *args, timeout=timeout, on_progress=on_progress, **kwargs)

    def _call_locked(self, method: str, *args, timeout: float | None = None,
                     on_progress: Callable[[int], None] | None = None, **kwargs):
        if self._closed:
            raise EngineError(f"native engine is shut down (call {method})")
        call_id = next(self._ids)
        try:
            self._conn.send((call_id, method, args, kwargs))
        except (BrokenPipeError, OSError):
            raise self._died(f"before {method}") from None
        deadline = time.monotonic() + (timeout or self.config.call_timeout_s)
        while True:
            rid, kind, payload = self._recv(deadline, f"during {method}")
            if rid != call_id:
                continue  # a stale progress message of an earlier call
            if kind == "progress":
                if on_progress is not None:
                    on_progress(payload)
                continue
            if kind == "error":
                raise EngineCallError(method, *payload)
            return payload

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)

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
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive():
            try:
                self._conn.send((next(self._ids), "shutdown", (), {}))
                self._proc.join(timeout)
            except (BrokenPipeError, OSError):
                pass
        self._kill()
        self._conn.close()

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.shutdown(timeout=1.0)
        except Exception:
            pass
