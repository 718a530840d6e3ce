"""An engine in a process of its own: the call protocol over one connection, both ends of it.

Every backend that runs its engine out of the trainer's process (the native engine, vLLM in its own
Python) speaks the same protocol over a ``multiprocessing`` connection: the engine process first sends
``("ready", info)`` or ``("fatal", traceback)``, then answers each ``(call_id, method, args, kwargs)``
with ``(call_id, "ok", result)``, ``(call_id, "error", (type, message, traceback))`` or, while a
``generate`` runs, ``(call_id, "progress", samples_done)``.

:class:`EngineChannel` is the caller's end. Waiting is never blind: while a call is in flight it
polls the connection *and* the process, so an engine that dies (killed, out of memory, a crash in
native code) raises :class:`EngineDiedError` within a poll interval, and a call that exceeds its
timeout raises :class:`EngineTimeoutError` naming the engine and the flag that sets the limit (the
process is killed so it cannot answer late). :func:`serve` is the engine's end.

The error classes are :mod:`megatron_spec.interfaces`' (every
:class:`~megatron_spec.interfaces.RolloutEngine` raises them, whatever its backend).

Stdlib only: the vLLM server imports it in vLLM's environment.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from megatron_spec.interfaces import EngineCallError, EngineDiedError, EngineError, EngineTimeoutError

_POLL_S = 0.1


class EngineProcess(Protocol):
    """What the channel asks of the process it watches (``multiprocessing.Process``, or
    :class:`PopenProcess` around a ``subprocess.Popen``)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class PopenProcess:
    """A ``subprocess.Popen`` seen as an :class:`EngineProcess`; ``kill`` takes its whole process group
    (start it with ``start_new_session=True``: an engine's own children go with it)."""

    def __init__(self, popen):
        self.popen = popen

    @property
    def pid(self) -> int | None:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if self.popen.poll() is None:
                self.popen.kill()
        self.popen.wait()

    def join(self, timeout: float | None = None) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class EngineChannel:
    """The caller's end of the protocol: one call at a time (a second thread's call, e.g. a speculation
    switch while an asynchronous generate is in flight, waits for the first instead of reading its reply).

    Args:
        conn: the connection to the engine process.
        proc: the process, watched while waiting.
        name: the engine as errors name it (``native engine``, ``vLLM engine``).
        timeout_flag: the flag that raises a call's time limit, named by :class:`EngineTimeoutError`.
        describe: extra words for an :class:`EngineDiedError` (e.g. where the engine's log is).
    """

    def __init__(self, conn, proc: EngineProcess, name: str, *, timeout_flag: str,
                 describe: Callable[[], str] | None = None):
        self.conn, self.proc, self.name = conn, proc, name
        self.timeout_flag = timeout_flag
        self._describe = describe or (lambda: "")
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.closed = False

    def died(self, what: str) -> EngineDiedError:
        self.proc.join(timeout=1.0)
        code = self.proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return EngineDiedError(f"{self.name} process {self.proc.pid} died ({how}) {what}{self._describe()}")

    def recv(self, deadline: float, what: str, timeout_s: float | None = None):
        while True:
            try:
                if self.conn.poll(_POLL_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                raise self.died(what) from None
            if not self.proc.is_alive():
                # the process may have written its last message just before exiting
                if self.conn.poll(0):
                    return self.conn.recv()
                raise self.died(what)
            if time.monotonic() > deadline:
                self.kill()
                limit = f" of {timeout_s:g} s" if timeout_s is not None else ""
                raise EngineTimeoutError(
                    f"{self.name} did not answer {what} within its timeout{limit}; process "
                    f"stopped (raise {self.timeout_flag} if the work needs longer)"
                )

    def wait_ready(self, timeout: float, startup_flag: str) -> dict[str, Any]:
        """The engine's start-up ``info``; raises :class:`EngineCallError` with the engine's traceback when
        it failed to start."""
        try:
            kind, payload = self.recv(time.monotonic() + timeout, "while starting", timeout)
        except EngineTimeoutError as exc:
            raise EngineTimeoutError(str(exc).replace(self.timeout_flag, startup_flag)) from None
        if kind == "fatal":
            self.proc.join(timeout=5)
            raise EngineCallError("startup", "StartupError", payload.splitlines()[0], payload, self.name)
        return payload

    def call(self, method: str, *args, timeout: float, on_progress: Callable[[int], None] | None = None,
             **kwargs):
        with self._lock:
            if self.closed:
                raise EngineError(f"{self.name} is shut down (call {method})")
            call_id = next(self._ids)
            try:
                self.conn.send((call_id, method, args, kwargs))
            except (BrokenPipeError, OSError):
                raise self.died(f"before {method}") from None
            deadline = time.monotonic() + timeout
            while True:
                rid, kind, payload = self.recv(deadline, f"during {method}", timeout)
                if rid != call_id:
                    continue  # a stale progress message of an earlier call
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(payload)
                    continue
                if kind == "error":
                    raise EngineCallError(method, *payload, engine=self.name)
                return payload

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop, wait up to ``timeout``, then kill it (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.proc.is_alive():
            try:
                self.conn.send((next(self._ids), "shutdown", (), {}))
                self.proc.join(timeout)
            except (BrokenPipeError, OSError):
                pass
        self.kill()
        self.conn.close()


def serve(build: Callable[[], Any], conn, name: str = "engine") -> None:
    """The engine process's loop: ``build()`` the server object, say ready (or fatal), then run every call on
    it until ``shutdown`` or until the caller goes away. A ``generate`` call gets a ``progress`` callback
    (samples done; at most five messages a second)."""
    try:
        server = build()
        conn.send(("ready", server.info()))
    except Exception as exc:  # report the failure instead of dying silently
        conn.send(("fatal", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            call_id, method, args, kwargs = conn.recv()
        except (EOFError, OSError):  # the trainer went away: nothing left to serve
            return
        if method == "shutdown":
            conn.send((call_id, "ok", None))
            return
        try:
            fn = getattr(server, method, None)
            if fn is None or method.startswith("_"):
                raise AttributeError(f"the {name} has no call {method!r}")
            if method == "generate":
                last = [0.0]

                def progress(n, call_id=call_id, last=last):
                    now = time.monotonic()
                    if now - last[0] > 0.2:
                        last[0] = now
                        conn.send((call_id, "progress", n))

                kwargs = dict(kwargs, progress=progress)
            result = fn(*args, **kwargs)
            conn.send((call_id, "ok", result))
        except Exception as exc:
            conn.send((call_id, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
