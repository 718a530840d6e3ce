"""Serialising weight payloads across processes, the way SGLang does, with an allowlist.

Sending side: ``ForkingPickler`` (torch's multiprocessing reductions are registered), so a
CUDA tensor travels as a CUDA IPC handle and a CPU tensor as a shared-memory file
name (torch's ``file_system`` reduction, whatever the process-wide strategy): the bytes on
the wire are a few hundred, whatever the tensor size. The sender
must keep the tensors alive until the receiver has copied them (the caller holds the
returned buffers until the engine acknowledges the update).

Receiving side: :func:`deserialize` refuses every global that is not on an explicit
allowlist of containers, torch rebuild functions, dtypes and bucket metadata. A payload that
carries anything else (an arbitrary callable, a custom object) raises
:class:`UnsafePayloadError` before any of it runs.

A bucket payload is ``{"flattened_tensor": uint8 tensor, "metadata": [records]}``, exactly
what SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")`` reads.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
import torch.multiprocessing.reductions as _reductions

from megatron_spec.sync.bucket import FlattenedTensorMetadata, unpack_bucket


class UnsafePayloadError(pickle.UnpicklingError):
    """A payload referenced something outside the allowlist."""


_DTYPE_NAMES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}

_ALLOWED: set[tuple[str, str]] = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "set",
                              "frozenset", "slice", "str", "tuple", "complex")
} | {
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("copyreg", "_reconstructor"),
    ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("multiprocessing.resource_sharer", "DupFd"),
} | {("torch", n) for n in _DTYPE_NAMES}

# Bucket metadata: ours, and SGLang's class of the same shape (read as ours).
_METADATA_CLASSES = {
    ("megatron_spec.sync.bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return FlattenedTensorMetadata
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafePayloadError(
            f"payload refused: global {module}.{name} is not allowed in a weight payload"
        )


def _reduce_cpu_storage_by_name(storage: torch.UntypedStorage):
    """torch's ``file_system`` reduction of a CPU storage, whatever the process-wide strategy.

    A shared-memory *file descriptor* (torch's default strategy) travels through
    ``multiprocessing.resource_sharer``: a socket round trip per payload, ~0.4 ms before the
    receiver can even look the buffer up in its cache. A *name* needs none: a receiver that still
    maps the buffer (the streamer reuses two) finds it in torch's ``shared_cache`` at once.
    The bytes rebuild with ``rebuild_storage_filename``, which SGLang's ``SafeUnpickler`` and
    our allowlist both accept. Not for empty storages (nothing to map).
    """
    if storage.device.type != "cpu" or storage.size() == 0:
        return _reductions.reduce_storage(storage)
    manager, handle, size = storage._share_filename_cpu_()  # moves a private storage into shm once
    storage._shared_incref()  # the receiver's rebuild takes this reference back
    _reductions.shared_cache[handle] = _reductions.StorageWeakRef(storage)
    return _reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor(tensor: torch.Tensor):
    """torch's tensor reduction, with SGLang's CUDA-only patch kept off CPU tensors.

    SGLang's ``monkey_patch_torch_reductions`` (applied by :func:`make_bucket_payloads` for CUDA
    buffers, and by SGLang's TP workers) rewrites argument 6 of *every* tensor's reduction as a
    CUDA device; a CPU tensor's reduction has three arguments, so after the patch any CPU payload
    in that process (e.g. the draft re-pushed from its host copy) raised IndexError.
    """
    if tensor.is_cuda:
        return _reductions.reduce_tensor(tensor)
    return getattr(_reductions, "_reduce_tensor_original", _reductions.reduce_tensor)(tensor)


def serialize(obj: Any) -> bytes:
    """ForkingPickler bytes (tensors by IPC handle / shared memory), like SGLang's serializer;
    CPU storages travel by shared-memory name (:func:`_reduce_cpu_storage_by_name`)."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage_by_name
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dump(obj)
    return buf.getvalue()


def deserialize(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of :func:`serialize`, refusing anything outside the allowlist."""
    return _AllowlistUnpickler(io.BytesIO(bytes(data))).load()


def make_bucket_payload(flat: torch.Tensor, metadata: Sequence, *, for_sglang: bool = False) -> bytes:
    """Serialise one bucket; with ``for_sglang`` the metadata become SGLang's own class."""
    return make_bucket_payloads(flat, metadata, 1, for_sglang=for_sglang)[0]


def make_bucket_payloads(flat: torch.Tensor, metadata: Sequence, num_ranks: int, *,
                         for_sglang: bool = False, lent: bool = False, panels: Sequence[str] = ()
                         ) -> list[bytes]:
    """One payload per engine TP rank, each referencing the same buffer.

    ``lent``: the sender lends the buffer to the receiver for good: it rewrites it only with the next
    complete update of the same group (:attr:`~megatron_spec.interfaces.WeightReceiver.keeps_lent_buckets`);
    the payload then carries ``"lent": True`` beside SGLang's two keys (never with ``for_sglang``).
    ``panels``: names of the lent bucket's tensors written in the linear kernel's panel layout instead of rows
    (:meth:`~megatron_spec.interfaces.WeightReceiver.lent_panel_names`), carried as ``"panels"``.

    Each engine rank must deserialise its own payload exactly once (a shared-memory handle
    is handed over once; SGLang's CUDA IPC refcounting expects one consumer per payload).
    With ``for_sglang`` the metadata become SGLang's own class and, for CUDA buffers,
    SGLang's torch-reduction patch is applied (devices travel by UUID, so ranks with other
    ``CUDA_VISIBLE_DEVICES`` open the right GPU), as SGLang's RL integrations do.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bucket must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    if for_sglang:
        from megatron_spec.sync.bucket import to_sglang_metadata

        metadata = to_sglang_metadata(metadata)
        if flat.is_cuda:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
    if lent and for_sglang:
        raise ValueError("a lent bucket is the native engine's; SGLang's loader copies every bucket")
    if panels and not lent:
        raise ValueError("tensors in the panel layout travel only in a lent bucket")
    obj = {"flattened_tensor": flat, "metadata": list(metadata)}
    if lent:
        obj["lent"] = True
    if panels:
        obj["panels"] = sorted(panels)
    return [serialize(obj) for _ in range(num_ranks)]


def _check_record(m: FlattenedTensorMetadata) -> None:
    ints = (m.start_idx, m.end_idx, m.numel)
    if not isinstance(m.name, str) or not all(type(v) is int for v in ints):
        raise UnsafePayloadError(f"bucket metadata record has wrong field types: {m!r}")
    shape = m.shape
    if not isinstance(shape, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
        raise UnsafePayloadError(f"bucket tensor {m.name}: shape {shape!r} is not a tuple of sizes")
    if not isinstance(m.dtype, torch.dtype):
        raise UnsafePayloadError(f"bucket tensor {m.name}: dtype {m.dtype!r} is not a torch.dtype")


def read_bucket_payload(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Deserialise a bucket payload into ``(name, tensor view)`` pairs (:func:`read_bucket`, whether the
    bucket is lent left aside: for receivers that copy every tensor; a lent bucket with tensors in the panel
    layout is refused there)."""
    named, _, panels = read_bucket(data)
    if panels:
        raise UnsafePayloadError(f"{len(panels)} tensors in the panel layout sent to a receiver that copies")
    return named


def read_bucket(data: bytes) -> tuple[list[tuple[str, torch.Tensor]], bool, frozenset[str]]:
    """Deserialise a bucket payload into ``(name, tensor view)`` pairs, whether the sender lent the buffer,
    and the names written in the panel layout (:func:`make_bucket_payloads`).

    Raises:
        UnsafePayloadError: a global outside the allowlist, or a payload that is not exactly
            ``{"flattened_tensor": uint8 tensor, "metadata": [records]}`` (and ``"lent": True``, then
            optionally ``"panels": [names of its records]``) with well-typed records.
        ValueError: records that do not fit the bucket (misaligned, out of bounds).
    """
    obj = deserialize(data)
    keys = set(obj) if isinstance(obj, dict) else None
    base = {"flattened_tensor", "metadata"}
    if keys not in (base, base | {"lent"}, base | {"lent", "panels"}) or obj.get("lent", True) is not True:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise UnsafePayloadError(f"payload is not a flattened bucket (got {got})")
    flat, meta = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or not isinstance(meta, list) \
            or not all(isinstance(m, FlattenedTensorMetadata) for m in meta):
        raise UnsafePayloadError(
            "payload bucket must hold a tensor and a list of FlattenedTensorMetadata records"
        )
    for m in meta:
        _check_record(m)
    panels = obj.get("panels", [])
    if not isinstance(panels, list) or not all(isinstance(n, str) for n in panels) \
            or not set(panels) <= {m.name for m in meta}:
        raise UnsafePayloadError("payload 'panels' must list names of the bucket's own tensors")
    return unpack_bucket(flat, meta), "lent" in obj, frozenset(panels)
