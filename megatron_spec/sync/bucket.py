"""Flattened tensor buckets in SGLang's ``FlattenedTensorBucket`` format.

A bucket is one ``uint8`` tensor holding many named tensors back to back, plus one
metadata record per tensor (``name, shape, dtype, start_idx, end_idx, numel`` in bytes).
Sending one big tensor instead of hundreds of small ones is what makes weight updates fast
(peers measured per-tensor IPC ~4x slower). Offsets are aligned to each tensor's element
size, so every tensor can be viewed in place on the receiving side (SGLang checks this).

:class:`FlattenedTensorMetadata` has the same fields as SGLang's class of that name; when a
payload goes to SGLang, :func:`to_sglang_metadata` converts the records to SGLang's own
class so its allowlist unpickler accepts them. The native engine's unpickler maps SGLang's
class to this one, so both engines read the same payloads.

:class:`BucketWriter` fills a preallocated buffer one tensor at a time (the streamer packs
straight from strided views of the trainer's parameters, casting on the way);
:func:`alloc_bucket_buffer` allocates that buffer where the receiver can map it (shared
memory on CPU, ordinary device memory on GPU, which travels as a CUDA IPC handle).

This module does not know about models, processes or transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a bucket (field names and meaning as in SGLang)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes, as in SGLang (the uint8 view's numel)


def _align(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


def bucket_layout(
    named: Sequence[tuple[str, torch.Size | Sequence[int], torch.dtype]],
) -> tuple[list[FlattenedTensorMetadata], int]:
    """Metadata for tensors of the given names/shapes/dtypes and the bucket's byte size."""
    meta, offset = [], 0
    for name, shape, dtype in named:
        shape = torch.Size(shape)
        offset = _align(offset, dtype.itemsize)
        nbytes = shape.numel() * dtype.itemsize
        meta.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    return meta, offset


def pack_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Copy tensors into one ``uint8`` buffer (``out`` if given and large enough).

    Returns:
        (flat ``[nbytes] uint8``, metadata). ``flat`` is a view of ``out`` when ``out`` is given.
    """
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    meta, nbytes = bucket_layout([(n, t.shape, t.dtype) for n, t in named_tensors])
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=named_tensors[0][1].device)
    elif out.dtype != torch.uint8 or out.numel() < nbytes:
        raise ValueError(f"bucket buffer of {out.numel()} bytes cannot hold {nbytes} bytes")
    flat = out[:nbytes]
    for (_, tensor), m in zip(named_tensors, meta):
        if m.numel:
            flat[m.start_idx:m.end_idx].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return flat, meta


def unpack_bucket(flat: torch.Tensor, metadata: Sequence) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor in a bucket (no copies). Accepts SGLang's metadata objects too."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bucket must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metadata:
        dtype = m.dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"bucket metadata for {m.name}: dtype {dtype!r} is not a torch.dtype")
        if m.start_idx % dtype.itemsize:
            raise ValueError(f"bucket tensor {m.name}: byte offset {m.start_idx} not aligned to {dtype}")
        nbytes = torch.Size(m.shape).numel() * dtype.itemsize
        if m.end_idx - m.start_idx != nbytes or m.end_idx > flat.numel() or m.start_idx < 0:
            raise ValueError(f"bucket tensor {m.name}: bytes [{m.start_idx}, {m.end_idx}) do not match "
                             f"shape {tuple(m.shape)} {dtype} in a bucket of {flat.numel()} bytes")
        out.append((m.name, flat[m.start_idx:m.end_idx].view(dtype).view(m.shape)))
    return out


def to_sglang_metadata(metadata: Sequence[FlattenedTensorMetadata]) -> list:
    """The same records as SGLang's ``FlattenedTensorMetadata`` objects (needs sglang installed)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SglMeta

    return [SglMeta(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx,
                    numel=m.numel) for m in metadata]


def alloc_bucket_buffer(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``[nbytes] uint8`` buffer the engine can map: CPU buffers are placed in shared memory
    once (serialising an ordinary CPU tensor would copy it into shared memory every time)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if buf.device.type == "cpu":
        buf.untyped_storage()._share_filename_cpu_()  # by name, as the transport sends it
    return buf


class BucketWriter:
    """Packs tensors into a preallocated ``uint8`` buffer with dtype-aligned offsets.

    ``reserve`` hands out a destination view for one tensor (callers write into it, e.g. an
    FP8 quantiser with ``out=``); ``add`` reserves and copies, casting to the bucket dtype.
    """

    def __init__(self, buffer: torch.Tensor, limit: int | None = None):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(
                f"bucket buffer must be a 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}"
            )
        self.buffer = buffer
        self.limit = limit
        self.offset = 0
        self.metadata: list[FlattenedTensorMetadata] = []
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype (reserve)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def __len__(self) -> int:
        return len(self.metadata)

    def bytes_needed(self, entries: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
        """Bytes from the current offset to the end of ``entries`` packed after it."""
        offset = self.offset
        for shape, dtype in entries:
            offset = _align(offset, dtype.itemsize) + torch.Size(shape).numel() * dtype.itemsize
        return offset - self.offset

    def fits(self, entries: Sequence[tuple[Sequence[int], torch.dtype]], past_limit: bool = False) -> bool:
        """Whether ``entries`` fit after the current offset: within ``limit`` (the bucket size
        to aim for) when one was given and not ``past_limit``, else within the buffer."""
        end = self.capacity if self.limit is None or past_limit else min(self.capacity, self.limit)
        return self.offset + self.bytes_needed(entries) <= end

    def reserve(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The destination view ``shape``/``dtype`` for ``name`` (recorded in the metadata)."""
        shape = torch.Size(shape)
        start = _align(self.offset, dtype.itemsize)
        nbytes = shape.numel() * dtype.itemsize
        if start + nbytes > self.capacity:
            raise ValueError(f"tensor {name} ({nbytes} bytes) does not fit in the bucket "
                             f"({self.capacity - start} of {self.capacity} bytes left)")
        self.metadata.append(FlattenedTensorMetadata(name, shape, dtype, start, start + nbytes, nbytes))
        self.offset = start + nbytes
        size = dtype.itemsize
        typed = self._typed.get(dtype)
        if typed is None and self.capacity % size == 0 and self.buffer.data_ptr() % size == 0:
            typed = self._typed[dtype] = self.buffer.view(dtype)  # one view a buffer, not one a tensor
        if typed is None:
            return self.buffer[start:start + nbytes].view(dtype).view(shape)
        return typed[start // size:(start + nbytes) // size].view(shape)

    def add(self, name: str, src: torch.Tensor, shape: Sequence[int] | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy ``src`` (any strides; elements in row-major order of ``shape``) as ``dtype``."""
        shape = torch.Size(src.shape if shape is None else shape)
        if shape.numel() != src.numel():
            raise ValueError(f"tensor {name}: {src.numel()} elements cannot take shape {tuple(shape)}")
        dst = self.reserve(name, shape, dtype or src.dtype)
        if dst.numel():
            dst.view(src.shape).copy_(src)
        return dst

    def finish(self) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
        """(flat ``[used bytes]`` view of the buffer, metadata)."""
        if not self.metadata:
            raise ValueError("cannot finish an empty bucket")
        return self.buffer[:self.offset], list(self.metadata)

    def reset(self, buffer: torch.Tensor | None = None) -> None:
        if buffer is not None:
            self.buffer, self._typed = buffer, {}
        self.offset = 0
        self.metadata = []
