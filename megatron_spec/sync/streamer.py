"""Stream the policy (and the draft) from Megatron into the rollout engine, then verify.

Data flow of :meth:`WeightStreamer.sync_target`::

    Megatron shards --gather (TP group, one parameter at a time)--> HF-named views
      --(cast | block-FP8 quantise) straight into bucket A--> payload (one per engine TP rank)
      --sender thread: engine.update_weights_from_tensor(selector="target")--> ack frees A
    meanwhile the next tensors are packed into bucket B (double buffering)

Peak extra memory is the two bucket buffers (plus, under TP>1, one gathered parameter):
views of the parameters are copied once, into the bucket, with the dtype cast or the FP8
quantisation done on the way. A buffer is reused only after the engine acknowledged the
update that referenced it, so the engine never reads a buffer being rewritten (CPU buffers
live in shared memory, GPU buffers travel as CUDA IPC handles; both are zero-copy).

Every sync is wrapped in ``begin_weight_update(selector)`` / ``end_weight_update`` and then
verified (``megatron_spec.sync.verify``): the engine must report the version sent and a
checksum consistent with the fingerprint of what was sent, and the other group must be
untouched; anything else raises :class:`WeightSyncError` naming the group.

Process topology: only the process holding the engine handle (global rank 0) talks to the
engine. Every rank of its tensor-parallel group must call :meth:`sync_target` too (with
``engine=None``): the gathers are collective. Ranks of other data-parallel replicas return
at once (their shards equal replica 0's). :meth:`sync_draft` is local to rank 0.

The double buffering itself (packing, the sender thread, fingerprinting what was sent) is
:mod:`megatron_spec.sync.bucket_stream`; this module plans the buckets, opens, closes and verifies the update.
It does not know how engines load weights, only their update API and ``health()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.dtypes import torch_dtype
from megatron_spec.sync import fp8 as fp8_names
from megatron_spec.sync.bucket import alloc_bucket_buffer
from megatron_spec.sync.bucket_stream import STREAM_PIECES, BucketStream
from megatron_spec.sync.fingerprint import Fingerprint
from megatron_spec.sync.fused_pieces import fused_order, later_pieces
from megatron_spec.sync.memory import PeakMemory
from megatron_spec.sync.report import SyncReport
from megatron_spec.sync.verify import (
    DigestLedger,
    WeightSyncError,
    check_fingerprint,
    check_untouched,
    check_version,
    reported_checksum,
)

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = ("fp32", "bf16", "fp8")
_ALIGN_SLACK = 16  # worst-case alignment padding in front of one tensor

SYNC_PIECES = (*STREAM_PIECES, "end_s")
"""The trainer's side of a sync: gathering and converting to HF views, packing (cast or quantise) into the
bucket, waiting for the engine to free a bucket, fingerprinting the sent buckets, waiting for the engine's
update calls (sender thread), ``end_weight_update`` (the engine's re-pack and checksums)."""

__all__ = ["SYNC_PIECES", "WEIGHT_DTYPES", "SyncReport", "WeightStreamer", "WeightSyncError"]


class WeightStreamer:
    """Trainer-side weight streaming into one rollout engine.

    Args:
        engine: a rollout engine handle (``NativeEngine`` / ``SGLangEngine``), or None on the
            ranks that only take part in the gathers.
        bucket_bytes: bucket size: a bucket is sent once the next tensor would take it past
            this. The two buffers grow to the largest single tensor if that is larger (such a
            tensor then travels alone).
        weight_dtype: ``fp32`` | ``bf16`` | ``fp8`` (block-FP8 linear weights of the target;
            other target tensors and the whole draft travel in the engine's dtype).
        for_sglang: build payloads SGLang's loader reads (its metadata class, CUDA patch).
        verify: compare the engine's checksums with fingerprints of what was sent (costs one
            read pass over the weights on each side); versions are always checked.
        engine_dtype: the dtype the engine holds (default: ``engine.config.dtype``).
        engine_tp_size: payloads per bucket (default: ``engine.tp_size``, else 1).
        keep_buffers: keep the two bucket buffers between syncs. Default (None): keep CPU buffers
            (shared memory: a fresh one costs page faults on every sync, ~30% of a CPU sync here),
            free GPU buffers (the caching allocator makes them cheap to get back; training wants the memory).
        lend_buckets: lend CPU buckets to an engine that computes with them
            (:attr:`~megatron_spec.interfaces.WeightReceiver.keeps_lent_buckets`): each bucket of a group gets
            a buffer of its own, kept and rewritten only by that group's next sync, and the engine's
            parameters become views of them (no copy on its side; the buffers hold the weights once, for both
            processes). Default (None): where the engine keeps them and the payloads are the native engine's
            (not SGLang's, one engine TP rank); False: the two buffers taking turns.
        lend_panels: in a lent target sync, write the weights the engine takes in its linear kernel's panel
            layout (:meth:`~megatron_spec.interfaces.WeightReceiver.lent_panel_names`; fp32 weights into an
            fp32 engine) that way, so that the engine computes with them as they are instead of packing them
            in a second pass; False: rows (benchmarks compare both).
        measure_memory: record :attr:`SyncReport.peak_extra_bytes`.
        cpu_threads: torch intra-op threads while packing CPU buckets (restored afterwards; None:
            leave torch's setting). Packing is memory-bound and one thread saturates it, while two
            OpenMP threads on a busy 2-core machine stall each other: fp32->bf16 packing ran at
            10-20 GB/s with 1 thread and 0.2-0.8 GB/s with 2 here (benchmarks/bench_sync.py).
    """

    def __init__(
        self,
        engine: Any,
        *,
        bucket_bytes: int = 256 << 20,
        weight_dtype: str = "bf16",
        for_sglang: bool = False,
        verify: bool = True,
        engine_dtype: str | torch.dtype | None = None,
        engine_tp_size: int | None = None,
        keep_buffers: bool | None = None,
        lend_buckets: bool | None = None,
        lend_panels: bool = True,
        measure_memory: bool = False,
        cpu_threads: int | None = 1,
    ):
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        if bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes must be at least 1 KiB, got {bucket_bytes}")
        self.engine = engine
        self.bucket_bytes = int(bucket_bytes)
        self.weight_dtype = weight_dtype
        self.for_sglang = for_sglang
        self.verify = verify
        self.keep_buffers = keep_buffers
        self.measure_memory = measure_memory
        self.cpu_threads = cpu_threads
        if engine_dtype is None:
            engine_dtype = (
                engine.config.dtype if engine is not None and engine.config is not None else "bfloat16"
            )
        self.engine_dtype = torch_dtype(engine_dtype, "engine_dtype")
        self.engine_tp_size = int(engine_tp_size or (engine.tp_size if engine is not None else 1))
        if lend_buckets is None:
            lend_buckets = (not for_sglang and self.engine_tp_size == 1 and engine is not None
                            and engine.keeps_lent_buckets)
        elif lend_buckets and (for_sglang or self.engine_tp_size != 1):
            raise ValueError("lend_buckets: only to the native engine (for_sglang False, one engine TP rank)")
        self.lend_buckets, self.lend_panels = lend_buckets, lend_panels
        self._pools: dict[str, list[torch.Tensor]] = {}
        """Kept buffers: ``"turns"``, the two that take turns; a group's name, the buffers lent for it."""
        self._told_capacity = 0  # the largest grown capacity logged so far
        self._verified: dict[str, tuple[str, dict]] = {}
        self._ledger = DigestLedger()

    # ------------------------------------------------------------------ public API
    def sync_target(self, model: torch.nn.Module, version: str, tp_group: dist.ProcessGroup | None = None
                    ) -> SyncReport:
        """Stream the Megatron policy ``model`` as ``version`` (collective over ``tp_group``)."""
        from megatron_spec.models.convert import expected_hf_shapes
        from megatron_spec.models.gpt import iter_hf_views, unwrap

        version = str(version)
        if self.engine is None:
            group = tp_group
            if group is None and dist.is_initialized():
                from megatron.core import parallel_state as ps

                group = ps.get_tensor_model_parallel_group()
            if dist.is_initialized() and 0 not in dist.get_process_group_ranks(group):
                return SyncReport("target", version, skipped=True)  # another DP replica
            for _ in iter_hf_views(model, tp_group, stream_order=True):  # take part in the gathers only
                pass
            return SyncReport("target", version)
        gpt = unwrap(model)
        shapes = expected_hf_shapes(gpt.decoder_config)
        device = next(gpt.parameters()).device
        items = iter_hf_views(model, tp_group, stream_order=True)
        return self._sync(
            "target", items, version, shapes.items(), device, quantize=self.weight_dtype == "fp8"
        )

    def sync_target_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, *,
                            shapes: Mapping[str, Sequence[int]] | None = None,
                            device: torch.device | str | None = None) -> SyncReport:
        """Stream HF-named target tensors (a checkpoint, a non-Megatron trainer) as ``version``;
        quantised like :meth:`sync_target` when ``weight_dtype`` is ``fp8``.

        With ``shapes`` (name -> shape of every tensor to come) the iterable is consumed lazily,
        one tensor at a time (e.g. read from a checkpoint as it is packed; ``device``: where the
        tensors will be, default CPU); without, it is listed first to size the buckets.
        """
        if shapes is None:
            named = [(n, t.detach()) for n, t in named_tensors]
            if not named:
                raise ValueError("sync_target_tensors got no tensors")
            shapes = {n: tuple(t.shape) for n, t in named}
            device = named[0][1].device
            named_tensors = fused_order(named)  # fused pieces side by side (a checkpoint sorts k before q)
        items = ((n, t.detach(), tuple(t.shape)) for n, t in named_tensors)
        return self._sync("target", items, str(version), [(n, tuple(s)) for n, s in shapes.items()],
                          torch.device(device or "cpu"), quantize=self.weight_dtype == "fp8")

    def sync_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncReport:
        """Stream draft tensors (HF / ModelOpt names, no ``d2t``) as ``version``; never quantised."""
        version = str(version)
        if self.engine is None:
            return SyncReport("draft", version, skipped=True)
        named = [(n, t.detach()) for n, t in named_tensors]
        if not named:
            raise ValueError("sync_draft got no tensors")
        if any(n == "d2t" or n.endswith(".d2t") for n, _ in named):
            raise ValueError("d2t must not be re-sent: engines read the draft-to-target map once at start-up "
                             "(pass the draft tensors without it)")
        items = ((n, t, tuple(t.shape)) for n, t in named)
        rep = self._sync("draft", items, version, [(n, tuple(t.shape)) for n, t in named], named[0][1].device,
                         quantize=False)
        # engines that lose the draft on release push it again on resume
        self.engine.remember_draft(named, version)
        return rep

    def close(self) -> None:
        """Free kept bucket buffers (an engine computing with lent ones keeps them mapped)."""
        self._pools = {}

    # ------------------------------------------------------------------ planning
    def _send_dtype(self, t_dtype: torch.dtype) -> torch.dtype:
        if not t_dtype.is_floating_point:
            return t_dtype
        if self.weight_dtype == "fp8":
            return self.engine_dtype
        return torch_dtype(self.weight_dtype)

    def _entries(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, quantize: bool
                 ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if quantize and fp8_names.is_fp8_weight(name, shape):
            return [(name, shape, torch.float8_e4m3fn),
                    (fp8_names.scale_name(name), fp8_names.scale_shape(shape), torch.float32)]
        return [(name, shape, self._send_dtype(dtype))]

    def _capacity(self, shapes: Iterable[tuple[str, tuple[int, ...]]], quantize: bool, followers=None) -> int:
        """Bytes a buffer needs: ``bucket_bytes``, or the largest tensor (with ``followers``, the largest
        fused group: :meth:`_followers`) in float32."""
        largest = 0
        for name, shape in shapes:
            entries = self._entries(name, tuple(shape), torch.float32, quantize)
            if followers is not None:
                entries += followers(name, torch.float32)
            need = sum(torch.Size(s).numel() * d.itemsize + _ALIGN_SLACK for _, s, d in entries)
            largest = max(largest, need)
        # buckets still close at bucket_bytes, that tensor travels alone; said once per size (every sync of a
        # run has the same largest tensor, so a message per sync says nothing new)
        if largest > self.bucket_bytes and largest > self._told_capacity:
            self._told_capacity = largest
            logger.info("bucket buffers grown from %d to %d bytes to hold the largest tensor (or fused "
                        "group)", self.bucket_bytes, largest)
        return max(self.bucket_bytes, largest)

    def _followers(self, shapes: dict[str, tuple[int, ...]], quantize: bool):
        """``followers(name, dtype)`` of :meth:`BucketStream.run`: the entries of the fused pieces that come
        after ``name`` (k and v after q, up after gate), as they will travel."""
        def followers(name: str, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
            return [e for n in later_pieces(name) if n in shapes
                    for e in self._entries(n, shapes[n], dtype, quantize)]
        return followers

    def _lends(self, device: torch.device) -> bool:
        return self.lend_buckets and device.type == "cpu"

    def _alloc(self, group: str, capacity: int, device: torch.device, count: int) -> list[torch.Tensor]:
        """At least ``count`` buffers of ``capacity`` bytes: the two taking turns, or the group's lent ones
        (always kept: the engine computes with them)."""
        key = group if self._lends(device) else "turns"
        bufs = self._pools.pop(key, [])
        if bufs and (bufs[0].numel() < capacity or bufs[0].device != device):
            bufs = []  # free the old ones before allocating new
        bufs += [alloc_bucket_buffer(capacity, device) for _ in range(count - len(bufs))]
        keep = self.keep_buffers if self.keep_buffers is not None else device.type == "cpu"
        if keep or key != "turns":
            self._pools[key] = bufs
        return bufs

    # ------------------------------------------------------------------ the sync
    def _sync(self, group: str, items: Iterator, version: str, shapes, device: torch.device, *,
              quantize: bool) -> SyncReport:
        rep = SyncReport(group, version)
        t0 = time.perf_counter()
        mem = PeakMemory(device) if self.measure_memory else None
        # kept buffers are resident before the sync starts
        held = sum(b.numel() for bufs in self._pools.values() for b in bufs)
        digest_before = None
        if self.verify and self.engine.checksum_kind == "digest":
            ck = reported_checksum(self.engine.health(), group)
            digest_before = None if ck is None else ck.get("digest")
        if mem is not None:
            mem.__enter__()
        threads = torch.get_num_threads()
        if self.cpu_threads is not None and device.type == "cpu":
            torch.set_num_threads(self.cpu_threads)
        try:
            shapes = {n: tuple(s) for n, s in shapes}
            followers = self._followers(shapes, quantize) if self._lends(device) else None
            rep.bucket_capacity = self._capacity(shapes.items(), quantize, followers)
            self.engine.begin_weight_update(selector=group)
            try:
                panels = self._panels(group, shapes, device)
                sent = self._stream(group, items, version, rep, quantize, device, followers, panels)
            except BaseException:
                try:  # close the session so the engine does not claim the partial update
                    self.engine.abort_weight_update()
                except Exception as exc:  # the first error is the one to report
                    logger.debug("closing the session after a failed %s sync: %s", group, exc)
                raise
            rep.stream_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            try:
                health = self.engine.end_weight_update()
            except Exception as exc:
                raise WeightSyncError(group, f"engine refused to finish the update: {exc}") from exc
            rep.timings["end_s"] = time.perf_counter() - t1
            if isinstance(health, dict):
                rep.timings.update(health.get("sync_timings") or {})
        finally:
            torch.set_num_threads(threads)
            # buckets the engine has let go of (docs/memory_plan.md) go back to the pool
            if device.type == "cuda":
                torch.cuda.ipc_collect()
            if mem is not None:
                mem.__exit__(None, None, None)
                rep.peak_extra_bytes = None if mem.peak_extra_bytes is None else mem.peak_extra_bytes + held
        self._check(group, version, sent, health, digest_before)
        rep.checksums = {"sent": sent.to_dict() if sent is not None else None,
                         "engine": reported_checksum(health, group)}
        rep.verify_seconds = time.perf_counter() - t1
        rep.seconds = time.perf_counter() - t0
        logger.debug("synced %s %s: %.1f MB in %d buckets, %.3f s (%.2f GB/s streaming)", group, version,
                    rep.bytes / 1e6, rep.num_buckets, rep.seconds, rep.gb_per_s)
        return rep

    def _check(self, group: str, version: str, sent: Fingerprint | None, health: dict, digest_before) -> None:
        if not isinstance(health, dict):
            raise WeightSyncError(
                group, f"end_weight_update returned {type(health).__name__}, expected a health dict"
            )
        check_version(group, version, health)
        held = reported_checksum(health, group)
        if self.verify:
            if held is None:
                raise WeightSyncError(group, "engine reports no checksum for the group")
            if "bits" in held:
                check_fingerprint(group, sent, health)
            elif "digest" in held:
                ledger = self.engine.digest_ledger or self._ledger
                ledger.check(
                    group, sent, digest_before, held["digest"], lambda: self.engine.startup_fingerprint(group)
                )
            else:
                raise WeightSyncError(group, f"engine checksum has an unknown form: keys {sorted(held)}")
        other = "draft" if group == "target" else "target"
        check_untouched(other, self._verified.get(other), health)
        self._verified[group] = (version, dict(held) if held is not None else {})

    def _panels(self, group: str, shapes: dict[str, tuple[int, ...]], device: torch.device) -> frozenset[str]:
        """The names to write in the engine's panel layout this sync (``lend_panels``)."""
        from megatron_spec._ext import compiled_ops_available

        if not (self.lend_panels and group == "target" and self._lends(device)
                and self.weight_dtype == "fp32" and self.engine_dtype == torch.float32
                and compiled_ops_available() and hasattr(torch.ops.megatron_spec, "linear_pack_into_sums")):
            return frozenset()
        return frozenset(self.engine.lent_panel_names(shapes))

    def _stream(self, group: str, items: Iterator, version: str, rep: SyncReport, quantize: bool,
                device: torch.device, followers, panels: frozenset[str] = frozenset()) -> Fingerprint | None:
        """Pack ``items`` into double buffers (or buffers lent, one a bucket) while a sender thread ships full
        ones (:class:`BucketStream`); fills ``rep``'s counts and stream timings."""
        stream = BucketStream(self.engine, group, version, engine_tp_size=self.engine_tp_size,
                              for_sglang=self.for_sglang, engine_dtype=self.engine_dtype,
                              fingerprint=self.verify, lend=self._lends(device), panels=panels)
        done = stream.run(items, self._entries, quantize,
                          lambda dev, count: self._alloc(group, rep.bucket_capacity, dev, count),
                          self.bucket_bytes, followers)
        rep.bytes, rep.num_buckets, rep.num_tensors = done.bytes, done.num_buckets, done.num_tensors
        rep.timings.update(done.timings)
        return done.sent
