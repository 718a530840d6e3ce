"""Exact, layout-independent fingerprints of a group of weight tensors.

The trainer and the engine hold the same weights in different layouts: the engine fuses
q/k/v and gate/up, stores linear weights transposed, may shard them. A fingerprint that
both sides can compute must therefore be a function of the *multiset* of element values,
and it must be exact: one policy step changes bf16 weights by an ulp here and there, and a
float sum with a tolerance cannot tell a stale engine from a fresh one.

For every tensor we read each element's bit pattern ``b`` as a signed integer of the
element's width (int16 for bf16, int32 for fp32, ...) and accumulate, per dtype,

    numel,   s1 = sum(b) mod 2**64,   s2 = sum(b * b) mod 2**64.

Both sums are exact and order-free (integer addition mod 2**64), so concatenating,
splitting, transposing or sharding the tensors does not change them. ``s1`` alone misses
two elements moving by +1 and -1 ulp; ``s2`` (a non-linear term) catches that.

The fingerprint is of the values *as the engine holds them*: compute it on tensors in the
engine's dtype (:func:`fingerprint_tensors` casts when asked).

This module knows nothing about models, engines or processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

_MOD = 1 << 64
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 15  # elements per step of the s2 pass (bounds its temporary to 256 KiB)
_CAST_CHUNK = 1 << 20  # elements cast to the engine dtype at a time
_CPU = torch.device("cpu")
_KEYS: dict[torch.dtype, str] = {}  # a dtype's name in :attr:`Fingerprint.parts`
_DEVICE_CHUNK = 1 << 22  # elements widened to int64 at a time on a GPU (a 32 MiB temporary)


class Fingerprint:
    """Per-dtype ``[numel, s1, s2]`` accumulator (see the module docstring)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Mapping[str, list[int]] | None = None):
        self.parts: dict[str, list[int]] = {k: list(v) for k, v in (parts or {}).items()}

    @property
    def numel(self) -> int:
        return sum(p[0] for p in self.parts.values())

    def add(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
        """Accumulate ``tensor`` (cast to ``dtype`` first when given, a chunk at a time so the
        temporary stays small). Returns self."""
        x = tensor.detach()
        if dtype is None or x.dtype == dtype:
            return self._add_sums(x.dtype, *_bits_sums(x))
        flat = x.contiguous().reshape(-1)
        for i in range(0, flat.numel(), _CAST_CHUNK):
            self._add_sums(dtype, *_bits_sums(flat[i:i + _CAST_CHUNK].to(dtype)))
        return self

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> Fingerprint:
        """``dst.copy_(src)`` and accumulate ``dst`` as written (its dtype), in one pass over the bytes where
        the compiled op can (both on the CPU, one dtype, ``dst`` contiguous: a sync's pack into its bucket and
        the engine's load into its parameters); otherwise the copy, then :meth:`add`. Returns self."""
        if dst.shape != src.shape:
            raise ValueError(f"copy_in: shapes differ, {tuple(dst.shape)} and {tuple(src.shape)}")
        # the checks in the order that rejects cheaply; a sync makes hundreds of these calls, so the fast path
        # stays a few attribute reads from the op (each of which costs ~1 us in Python)
        dtype = dst.dtype
        bits = _INT_VIEW.get(dst.element_size()) if dtype == src.dtype and dtype != torch.bool else None
        if (bits is not None and dst.is_cpu and src.is_cpu and dst.is_contiguous() and dst.numel()
                and _compiled_copy_sums()):
            sums = torch.ops.megatron_spec.bits_sums_copy.default(
                src.detach().reshape(-1).view(bits), dst.detach().view(-1).view(bits))
            s1, s2 = sums.tolist()
            return self._add_sums(dtype, dst.numel(), s1 % _MOD, s2 % _MOD)
        dst.copy_(src)
        return self.add(dst)

    def add_sums(self, dtype: torch.dtype, numel: int, sums: torch.Tensor) -> Fingerprint:
        """Accumulate the sums a compiled op took of ``numel`` elements of ``dtype`` in a pass of its own
        (``[2]`` int64, as ``megatron_spec::bits_sums`` returns them: e.g. an engine's re-pack of a linear
        layer, ``linear_pack_into_sums``). Returns self."""
        s1, s2 = sums.tolist()
        return self._add_sums(dtype, int(numel), s1 % _MOD, s2 % _MOD)

    def _add_sums(self, dtype: torch.dtype, n: int, s1: int, s2: int) -> Fingerprint:
        key = _KEYS.get(dtype)
        if key is None:
            key = _KEYS[dtype] = str(dtype).removeprefix("torch.")
        part = self.parts.setdefault(key, [0, 0, 0])
        part[0] += n
        part[1] = (part[1] + s1) % _MOD
        part[2] = (part[2] + s2) % _MOD
        return self

    def merge(self, other: Fingerprint) -> Fingerprint:
        for key, (n, s1, s2) in other.parts.items():
            part = self.parts.setdefault(key, [0, 0, 0])
            part[0] += n
            part[1] = (part[1] + s1) % _MOD
            part[2] = (part[2] + s2) % _MOD
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain data (picklable, JSON-able): ``{"numel": n, "bits": {dtype: [numel, s1, s2]}}``."""
        return {"numel": self.numel, "bits": {k: list(v) for k, v in sorted(self.parts.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fingerprint:
        if "bits" not in d:
            raise ValueError(f"not a bit fingerprint: keys {sorted(d)}")
        return cls(d["bits"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        return {k: v for k, v in self.parts.items() if v[0]} == {k: v for k, v in other.parts.items() if v[0]}

    def __repr__(self) -> str:
        return f"Fingerprint({self.to_dict()['bits']})"


def _bits_sums(x: torch.Tensor) -> tuple[int, int, int]:
    """(numel, sum of bit patterns, sum of their squares), the sums mod 2**64."""
    n = x.numel()
    if n == 0:
        return 0, 0, 0
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    width = x.element_size()
    if width not in _INT_VIEW:
        raise TypeError(f"cannot fingerprint a tensor of dtype {x.dtype}")
    bits = x.contiguous().reshape(-1).view(_INT_VIEW[width])
    if bits.device.type == "cpu":
        if _compiled_sums():
            # one pass, threads (csrc/fingerprint_cpu.cpp)
            s1, s2 = torch.ops.megatron_spec.bits_sums(bits).tolist()
            return n, s1 % _MOD, s2 % _MOD
        return n, *_numpy_sums(bits.numpy())
    return n, *_torch_sums(bits)


def _compiled_sums() -> bool:
    from megatron_spec.ops import compiled_kernel_for

    return compiled_kernel_for("bits_sums", _CPU)


def _compiled_copy_sums() -> bool:
    from megatron_spec.ops import compiled_kernel_for

    return compiled_kernel_for("bits_sums_copy", _CPU)


def _numpy_sums(a: np.ndarray) -> tuple[int, int]:
    """The reference of the compiled ``bits_sums`` (and the path without it): numpy's integer reductions
    are vectorised (torch's CPU integer sums are ~10x slower here), a chunk at a time."""
    s1 = 0
    s2 = 0
    wide = np.empty(min(a.size, _CHUNK), dtype=np.uint64)
    for i in range(0, a.size, _CHUNK):
        chunk = a[i:i + _CHUNK]
        s1 += int(np.add.reduce(chunk, dtype=np.int64))
        w = wide[:chunk.size]
        np.copyto(w, chunk, casting="unsafe")  # two's complement: b mod 2**64
        np.multiply(w, w, out=w)  # wraps mod 2**64 (uint64), still b*b mod 2**64
        s2 += int(np.add.reduce(w, dtype=np.uint64))
    return s1 % _MOD, s2 % _MOD


def _torch_sums(bits: torch.Tensor) -> tuple[int, int]:
    """Device-side sums (CUDA): widened a chunk at a time (the int64 temporary stays bounded), accumulated
    on the device, read back once per tensor: one host sync, not two per chunk (an 8B model's weight
    sync would otherwise make ~5e5 of them)."""
    acc = torch.zeros(2, dtype=torch.int64, device=bits.device)  # [s1, s2], int64 wrap-around == mod 2**64
    for i in range(0, bits.numel(), _DEVICE_CHUNK):
        w = bits[i:i + _DEVICE_CHUNK].to(torch.int64)
        acc[0] += w.sum()
        acc[1] += (w * w).sum()
    s1, s2 = acc.tolist()  # the host sync, once per tensor
    return s1 % _MOD, s2 % _MOD


def fingerprint_tensors(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> Fingerprint:
    """Fingerprint of a group of tensors, each cast to ``dtype`` (the engine's) when given."""
    fp = Fingerprint()
    for t in tensors:
        fp.add(t, dtype)
    return fp


def fingerprint_dict(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """:func:`fingerprint_tensors` as plain data (what an engine's ``health()`` reports)."""
    return fingerprint_tensors(tensors, dtype).to_dict()
