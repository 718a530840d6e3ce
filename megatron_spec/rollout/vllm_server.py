"""The vLLM engine process: one ``vllm.LLM`` serving :class:`~megatron_spec.rollout.vllm_backend.VllmEngine`'s
calls. Runs in vLLM's own environment (``--rollout-vllm-python``), started by the handle as

    VLLM_PYTHON -m megatron_spec.rollout.vllm_server --fd N

with this package on ``PYTHONPATH`` and one end of a socket pair as file descriptor N, over which it speaks
the engine-process protocol (``megatron_spec.rollout.process``). vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its engine core and its one worker here, so a ``kill -9`` of this
process takes all of vLLM with it, and ``collective_rpc`` is a call).

What it maps:

* ``generate``: token ids in, one ``LLM.generate`` over all requests (n samples each, a seed per request
  from the call's seed), token ids, processed log-probs and vLLM's per-request speculative counters out;
* weight updates: a session per group on vLLM's own weight path (``start_weight_update`` /
  ``start_draft_weight_update``, ``update_weights``, ``finish_weight_update``) with our bucket backend
  (``megatron_spec.rollout.vllm_worker``); a ``selector`` ``all`` session opens vLLM's session for a group
  when its first bucket comes. Versions per group; ``health`` reports the fingerprints the worker took of
  what it loaded;
* ``set_speculation``: vLLM fixes its speculative method at start-up, so switching builds the ``LLM`` again
  (weights must then be pushed again, as with SGLang);
* ``release_memory`` / ``resume_memory``: vLLM's sleep level 2 / wake-up on a GPU (the weights are gone and
  must be pushed again); vLLM's CPU worker ignores sleep (it logs "sleep mode is not supported on CPU"), so
  on the CPU these only mark the engine released (generation is refused until it resumes) and free nothing.

It imports vLLM, torch and this package's modules that need nothing more (``rollout.config``,
``rollout.types``, ``rollout.vllm_protocol``, ``sync.transport``, ``sync.fingerprint``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from typing import Any

from megatron_spec.rollout import vllm_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import (
    GenerateRequest,
    GenerateStats,
    check_ready_to_generate,
    stats_from_samples,
)

logger = logging.getLogger(__name__)
_GROUPS = ("target", "draft")


class VllmServer:
    """The engine state and the calls the handle makes (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._work = tempfile.mkdtemp(prefix="megatron-spec-vllm-")
        self._draft_dir = None
        if config.draft_kind == "eagle3":
            self._draft_dir = proto.vllm_eagle3_dir(config.draft_path, self._work)
        elif config.draft_kind == "model":
            self._draft_dir = config.draft_path
        self.speculation = config.draft_kind != "none"
        self._released: set[str] = set()
        self._session: dict[str, Any] | None = None
        self._generate_calls = 0  # for the fault point (megatron_spec.faults)
        self._start()

    # ------------------------------------------------------------------ the LLM
    def _start(self) -> None:
        from vllm import LLM

        import megatron_spec.rollout.vllm_worker  # noqa: F401  (registers the bucket backend in this process)

        t0 = time.perf_counter()
        self.llm = LLM(
            **proto.llm_kwargs(self.config, speculation=self.speculation, draft_dir=self._draft_dir)
        )
        self.llm.collective_rpc("init_weight_transfer_engine", args=({},))
        self.load_seconds = time.perf_counter() - t0
        loaded = "init" if self.config.load_weights else None
        self.versions: dict[str, str | None] = {
            "target": loaded,
            "draft": loaded if self._has_draft() else None,
        }

    def _has_draft(self) -> bool:
        """A draft with weights (n-gram has none)."""
        return self.speculation and self.config.draft_kind in ("eagle3", "model")

    def _groups(self) -> tuple[str, ...]:
        return _GROUPS if self._has_draft() else ("target",)

    def info(self) -> dict[str, Any]:
        import torch
        import vllm

        return {"pid": os.getpid(), "backend": "vllm", "vllm_version": vllm.__version__,
                "torch_version": torch.__version__, "draft_kind": self.config.draft_kind,
                "num_draft_tokens": self.config.k, "dtype": self.config.dtype, "device": self.config.device,
                "max_batch_size": self.config.max_batch_size, "context_length": self.config.context_length,
                "enforce_eager": not self.config.compile, "load_seconds": round(self.load_seconds, 2),
                "sleep_mode": self.config.device_type == "cuda"}

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[GenerateRequest], progress=None, seed: int | None = None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_ready_to_generate(updating=self._session is not None, released=self._released,
                                missing=[g for g in self._groups() if self.versions[g] is None])
        if self.speculation:
            proto.check_supported(self.config, [r.sampling.temperature for r in requests])
        k = self.config.k if self.speculation else 0
        if not requests:
            return [], GenerateStats(num_draft_tokens=k)
        # vLLM takes n > 1 only for sampling (greedy n > 1 is a validation error): a greedy request's samples
        # go as n prompts of one (the prefix cache shares their prompt)
        parts = [
            (r, j, i, 1) for j, r in enumerate(requests) if r.sampling.temperature == 0 for i in range(r.n)
        ]
        parts += [(r, j, 0, r.n) for j, r in enumerate(requests) if r.sampling.temperature > 0]
        parts.sort(key=lambda p: (p[1], p[2]))
        params = [SamplingParams(**proto.sampling_kwargs(r.sampling, n, None if seed is None else
                                                         proto.sample_seed(seed, j) + first))
                  for r, j, first, n in parts]
        self._kill_point()
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(r.input_ids)) for r, *_ in parts], params, use_tqdm=False
        )
        wall = time.perf_counter() - t0
        samples = []
        for (r, _, first, n), out in zip(parts, outs):
            if len(out.outputs) != n:
                raise proto.VllmOutputError(
                    f"request {r.request_id}: vLLM returned {len(out.outputs)} samples for n={n}"
                )
            for c in sorted(out.outputs, key=lambda c: c.index):
                metrics = c.spec_decode_metrics
                samples.append(proto.sample_output(
                    r.request_id, first + c.index, c.token_ids, c.logprobs, c.finish_reason,
                    dataclasses.asdict(metrics) if metrics is not None else None,
                    target_version=self.versions["target"], draft_version=self.versions["draft"]))
        if progress is not None:
            progress(len(samples))
        return samples, stats_from_samples(samples, wall, k)

    def _kill_point(self) -> None:
        """``engine_kill_in_generate=N`` (``megatron_spec.faults``): SIGKILL this process half a second into
        its N-th generate call, while vLLM decodes."""
        import threading

        from megatron_spec import faults

        self._generate_calls += 1
        if faults.should_fire("engine_kill_in_generate", self._generate_calls) or faults.should_fire(
            f"engine{self.config.engine_index}_kill_in_generate", self._generate_calls
        ):
            threading.Timer(0.5, faults.kill_self).start()

    def set_speculation(self, enabled: bool) -> bool:
        enabled = bool(enabled) and self.config.draft_kind != "none"
        if enabled != self.speculation:
            logger.warning("rebuilding vLLM with speculative decoding %s; weights must be pushed again",
                           "on" if enabled else "off")
            self._stop_llm()
            self.speculation = enabled
            self._start()
            self._released = set()
        return self.speculation

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, selector: str = "all") -> None:
        if self._session is not None:
            raise RuntimeError("begin_weight_update called twice without end_weight_update")
        if selector not in ("target", "draft", "all"):
            raise ValueError(
                f"begin_weight_update selector must be 'target', 'draft' or 'all', got {selector!r}"
            )
        self._session = {"groups": set(_GROUPS) if selector == "all" else {selector}, "open": None,
                         "versions": {}, "done": set()}

    def _open(self, group: str) -> None:
        s = self._session
        if s["open"] == group:
            return
        if group in s["done"]:
            raise RuntimeError(
                f"{group} tensors after that group's vLLM session was closed (send each group's "
                f"buckets together)"
            )
        if s["open"] is not None:
            self._finish(s["open"])
        self.llm.collective_rpc("start_weight_update" if group == "target" else "start_draft_weight_update")
        s["open"] = group

    def _finish(self, group: str) -> None:
        s = self._session
        s["open"] = None
        s["done"].add(group)
        self.versions[group] = None  # until vLLM's session has ended complete
        self.llm.collective_rpc("finish_weight_update")
        error = self.llm.collective_rpc("megatron_spec_session_error")[0]
        if error:
            raise RuntimeError(error)  # what never arrived
        versions = s["versions"].get(group, set())
        if len(versions) != 1:
            raise RuntimeError(f"{group} weight update mixed versions {sorted(versions)}")
        self.versions[group] = next(iter(versions))

    def update_weights_from_tensor(
        self,
        payloads: list[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        s = self._session
        if s is None:
            raise RuntimeError("update_weights_from_tensor outside begin_weight_update/end_weight_update")
        if selector not in _GROUPS:
            raise ValueError(f"selector must be 'target' or 'draft', got {selector!r}")
        if selector not in s["groups"]:
            raise ValueError(
                f"update for {selector!r} in a weight-update session opened for {sorted(s['groups'])}"
            )
        if selector == "draft" and not self._has_draft():
            raise ValueError(
                f"selector 'draft' but the engine runs without draft weights (draft_kind "
                f"{self.config.draft_kind!r}, speculation {'on' if self.speculation else 'off'})"
            )
        if len(payloads) != 1:
            raise ValueError(f"the vLLM engine here has one TP rank; got {len(payloads)} payloads")
        self._open(selector)
        s["versions"].setdefault(selector, set()).add(str(weight_version))
        self.llm.collective_rpc("update_weights", args=({"payload": payloads[0]},))
        return {"selector": selector}

    def end_weight_update(self) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        try:
            if self._session["open"] is not None:
                self._finish(self._session["open"])
        finally:
            self._session = None
        if "weights" in self._released and all(self.versions[g] is not None for g in self._groups()):
            self._released.discard("weights")
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        return self.health()

    def abort_weight_update(self) -> None:
        """Close a session that failed part-way: the group it was loading is left without a version."""
        s, self._session = self._session, None
        if s is None:
            return
        if s["open"] is not None:
            self.versions[s["open"]] = None
            self.llm.collective_rpc("megatron_spec_abort_weight_update")

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        for tag in tags:
            if tag not in ("kv_cache", "weights"):
                raise ValueError(f"unknown memory tag {tag!r}")
        tags = tuple(t for t in tags if t not in self._released)
        if not tags:
            return
        if self.config.device_type == "cuda":
            self.llm.sleep(level=2 if "weights" in tags else 1)
            if "weights" in tags:
                self.versions = {"target": None, "draft": None}
        self._released |= set(tags)

    def resume_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        tags = [t for t in tags if t in self._released]
        if not tags:
            return
        if self.config.device_type == "cuda":
            self.llm.wake_up(tags=list(tags))
        self._released -= {"kv_cache"} & set(tags)
        if "weights" in tags and self.config.device_type != "cuda":
            self._released.discard("weights")  # nothing was freed on the CPU

    # ------------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        import psutil

        held = self.llm.collective_rpc("megatron_spec_checksums")[0]
        return {
            "alive": True,
            "pid": os.getpid(),
            "weight_version": self.versions["target"],
            "draft_weight_version": self.versions["draft"],
            "released": sorted(self._released),
            "rss_bytes": psutil.Process().memory_info().rss,
            "checksums": {g: held[g] for g in self._groups() if self.versions[g] is not None and g in held},
        }

    def _stop_llm(self) -> None:
        import gc

        llm, self.llm = self.llm, None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    def close(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="this end of the handle's socket pair")
    args = ap.parse_args()
    from multiprocessing.connection import Connection

    from megatron_spec.exit import exit_now
    from megatron_spec.rollout.process import serve

    logging.basicConfig(level=os.environ.get("MEGATRON_SPEC_ENGINE_LOG", "WARNING"))
    conn = Connection(args.fd)
    config: EngineConfig = conn.recv()
    server: list[VllmServer] = []

    def build() -> VllmServer:
        server.append(VllmServer(config))
        return server[0]

    serve(build, conn, "vLLM engine")
    for s in server:
        s.close()
    conn.close()
    exit_now(0)  # vLLM's threads and atexit hooks would hold the process for seconds


if __name__ == "__main__":
    main()
