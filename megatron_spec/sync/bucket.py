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


def bucket_layout(named: Sequence[tuple[str, torch.Size | Sequence[int], torch.dtype]]) -> tuple[list[FlattenedTensorMetadata], int]:
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
    for (name, tensor), m in zip(named_tensors, meta):
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
