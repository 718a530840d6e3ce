"""The trainer-side handle of the native engine process (same shape as the SGLang backend).

:class:`NativeEngine` spawns the engine process, waits until it has loaded, and turns every
method call into a message over a pipe (``megatron_spec.rollout.process``: an engine that dies
raises :class:`EngineDiedError` within a poll interval, a call past its timeout
:class:`EngineTimeoutError`, an exception inside the engine :class:`EngineCallError` with the
engine's traceback).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping
from typing import Any

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.process import EngineChannel
from megatron_spec.rollout.process_engine import ProcessEngine


class NativeEngine(ProcessEngine):
    """Start with ``NativeEngine(EngineConfig(...))``; use as a context manager or call ``shutdown``.

    A :class:`~megatron_spec.interfaces.RolloutEngine` with fingerprint checksums (its ``health``
    reports the bits of the loaded weights), one TP rank, no digest ledger, and nothing to
    remember of the draft: it loses the draft with its weights on a release like the target, and
    the trainer pushes both again."""

    backend = "native"
    keeps_lent_buckets = True  # its target computes with lent CPU buckets (EngineServer)

    def __init__(self, config: EngineConfig):
        from megatron_spec.rollout.native.server import serve_process

        # auto/bfloat16 -> what the engine's device computes well (megatron_spec.isa)
        config = config.resolved()
        self.config = config
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=serve_process, args=(config, child), name="megatron-spec-engine", daemon=True
        )
        self._proc.start()
        child.close()
        self._channel = EngineChannel(
            conn, self._proc, "native engine", timeout_flag="--rollout-call-timeout-s"
        )
        self.info: dict[str, Any] = self._channel.wait_ready(
            config.startup_timeout_s, "--rollout-startup-timeout-s"
        )

    def lent_panel_names(self, shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
        from megatron_spec.rollout.native.hf_weights import lent_panel_names

        return lent_panel_names(self.config, shapes)
