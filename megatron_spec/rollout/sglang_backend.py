"""The SGLang rollout backend (``--rollout-backend sglang``): ``sglang.Engine`` behind the native engine's
API.

:class:`SGLangEngine` takes the same :class:`EngineConfig` and offers the same calls as
``NativeEngine``: ``generate``, ``begin_weight_update`` / ``update_weights_from_tensor`` /
``end_weight_update`` (flattened-bucket payloads with an explicit ``target``/``draft``
selector, sent as request objects through the engine's tokenizer manager because
``Engine.update_weights_from_tensor`` has no selector), ``release_memory`` /
``resume_memory`` for colocation, ``health``.

What it adds on top of SGLang:

* the launch arguments go through the lossless guard (``megatron_spec.speculative.check_lossless``)
  once at start and per ``generate`` with the requests' sampling parameters;
* versions per group: SGLang keeps one global ``weight_version``; this handle records, for
  each group, the version the engine reports right after that group's update;
* checksums per group are SGLang's own per-engine digests (``check_weights`` action
  ``checksum``), which ``megatron_spec.sync.verify.DigestLedger`` checks by consistency;
* the draft is lost across ``release_memory_occupation`` (PR #31674): after a resume with
  weights, the last verified draft (or the draft checkpoint) is pushed again and verified,
  and ``generate`` is refused until the trainer has pushed the target again;
* FP8: block-FP8 launch config, and with ``load_weights`` the checkpoint is quantised and
  pushed at start (a bf16 checkpoint cannot be loaded into FP8 parameters).

Tensor parallelism (``tp_size`` T > 1): the engine runs on ``gpu_ids``, the GPUs of the trainer
ranks it is colocated with (SGLang's ``base_gpu_id`` / ``gpu_id_step``), and each weight update
takes exactly T payloads, one per engine TP rank, each the full bucket packed on that rank's GPU
(SGLang's loaders narrow full tensors to the rank's shard). Who packs them is the caller's
business (``megatron_spec.sync``); this handle checks the count and passes them on in order.

The checks and files before launch live in ``sglang_launch``, one ``generate`` call in ``sglang_generate``,
the request objects and output parsing in ``sglang_protocol``; this module holds the handle's state
(sessions, versions, released memory, the draft backup).

It needs a GPU and the full SGLang install; on CPU everything up to ``sglang.Engine`` is
tested against SGLang's own classes (tests/sync/test_sglang_backend.py, and
tests/sync/test_sglang_tp_payloads.py for TP > 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_spec.dtypes import torch_dtype
from megatron_spec.interfaces import MEMORY_TAGS, RolloutEngine
from megatron_spec.rollout import sglang_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.sglang_generate import generate_batch
from megatron_spec.rollout.sglang_launch import (
    check_fp8_target,
    checked_server_args,
    engine_gpu_ids,
    write_fp8_config,
)
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput, check_ready_to_generate

if TYPE_CHECKING:
    from megatron_spec.sync.fingerprint import Fingerprint

logger = logging.getLogger(__name__)

_GROUPS = ("target", "draft")


class SGLangCallError(RuntimeError):
    """SGLang answered a control call with ``success=False``."""


def _launch_sglang(**kwargs) -> Any:
    import sglang

    return sglang.Engine(**kwargs)


class SGLangEngine(RolloutEngine):
    """Start with ``SGLangEngine(EngineConfig(...))``; a context manager, like ``NativeEngine``.

    Args:
        config: the engine record both backends read.
        tp_size: SGLang tensor parallelism T; every ``update_weights_from_tensor`` takes T payloads.
        gpu_ids: the local CUDA device of each engine TP rank, in TP rank order: the devices of the
            trainer ranks colocated with this engine (rank i packs TP rank i's payloads on its own
            GPU, so the CUDA IPC handle is opened on the device it was made on). Default: T
            consecutive devices from this process's current one (the owner and the next T-1 local
            ranks when ``LOCAL_RANK`` is the device), ``0 .. T-1`` without CUDA. Passed to SGLang as
            ``base_gpu_id`` / ``gpu_id_step`` (``sglang_protocol.gpu_placement``).
        server_overrides: extra ``ServerArgs`` fields (e.g. ``mem_fraction_static``).
        launch: ``(**server_kwargs) -> engine``; ``sglang.Engine`` by default (tests pass a stand-in).
    """

    backend = "sglang"
    checksum_kind = "digest"

    def __init__(self, config: EngineConfig, *, tp_size: int = 1, gpu_ids: Sequence[int] | None = None,
                 server_overrides: dict[str, Any] | None = None, launch: Callable[..., Any] | None = None):
        config = config.resolved("cuda")  # auto -> bfloat16 on the GPU
        self.config = config
        if isinstance(tp_size, bool) or int(tp_size) != tp_size or tp_size < 1:
            raise ValueError(f"SGLang tp_size must be an integer >= 1, got {tp_size!r}")
        self.tp_size = int(tp_size)
        self.gpu_ids = engine_gpu_ids(gpu_ids, self.tp_size)
        self._overrides = dict(server_overrides or {})
        self._launch = launch or _launch_sglang
        self.dtype = torch_dtype(config.dtype)
        if config.fp8_weights:
            check_fp8_target(config.model_path)
        self._speculation = config.draft_kind != "none"
        self._fp8_config_file = write_fp8_config(self, config.model_path) if config.fp8_weights else None
        self.server_kwargs = self._server_kwargs(self._speculation)
        self.server_args = checked_server_args(self.server_kwargs)
        self._engine = self._launch(**self.server_kwargs)
        self._closed = False
        has_draft = self._speculation
        start = proto.INITIAL_VERSION
        self._versions: dict[str, str | None] = {
            "target": start if config.load_weights and not config.fp8_weights else None,
            "draft": start if has_draft else None}
        self._session: dict[str, str] | None = None
        self._released: set[str] = set()  # what this handle treats as gone (weights: until pushed again)
        self._offloaded: set[str] = set()  # SGLang's ``offload_tags``: released and not yet resumed
        self._draft_backup: tuple[list[tuple[str, torch.Tensor]], str] | None = None
        from megatron_spec.sync.verify import DigestLedger

        # digests are this engine's: every streamer checks against one book
        self.digest_ledger = DigestLedger()
        self.info = {"backend": "sglang", "draft_kind": config.draft_kind, "num_draft_tokens": config.k,
                     "dtype": config.dtype, "tp_size": self.tp_size, "gpu_ids": list(self.gpu_ids)}
        if config.fp8_weights and config.load_weights:
            self._push_checkpoint_fp8()

    # ------------------------------------------------------------------ plumbing
    def _server_kwargs(self, speculation: bool) -> dict[str, Any]:
        return proto.server_kwargs(self.config, tp_size=self.tp_size, speculation=speculation,
                                   overrides=self._overrides, fp8_config_file=self._fp8_config_file,
                                   gpu_ids=self.gpu_ids)

    def _tm(self, method: str, obj) -> Any:
        """Run a tokenizer-manager coroutine on the engine's loop (as ``sglang.Engine`` does)."""
        if self._closed:
            raise RuntimeError(f"SGLang engine is shut down (call {method})")
        tm = self._engine.tokenizer_manager
        return self._engine.loop.run_until_complete(getattr(tm, method)(obj, None))

    def _ok(self, method: str, result) -> None:
        success, message = result[0], result[1]
        if not success:
            raise SGLangCallError(f"SGLang {method} failed: {message}")

    def _engine_version(self) -> str | None:
        return self._engine.get_model_info().get("weight_version")

    def is_alive(self) -> bool:
        return not self._closed

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        on_progress: Callable[[int], None] | None = None,
        timeout: float | None = None,
        seed: int | None = None,
    ) -> tuple[list[SampleOutput], GenerateStats]:
        """Generate every sample of ``requests`` in one SGLang batch.

        ``seed`` is applied per sample through SGLang's ``sampling_seed`` only when the engine
        runs with ``enable_deterministic_inference`` (its flashinfer sampler rejects seeds);
        otherwise sampling follows the launch-time ``random_seed``. ``timeout`` is not
        enforced here (SGLang has no per-call deadline).
        """
        check_ready_to_generate(updating=self._session is not None, released=self._released,
                                missing=[g for g in self._groups() if self._versions[g] is None])
        return generate_batch(self._engine, self.server_args, requests, num_draft_tokens=self._k(),
                              speculative=self._speculation, target_version=self._versions["target"],
                              draft_version=self._versions["draft"], seed=seed, on_progress=on_progress)

    def _k(self) -> int:
        return self.config.k if self._speculation else 0

    def _groups(self) -> tuple[str, ...]:
        return _GROUPS if self._speculation else ("target",)

    def set_speculation(self, enabled: bool) -> bool:
        """Speculative decoding on or off. SGLang fixes the algorithm at launch, so switching
        relaunches the engine: every group must then be pushed again (``generate`` refuses
        until it is). Returns the new state."""
        enabled = bool(enabled) and self.config.draft_kind != "none"
        if enabled == self._speculation:
            return enabled
        logger.warning("relaunching SGLang with speculative decoding %s; weights must be pushed again",
                       "on" if enabled else "off")
        self.shutdown()
        self._speculation = enabled
        self.server_kwargs = self._server_kwargs(enabled)
        self.server_args = checked_server_args(self.server_kwargs)
        self._engine = self._launch(**self.server_kwargs)
        self._closed = False
        self._released, self._offloaded = set(), set()  # a new engine has released nothing
        self._versions = {"target": None, "draft": None if enabled else self._versions["draft"]}
        if enabled and self._draft_backup is not None:
            self._repush_draft()
        return enabled

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, selector: str = "all") -> None:
        if self._session is not None:
            raise RuntimeError("begin_weight_update called twice without end_weight_update")
        self._ok(
            "begin_weight_update", self._tm("begin_weight_update", proto.session_request(True, selector))
        )
        self._session = {"selector": selector}

    def update_weights_from_tensor(
        self,
        payloads: bytes | Sequence[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Load one flattened bucket into ``target`` or ``draft``.

        Args:
            payloads: exactly ``tp_size`` serialized buckets (a single ``bytes`` at TP=1), sent as
                SGLang's ``serialized_named_tensors``: engine TP rank i deserialises ``payloads[i]``
                only, so it must be the bucket packed on ``gpu_ids[i]``. Entries hold equal content
                (the full, unsharded tensors: SGLang's loaders narrow them per rank) through
                different IPC handles.

        Raises:
            ValueError: not exactly one payload per TP rank. SGLang itself would index past a
                short list in the scheduler of a higher rank (an IndexError that takes the
                scheduler down) and silently leave extra entries unopened.
        """
        if self._session is None:
            raise RuntimeError("update_weights_from_tensor outside begin_weight_update/end_weight_update")
        if isinstance(payloads, (bytes, bytearray)):
            payloads = [bytes(payloads)]
        payloads = list(payloads)
        if len(payloads) != self.tp_size:
            raise ValueError(f"SGLang engine runs TP={self.tp_size} on GPUs {list(self.gpu_ids)}: "
                             f"update_weights_from_tensor needs exactly one payload per engine TP rank "
                             f"(payloads[i] packed on GPU gpu_ids[i]), got {len(payloads)}")
        if self._session["selector"] not in ("all", selector):
            raise ValueError(f"update for {selector!r} in a session opened for {self._session['selector']!r}")
        if selector == "draft" and not self._speculation:
            raise ValueError("selector 'draft' but the engine runs without a draft")
        req = proto.update_request(payloads, selector, weight_version, flush_cache)
        self._ok("update_weights_from_tensor", self._tm("update_weights_from_tensor", req))
        self._session[selector] = self._engine_version()  # what the engine now reports
        return {"selector": selector, "weight_version": self._session[selector]}

    def end_weight_update(self) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        session, self._session = self._session, None
        self._ok("end_weight_update", self._tm("end_weight_update", proto.session_request(False)))
        for group in _GROUPS:
            if group in session:
                self._versions[group] = session[group]
        if "weights" in self._released and all(self._versions[g] is not None for g in self._groups()):
            self._released.discard("weights")
        return self.health()

    def abort_weight_update(self) -> None:
        """Close a session whose update failed part-way: SGLang has no completeness check, so
        every group the session touched is marked as holding no valid weights."""
        if self._session is None:
            return
        session, self._session = self._session, None
        for group in _GROUPS:
            if group in session:
                self._versions[group] = None
        self._ok("end_weight_update", self._tm("end_weight_update", proto.session_request(False)))

    def remember_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Keep a CPU copy of the last verified draft, to push it again after a memory resume
        (the streamer calls this after a verified draft sync)."""
        self._draft_backup = ([(n, t.detach().to("cpu", copy=True)) for n, t in named_tensors], str(version))

    def _checkpoint_draft(self) -> list[tuple[str, torch.Tensor]]:
        from megatron_spec.draft.modelopt_io import startup_draft_tensors
        from megatron_spec.models import HFCheckpoint

        return startup_draft_tensors(self.config.draft_kind, self.config.draft_path,
                                     HFCheckpoint(self.config.model_path).decoder_config, dtype=self.dtype)

    def _repush_draft(self) -> None:
        from megatron_spec.sync.streamer import WeightStreamer

        named, version = self._draft_backup or (self._checkpoint_draft(), proto.INITIAL_VERSION)
        WeightStreamer(self, weight_dtype="bf16" if self.dtype == torch.bfloat16 else "fp32",
                       for_sglang=True).sync_draft(named, version)

    def _push_checkpoint_fp8(self) -> None:
        from megatron_spec.models import HFCheckpoint
        from megatron_spec.sync.streamer import WeightStreamer

        ck = HFCheckpoint(self.config.model_path)
        names = ck.weight_names()
        WeightStreamer(self, weight_dtype="fp8", for_sglang=True).sync_target_tensors(
            ((n, ck.get(n)) for n in names), proto.INITIAL_VERSION, shapes={n: ck.shape(n) for n in names})

    def startup_fingerprint(self, group: str) -> Fingerprint | None:
        """Fingerprint (engine dtype) of the weights the engine loaded at start, or None if it
        started with dummy weights. Used once, when a first sync leaves a digest unchanged."""
        from megatron_spec.models import HFCheckpoint
        from megatron_spec.sync.fingerprint import fingerprint_tensors

        if group == "target":
            if not self.config.load_weights or self.config.fp8_weights:
                return None
            ck = HFCheckpoint(self.config.model_path)
            return fingerprint_tensors((ck.get(n) for n in ck.weight_names()), self.dtype)
        return fingerprint_tensors((t for _, t in self._checkpoint_draft()), self.dtype)

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Hand memory back (colocation). Tags already released are not sent again."""
        for tag in tags:
            if tag not in ("kv_cache", "weights", "cuda_graph"):
                raise ValueError(f"unknown memory tag {tag!r}")
        tags = tuple(t for t in dict.fromkeys(tags) if t not in self._offloaded)
        if not tags:
            return
        self._tm("release_memory_occupation", proto.memory_request(True, tags))
        self._offloaded |= set(tags)
        if "weights" in tags:
            self._versions = {"target": None, "draft": None}  # contents are gone (draft: PR #31674)
        self._released |= set(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Re-occupy what was released; a tag that is not released is skipped (a no-op when
        nothing is). SGLang's scheduler removes each resumed tag from its ``offload_tags`` with
        ``set.remove``: a tag it never released raises KeyError there and the scheduler takes
        the whole process down. With ``weights``, the draft is pushed again at once (last
        verified draft, else the checkpoint); the target must be pushed by the trainer."""
        tags = tuple(t for t in dict.fromkeys(tags) if t in self._offloaded)
        if not tags:
            return
        self._tm("resume_memory_occupation", proto.memory_request(False, tags))
        self._offloaded -= set(tags)
        self._released -= {"kv_cache", "cuda_graph"} & set(tags)
        if "weights" in tags and self._speculation and self.config.draft_kind in ("eagle3", "model"):
            self._repush_draft()

    # ------------------------------------------------------------------ health
    def health(self, timeout: float = 60.0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alive": not self._closed,
            "weight_version": self._versions["target"],
            "draft_weight_version": self._versions["draft"],
            "released": sorted(self._released),
            "engine_weight_version": self._engine_version(),
            "checksums": {},
        }
        for group in self._groups():
            if self._versions[group] is None:
                continue
            success, message, _ranks, digest = self._tm("check_weights", proto.checksum_request(group))
            if not success or digest is None:
                raise SGLangCallError(f"SGLang check_weights({group}) failed: {message}")
            out["checksums"][group] = {"digest": digest}
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
