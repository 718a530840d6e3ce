"""Buckets, payloads and the allowlist receiver (ours and SGLang's)."""

from __future__ import annotations

import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from megatron_spec._ext import compiled_ops_available
from megatron_spec.sync.bucket import BucketWriter, FlattenedTensorMetadata, alloc_bucket_buffer
from megatron_spec.sync.transport import (
    UnsafePayloadError,
    make_bucket_payloads,
    read_bucket,
    read_bucket_payload,
    serialize,
)


def _mixed():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return [
        ("a.weight", torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn)),  # 15 bytes: misaligns the next
        ("a.weight_scale_inv", torch.rand(1, 1, generator=g)),
        ("b.weight", base.t()),  # a strided view
        ("c.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("d.ids", torch.arange(3)),
    ]


def _write_all(named):
    """``named`` through a BucketWriter over a 4 KiB shared-memory buffer: (flat, meta)."""
    w = BucketWriter(alloc_bucket_buffer(4096))
    for n, t in named:
        w.add(n, t)
    return w.finish()


def test_writer_aligns_offsets_and_copies_strided_views():
    named = _mixed()
    flat, meta = _write_all(named)
    for m, (n, t) in zip(meta, named):
        assert m.start_idx % t.dtype.itemsize == 0, n
        got = flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
        assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), n
    assert meta[1].start_idx == 16  # 15 fp8 bytes, then the float32 scale at the next multiple of 4


def test_writer_casts_and_reshapes_blocked_views():
    src = torch.randn(2, 3, 4)  # e.g. q rows grouped per KV head: HF shape [6, 4]
    w = BucketWriter(alloc_bucket_buffer(1024))
    dst = w.add("q.weight", src, shape=(6, 4), dtype=torch.bfloat16)
    assert dst.shape == (6, 4) and torch.equal(dst, src.reshape(6, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        w.add("big.weight", torch.zeros(1000))


def test_payload_round_trip_through_shared_memory():
    named = _mixed()
    flat, meta = _write_all(named)
    assert flat.is_shared()
    payloads = make_bucket_payloads(flat, meta, 2)
    assert len(payloads) == 2 and all(len(p) < 4096 for p in payloads)  # handles, not data
    for p in payloads:  # each engine rank reads its own payload once
        got = read_bucket_payload(p)
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, a), (_, b) in zip(got, named):
            assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def test_writer_limit_closes_buckets_early_but_takes_a_larger_tensor_alone():
    w = BucketWriter(alloc_bucket_buffer(4096), limit=1024)
    w.add("a", torch.zeros(128))  # 512 bytes
    assert w.fits([((128,), torch.float32)]) and not w.fits([((129,), torch.float32)])
    w.reset()
    assert not w.fits([((512,), torch.float32)])  # 2 KiB: over the limit, within the buffer
    w.add("big", torch.zeros(512))  # an empty bucket takes it (the streamer only flushes non-empty ones)
    assert w.offset == 2048


def test_cpu_payloads_travel_by_shared_memory_name_and_reuse_a_mapped_buffer():
    """No file descriptor (a resource_sharer socket round trip per payload): the storage's
    shared-memory name, which a receiver still mapping the buffer resolves from its cache."""
    named = _mixed()
    flat, meta = _write_all(named)
    payload = make_bucket_payloads(flat, meta, 1)[0]
    assert b"rebuild_storage_filename" in payload and b"DupFd" not in payload
    first = read_bucket_payload(payload)[0][1]
    flat[meta[2].start_idx:meta[2].end_idx].view(torch.float32).fill_(7.0)  # the next bucket, same buffer
    again = read_bucket_payload(make_bucket_payloads(flat, meta, 1)[0])
    assert again[0][1].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.all(again[2][1] == 7.0)
    private = torch.arange(6.0)  # an ordinary tensor is moved into shared memory on the way
    assert torch.equal(
        read_bucket_payload(
            serialize(
                {
                    "flattened_tensor": private.view(torch.uint8),
                    "metadata": [FlattenedTensorMetadata("p", torch.Size([6]), torch.float32, 0, 24, 24)],
                }
            )
        )[0][1],
        private,
    )


class Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def _forking_bytes(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def test_payload_with_a_non_tensor_object_is_refused():
    flat = torch.zeros(8, dtype=torch.uint8)
    meta = [FlattenedTensorMetadata("x", torch.Size([2]), torch.float32, 0, 8, 8)]
    with pytest.raises(UnsafePayloadError, match="posix.getcwd"):
        read_bucket_payload(serialize({"flattened_tensor": flat, "metadata": meta, "extra": Evil()}))
    with pytest.raises(UnsafePayloadError, match="getcwd"):  # hidden inside a metadata record
        bad = FlattenedTensorMetadata(Evil(), torch.Size([2]), torch.float32, 0, 8, 8)
        read_bucket_payload(_forking_bytes({"flattened_tensor": flat, "metadata": [bad]}))
    with pytest.raises(UnsafePayloadError, match="not a flattened bucket"):
        read_bucket_payload(serialize({"flattened_tensor": flat, "metadata": meta, "x": 1}))
    with pytest.raises(UnsafePayloadError, match="wrong field types"):
        odd = FlattenedTensorMetadata(b"x", torch.Size([2]), torch.float32, 0, 8, 8)
        read_bucket_payload(serialize({"flattened_tensor": flat, "metadata": [odd]}))
    with pytest.raises(ValueError, match="do not match"):  # well-typed but out of bounds
        oob = FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 0, 16, 16)
        read_bucket_payload(serialize({"flattened_tensor": flat, "metadata": [oob]}))


def test_a_lent_bucket_says_so_and_nothing_else_rides_on_the_flag():
    flat = torch.arange(8, dtype=torch.uint8)
    meta = [FlattenedTensorMetadata("x", torch.Size([2]), torch.float32, 0, 8, 8)]
    (lent,) = make_bucket_payloads(flat, meta, 1, lent=True)
    (plain,) = make_bucket_payloads(flat, meta, 1)
    named, is_lent, panels = read_bucket(lent)
    assert is_lent and not read_bucket(plain)[1] and panels == frozenset()
    assert named[0][0] == "x" and torch.equal(named[0][1].view(torch.uint8), flat)
    assert torch.equal(read_bucket_payload(lent)[0][1], named[0][1])  # a copying receiver reads it the same
    with pytest.raises(ValueError, match="SGLang"):
        make_bucket_payloads(flat, meta, 1, for_sglang=True, lent=True)
    for odd in (1, False, "yes"):
        with pytest.raises(UnsafePayloadError, match="not a flattened bucket"):
            read_bucket(serialize({"flattened_tensor": flat, "metadata": meta, "lent": odd}))


def test_tensors_in_the_panel_layout_are_named_in_a_lent_bucket_and_nowhere_else():
    """A lent bucket may name tensors written in the engine's panel layout; only its own, only lent, and a
    receiver that copies (vLLM's worker, a forwarder) refuses them rather than reading panels as rows."""
    flat = torch.arange(16, dtype=torch.uint8)
    meta = [FlattenedTensorMetadata(n, torch.Size([2]), torch.float32, 8 * i, 8 * i + 8, 8)
            for i, n in enumerate("xy")]
    (lent,) = make_bucket_payloads(flat, meta, 1, lent=True, panels=["y"])
    named, is_lent, panels = read_bucket(lent)
    assert is_lent and panels == {"y"} and [n for n, _ in named] == ["x", "y"]
    with pytest.raises(UnsafePayloadError, match="copies"):
        read_bucket_payload(lent)
    with pytest.raises(ValueError, match="only in a lent bucket"):
        make_bucket_payloads(flat, meta, 1, panels=["y"])
    for odd in (["z"], "y", [1], ("y",)):
        with pytest.raises(UnsafePayloadError, match="panels"):
            read_bucket(serialize({"flattened_tensor": flat, "metadata": meta, "lent": True, "panels": odd}))
    with pytest.raises(UnsafePayloadError, match="not a flattened bucket"):
        read_bucket(serialize({"flattened_tensor": flat, "metadata": meta, "panels": ["y"]}))


@pytest.mark.sglang
def test_sglang_reads_our_payloads_into_its_bucket():
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = _mixed()
    flat, meta = _write_all(named)
    payload = make_bucket_payloads(flat, meta, 1, for_sglang=True)[0]
    data = MultiprocessingSerializer.deserialize(payload)  # SGLang's allowlist unpickler
    bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    got = bucket.reconstruct_tensors()
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(got, named):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):  # and it refuses what we refuse
        MultiprocessingSerializer.deserialize(serialize({"flattened_tensor": flat, "x": Evil()}))


def test_pack_fingerprints_what_travels_as_held_while_copying_it():
    """A tensor that travels in its own dtype, the engine's, is fingerprinted as it is packed (the sender then
    skips it); a cast on the way (fp32 into a bf16 bucket), a strided source or no sums leave it to the
    sender's pass over the bucket. Either way the fingerprint is of what the engine will hold."""
    from megatron_spec.sync.bucket_stream import fingerprint_bucket, pack
    from megatron_spec.sync.fingerprint import Fingerprint, fingerprint_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    cases = [  # (travel dtype, engine dtype, source, sums given) -> fingerprinted while packed
        ((torch.float32, torch.float32, w, True), True),
        ((torch.bfloat16, torch.bfloat16, w, True), False),  # cast while packing
        ((torch.float32, torch.float32, w.t().contiguous().t(), True), False),  # strided source
        ((torch.float32, torch.float32, w, False), False),
    ]
    for (dtype, engine_dtype, src, give), fused in cases:
        writer = BucketWriter(alloc_bucket_buffer(1 << 14, torch.device("cpu")))
        sums = Fingerprint() if give else None
        assert pack(writer, [("w", tuple(src.shape), dtype)], src, sums, engine_dtype) is fused
        flat, meta = writer.finish()
        assert torch.equal(flat[meta[0].start_idx:meta[0].end_idx].view(dtype).view(src.shape), src.to(dtype))
        sent = Fingerprint()
        fingerprint_bucket(flat, meta, sent, engine_dtype, skip=frozenset({"w"}) if fused else frozenset())
        if fused:
            assert sent.numel == 0 and sums == fingerprint_tensors([src], engine_dtype)
        else:
            assert sent == fingerprint_tensors([src], engine_dtype)


@pytest.mark.skipif(not compiled_ops_available(), reason="needs megatron_spec._C (the panel pack)")
def test_pack_writes_the_panel_layout_from_rows_or_blocks_of_whole_panels():
    """``panels=True``: an fp32 ``[out, in]`` weight lands as the kernel's panels (what ``linear_pack_f32``
    makes of its rows), from a contiguous source, from Megatron-like blocks of rows (q of each query group: a
    3-D view, one block a group, packed block by block) and from blocks that split panels (copied first);
    with sums, the fingerprint is the rows' (the sender skips it), without, the sender's pass over the bucket
    finds the same."""
    from megatron_spec.sync.bucket_stream import fingerprint_bucket, pack
    from megatron_spec.sync.fingerprint import Fingerprint, fingerprint_tensors

    g = torch.Generator().manual_seed(1)
    fused = torch.randn(3, 48 + 16, 40, generator=g)  # 3 groups of 48 q rows then 16 k rows
    odd = torch.randn(4, 8 + 4, 40, generator=g)  # 4 groups of 8 rows: blocks of half a panel
    cases = [torch.randn(64, 40, generator=g), fused[:, :48], fused[:, 48:], odd[:, :8]]
    for src in cases:
        rows = src.reshape(-1, 40)
        for give in (True, False):
            writer = BucketWriter(alloc_bucket_buffer(1 << 15, torch.device("cpu")))
            sums = Fingerprint() if give else None
            assert pack(writer, [("w", tuple(rows.shape), torch.float32)], src, sums, torch.float32,
                        panels=True) is give
            flat, meta = writer.finish()
            got = flat[meta[0].start_idx:meta[0].end_idx].view(torch.float32)
            assert torch.equal(got, torch.ops.megatron_spec.linear_pack_f32(rows.contiguous()).reshape(-1))
            sent = Fingerprint()
            skip = frozenset({"w"}) if give else frozenset()
            fingerprint_bucket(flat, meta, sent, torch.float32, skip=skip)
            assert (sums if give else sent) == fingerprint_tensors([rows])
