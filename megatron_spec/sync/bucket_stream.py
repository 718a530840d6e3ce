"""The double-buffered bucket stream of one weight sync.

The producer (the caller's thread) packs tensors into one of two bucket buffers, cast to the dtype they
travel in or block-FP8 quantised on the way; a full bucket goes to a sender thread, which hands it to the
engine's ``update_weights_from_tensor`` and, while the engine loads it, fingerprints it as the engine will
hold it. A buffer is rewritten only after the engine acknowledged the update that referenced it, so the
engine never reads a buffer being rewritten. A stream that lends its buckets (an engine that computes
with them, :attr:`~megatron_spec.interfaces.WeightReceiver.keeps_lent_buckets`) writes every bucket into a
buffer of its own instead, and never waits for the engine. The producer keeps iterating after a failure
(the tensor-parallel peers are inside the same gathers) and raises once the items are done.

It does not know where the tensors come from (Megatron gathers, a checkpoint), which dtype each travels in
(the caller plans the entries), how large the buffers are, or how the engine is checked after the sync
(``megatron_spec.sync.streamer``, ``megatron_spec.sync.verify``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_spec.sync import fp8 as fp8_names
from megatron_spec.sync.bucket import BucketWriter, FlattenedTensorMetadata
from megatron_spec.sync.fingerprint import Fingerprint
from megatron_spec.sync.transport import make_bucket_payloads
from megatron_spec.sync.verify import WeightSyncError

STREAM_PIECES = ("gather_s", "pack_s", "wait_buffer_s", "fingerprint_s", "engine_call_s")
"""The seconds :class:`BucketStream` clocks: waiting for the next item (gathering it), packing it, waiting for
the engine to free a buffer, and on the sender thread fingerprinting a bucket and waiting for the engine."""

Entry = tuple[str, tuple[int, ...], torch.dtype]
"""One tensor of a bucket as the engine will receive it: name, shape, dtype."""


@dataclasses.dataclass
class _Bucket:
    index: int
    flat: torch.Tensor
    metadata: list[FlattenedTensorMetadata]
    last: bool
    ready: Any = None  # a CUDA event to wait for before the engine may read the buffer
    packed_sums: Fingerprint | None = None  # of the tensors fingerprinted while packed (their names below)
    packed_names: frozenset[str] = frozenset()
    panels: frozenset[str] = frozenset()  # the tensors written in the engine's panel layout


@dataclasses.dataclass
class Streamed:
    """What one stream moved."""

    sent: Fingerprint | None
    """Fingerprint of what the engine received, in its dtype (None: not asked for)."""
    bytes: int
    """Bucket bytes sent (once, however many engine TP ranks read them)."""
    num_buckets: int
    num_tensors: int
    timings: dict[str, float]
    """Seconds per piece (:data:`STREAM_PIECES`)."""


class BucketStream:
    """One sync's stream into ``engine``: :meth:`run` once.

    Args:
        engine: the rollout engine handle (``update_weights_from_tensor``), inside an open weight update.
        group, version: the ``selector`` and ``weight_version`` of the update calls.
        engine_tp_size: payloads per bucket (one per engine TP rank).
        for_sglang: build payloads SGLang's loader reads.
        engine_dtype: the dtype the engine holds floating tensors in (what the fingerprint hashes).
        fingerprint: fingerprint the sent buckets (:attr:`Streamed.sent`).
        lend: lend the buckets (payloads marked ``lent``): bucket ``i`` in buffer ``i`` of ``alloc``'s.
        panels: names of fp32 tensors to write, lending, in the engine's panel layout (:func:`pack`).
    """

    def __init__(self, engine: Any, group: str, version: str, *, engine_tp_size: int, for_sglang: bool,
                 engine_dtype: torch.dtype, fingerprint: bool, lend: bool = False,
                 panels: frozenset[str] = frozenset()):
        self.engine, self.group, self.version, self.lend = engine, group, version, lend
        self.panels = panels if lend else frozenset()
        self.open_panels: set[str] = set()  # the open bucket's tensors in the panel layout
        self.engine_tp_size, self.for_sglang, self.engine_dtype = engine_tp_size, for_sglang, engine_dtype
        self.free = [threading.Semaphore(1), threading.Semaphore(1)]
        self.todo: queue.Queue[_Bucket | None] = queue.Queue()
        self.errors: list[BaseException] = []  # the sender's, reported by the producer
        self.sent = Fingerprint() if fingerprint else None
        self.clock = dict.fromkeys(STREAM_PIECES, 0.0)
        self.bytes = self.buckets = 0
        self.buffers: list[torch.Tensor] = []
        self.writer: BucketWriter | None = None
        self.index = 0
        self.alloc: Callable[[int], list[torch.Tensor]] | None = None
        self.packed_sums, self.packed_names = Fingerprint(), set()  # the open bucket's (see :func:`pack`)

    def run(self, items: Iterator, entries: Callable[[str, tuple[int, ...], torch.dtype, bool], list[Entry]],
            quantize: bool, alloc: Callable[[torch.device, int], list[torch.Tensor]], limit: int,
            followers: Callable[[str, torch.dtype], list[Entry]] | None = None) -> Streamed:
        """Pack ``items`` (``(name, tensor, shape)``) into double buffers (or, lending, a buffer a bucket)
        while a sender thread ships full ones.

        ``entries(name, shape, dtype, quantize)``: what one tensor travels as (two entries: FP8 data and its
        scales); ``alloc(device, count)``: at least ``count`` buffers (two, or lending one more a bucket),
        asked for once the first tensor shows the device; a bucket closes once the next tensor would take it
        past ``limit`` bytes, or, lending, the next tensor and its ``followers(name, dtype)`` (the other
        pieces of its fused parameter, :mod:`~megatron_spec.sync.fused_pieces`, as they will travel): those
        then join it in the bucket, past ``limit`` if they must (the buffers hold the largest such group)."""
        thread = threading.Thread(target=self._send_loop, name=f"weight-sender-{self.group}", daemon=True)
        clock, errors = self.clock, self.errors
        writer: BucketWriter | None = None
        produce_error: BaseException | None = None
        tensors = 0
        together: set[str] = set()  # the followers still to come into the open bucket
        thread.start()
        t_item = time.perf_counter()
        try:
            for name, src, shape in items:
                t_got = time.perf_counter()
                clock["gather_s"] += t_got - t_item
                if produce_error is not None or errors:
                    t_item = time.perf_counter()
                    continue  # keep iterating: the TP peers are inside the same gathers
                try:
                    planned = entries(name, tuple(shape), src.dtype, quantize)
                    if writer is None:
                        self.alloc = functools.partial(alloc, src.device)
                        writer = self._open(limit)
                    need = [(s, d) for _, s, d in planned]
                    if name in together:  # a fused parameter's later piece: in its first piece's bucket
                        together.discard(name)
                        if not writer.fits(need, past_limit=True):
                            self._flush(last=False)
                    else:
                        after = followers(name, src.dtype) if self.lend and followers is not None else []
                        together = {n for n, _, _ in after}
                        if len(writer) and not writer.fits(need + [(s, d) for _, s, d in after]):
                            self._flush(last=False)
                    t_pack = time.perf_counter()
                    as_panels = name in self.panels and src.dtype == planned[0][2] == torch.float32 \
                        and len(planned) == 1 and len(planned[0][1]) == 2 and src.device.type == "cpu"
                    if pack(writer, planned, src, self.packed_sums if self.sent is not None else None,
                            self.engine_dtype, panels=as_panels):
                        self.packed_names.add(planned[0][0])
                    if as_panels:
                        self.open_panels.add(name)
                    clock["pack_s"] += time.perf_counter() - t_pack
                    tensors += 1
                except Exception as exc:
                    produce_error = exc
                t_item = time.perf_counter()
            if produce_error is None and not errors:
                if writer is None or not len(writer):
                    raise WeightSyncError(self.group, "nothing to send")
                self._flush(last=True)
        finally:
            self.todo.put(None)
            thread.join()
        if produce_error is not None:
            raise WeightSyncError(self.group, f"packing failed: {produce_error}") from produce_error
        if errors:
            raise WeightSyncError(self.group, f"engine update failed: {errors[0]}") from errors[0]
        return Streamed(self.sent, self.bytes, self.buckets, tensors, clock)

    # ------------------------------------------------------------------ producer side
    def _open(self, limit: int) -> BucketWriter:
        """Start writing into the first buffer."""
        self.buffers = self.alloc(1 if self.lend else 2)
        if not self.lend:
            self.free[0].acquire()
        self.writer = BucketWriter(self.buffers[0], limit=limit)
        return self.writer

    def _flush(self, last: bool) -> None:
        """Hand the written bucket to the sender; go on in the other buffer once the engine let go of it."""
        flat, meta = self.writer.finish()
        ready = None
        if flat.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.todo.put(_Bucket(self.index, flat, meta, last, ready, self.packed_sums,
                              frozenset(self.packed_names), frozenset(self.open_panels)))
        self.packed_sums, self.packed_names, self.open_panels = Fingerprint(), set(), set()
        if self.lend:  # the next buffer of the group's own: the engine keeps computing with this one
            if not last:
                self.index += 1
                self.buffers = self.alloc(self.index + 1)
                self.writer.reset(self.buffers[self.index])
            return
        self.index ^= 1
        t0 = time.perf_counter()
        self.free[self.index].acquire()  # wait until the engine acknowledged the bucket that used it
        self.clock["wait_buffer_s"] += time.perf_counter() - t0
        self.writer.reset(self.buffers[self.index])

    # ------------------------------------------------------------------ sender thread
    def _send_loop(self) -> None:
        """The sender thread: ships buckets until the producer's None, releasing each buffer once the engine
        acknowledged it (or failed: then the rest are skipped and the error is left for the producer)."""
        # The fingerprint of a bucket is taken while the engine loads it (both only read it).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weight-call-{self.group}") as pool:
            while True:
                b = self.todo.get()
                if b is None:
                    return
                try:
                    if not self.errors:
                        self._send(b, pool)
                except BaseException as exc:  # reported by the producer
                    self.errors.append(exc)
                finally:
                    if not self.lend:
                        self.free[b.index].release()  # acknowledged (or failed): the buffer may be rewritten

    def _send(self, b: _Bucket, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        """One bucket to the engine, fingerprinted meanwhile; returns once the engine has copied it."""
        if b.ready is not None:
            b.ready.synchronize()
        payloads = make_bucket_payloads(b.flat, b.metadata, self.engine_tp_size, for_sglang=self.for_sglang,
                                        lent=self.lend, panels=b.panels)
        t0 = time.perf_counter()
        if self.sent is None:
            self._call_engine(payloads, b.last)
        else:
            call = pool.submit(self._call_engine, payloads, b.last)
            try:
                fingerprint_bucket(b.flat, b.metadata, self.sent, self.engine_dtype, skip=b.packed_names)
                if b.packed_sums is not None:
                    self.sent.merge(b.packed_sums)
            finally:
                t1 = time.perf_counter()
                self.clock["fingerprint_s"] += t1 - t0
                t0 = t1
                call.result()  # the engine has copied the bucket (or raised)
        self.clock["engine_call_s"] += time.perf_counter() - t0
        self.bytes += b.flat.numel()
        self.buckets += 1

    def _call_engine(self, payloads, last: bool) -> None:
        self.engine.update_weights_from_tensor(
            payloads, selector=self.group, weight_version=self.version, flush_cache=last
        )


def pack(writer: BucketWriter, entries: list[Entry], src: torch.Tensor, sums: Fingerprint | None = None,
         engine_dtype: torch.dtype | None = None, panels: bool = False) -> bool:
    """Write ``src`` into the bucket as ``entries`` say: cast, or block-FP8 quantised into data and scales;
    ``panels``: an fp32 ``[out, in]`` weight (a multiple of 16 rows) in the linear kernel's panel layout
    (:func:`_write_panels`).

    With ``sums``, a tensor that travels as it is held on both sides (``src``'s dtype, the engine's;
    contiguous, or in contiguous blocks of rows: Megatron's q, k and v, a block a query group) is
    fingerprinted while it is copied, one pass over its bytes instead of two (:meth:`Fingerprint.copy_in`);
    returns whether it was (the sender's :func:`fingerprint_bucket` skips it then)."""
    (name, shape, dtype), *rest = entries
    if panels:
        _write_panels(writer.reserve(name, shape, dtype), src, shape, sums)
        return sums is not None
    blocks = _contiguous_blocks(src) if sums is not None and dtype == src.dtype == engine_dtype \
        and src.device.type == "cpu" else None
    if blocks is not None:
        dst = writer.reserve(name, shape, dtype).view(src.shape)
        for i in blocks:
            if dst[i].numel():
                sums.copy_in(dst[i], src[i])
        return True
    if dtype == torch.float8_e4m3fn:
        from megatron_spec.ops import fp8_block_quantize

        w = writer.reserve(name, shape, dtype)
        s = writer.reserve(rest[0][0], rest[0][1], rest[0][2])
        fp8_block_quantize(src.reshape(shape), fp8_names.BLOCK, out=(w, s))
    else:
        writer.add(name, src, shape, dtype)
    return False


_MAX_BLOCKS = 64


def _write_panels(dst: torch.Tensor, src: torch.Tensor, shape: tuple[int, ...], sums: Fingerprint | None
                  ) -> None:
    """``src`` (``shape`` ``[n, k]`` fp32, ``n`` a multiple of 16) into ``dst``'s memory as the kernel's
    panels, ``out[p, c, j] = w[16 p + j, c]`` (``megatron_spec::linear_pack_into``), with ``sums`` taken in
    the same pass; a block of rows at a time where ``src`` lies in blocks of whole panels (Megatron's q, k
    and v, ``[groups, rows, k]``: a block a query group), else from a contiguous copy."""
    n, k = shape
    if src.is_contiguous():
        parts: tuple[torch.Tensor, ...] = (src.view(n, k),)
    elif src.dim() == 3 and src.shape[1] % 16 == 0 and src.stride(2) == 1 and src.stride(1) == k:
        parts = src.unbind(0)
    else:
        parts = (src.reshape(n, k).contiguous(),)
    outs = dst.view(len(parts), n // 16 // len(parts), k, 16).unbind(0)
    ops = torch.ops.megatron_spec
    for part, out in zip(parts, outs):
        if sums is None:
            ops.linear_pack_into(part, out)
        else:
            sums.add_sums(torch.float32, part.numel(), ops.linear_pack_into_sums(part, out))


def _contiguous_blocks(src: torch.Tensor) -> list | None:
    """Indices of ``src`` that split it into contiguous pieces, in order: the whole tensor, or its rows along
    the first dimension (a Megatron q/k/v view: one block of rows per query group), at most
    :data:`_MAX_BLOCKS`; None otherwise."""
    if src.is_contiguous():
        return [slice(None)]
    rows = range(src.shape[0]) if src.dim() > 1 and src.shape[0] <= _MAX_BLOCKS else None
    if rows is not None and all(src[i].is_contiguous() for i in rows):
        return list(rows)
    return None


def fingerprint_bucket(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata], fp: Fingerprint,
                       engine_dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> None:
    """Add the bucket's tensors to ``fp`` as the engine will hold them (``engine_dtype``; FP8 pairs
    dequantised exactly as the receiving side does), but those named in ``skip`` (fingerprinted as packed)."""
    by_name = {m.name: m for m in metadata}
    for m in metadata:
        if m.name in skip:
            continue
        view = flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
        if m.name.endswith(fp8_names.SCALE_SUFFIX) and m.dtype == torch.float32 \
                and m.name[: -len(fp8_names.SCALE_SUFFIX)] in by_name:
            continue
        if m.dtype == torch.float8_e4m3fn:
            from megatron_spec.ops import fp8_block_dequantize

            sm = by_name[fp8_names.scale_name(m.name)]
            scale = flat[sm.start_idx:sm.end_idx].view(sm.dtype).view(sm.shape)
            rows = fp8_names.BLOCK[0] * 8  # dequantise a few row blocks at a time: a small temporary
            for r in range(0, view.shape[0], rows):
                fp.add(fp8_block_dequantize(view[r:r + rows], scale[r // fp8_names.BLOCK[0]:
                                                                   -(-(r + rows) // fp8_names.BLOCK[0])],
                                            engine_dtype, fp8_names.BLOCK))
        elif view.dtype.is_floating_point:
            fp.add(view, engine_dtype)
        else:
            fp.add(view)
