"""The pieces of a fused parameter, kept side by side on both sides of a lent weight sync.

Engines hold q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (vLLM's and SGLang's
``stacked_params_mapping``; the native engine's loader reads :data:`FUSED`). A trainer that lends its buckets
(:class:`~megatron_spec.sync.streamer.WeightStreamer`'s ``lend_buckets``) sends the pieces one after the other
into one bucket, so that the receiving engine's fused parameter can be a view of the bucket
(:func:`joined_view`) instead of a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""An engine's fused parameter -> the HF pieces it holds side by side, in shard order."""


def siblings(name: str) -> list[str]:
    """The HF names of ``name``'s fused parameter in shard order (``name`` among them), or ``[name]``."""
    return list(_siblings(name))


@functools.lru_cache(maxsize=1 << 14)  # asked for every tensor of every sync: the same few hundred names
def _siblings(name: str) -> tuple[str, ...]:
    for pieces in FUSED.values():
        token = next((f".{p}." for p in pieces if f".{p}." in name), None)
        if token is not None:
            return tuple(name.replace(token, f".{p}.") for p in pieces)
    return (name,)


def later_pieces(name: str) -> list[str]:
    """The HF names that follow ``name`` in its fused parameter when it is the first piece (k and v after q,
    up after gate; none after the others)."""
    group = _siblings(name)
    return list(group[1:]) if group[0] == name else []


def fused_order(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with the pieces of each fused parameter side by side in shard order, at the place of the
    first of them (as the Megatron stream has them; a checkpoint's sorted names put k before q). A list with a
    name twice is returned as it is."""
    by_name = dict(named)
    if len(by_name) != len(named):
        return named
    out, done = [], set()
    for name, _ in named:
        if name not in done:
            group = [n for n in siblings(name) if n in by_name]
            out += [(n, by_name[n]) for n in group]
            done.update(group)
    return out


def joined_view(parts: Sequence[torch.Tensor | None], param: torch.Tensor, rows: Sequence[int]
                ) -> torch.Tensor | None:
    """``param``'s shape as one view of the memory ``parts`` lie in, or None unless every part is there, in
    ``param``'s dtype and device, contiguous, ``rows[i]`` rows of ``param``'s row shape, and each starting
    where the one before ends in the same storage."""
    if not param.is_contiguous() or len(parts) != len(rows) or any(t is None for t in parts):
        return None
    if not all(t.dtype == param.dtype and t.device == param.device and t.is_contiguous()
               and tuple(t.shape) == (r, *param.shape[1:]) for t, r in zip(parts, rows)):
        return None
    if not all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
               and a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts, parts[1:])):
        return None
    return parts[0].as_strided(param.shape, param.stride())
