"""Preallocated, slot-based KV cache of the native engine's target model and its draft heads alike.

Layout per layer: ``k, v: [num_slots, num_kv_heads, max_len, head_dim]``. A running sequence
owns one slot; ``lens[slot]`` is how many positions of it are valid. The scheduler keeps the
running batch *compacted* in slots ``0..B-1`` (a finished row's slot is refilled by moving
the last row into it), so attention reads a strided view ``k[:B, :, :L]`` and never copies.

Rolling back rejected speculative tokens is setting ``lens`` back: entries past ``lens``
are masked out by attention and overwritten by the next write.

Each slot holds one position more than ``max_len`` that is never written or read: a read of the
whole context (``k[:B, :, :max_len]``) is then still a strict slice of the tensor. A graph that
``torch.compile`` made for a symbolic read length guards that the length is not the dimension's
whole size (a slice covering the whole dimension is specialised), so without the spare position
every compiled graph was built a second time, mid-generation, when the longest row's read bucket
reached ``max_len`` (0.5-3.9 s each on SmolLM2 on 2 cores; ``layers.compiled``).

It does not know about models, sampling or requests.
"""

from __future__ import annotations

import torch


class KVCache:
    """K/V tensors for ``num_layers`` layers and ``num_slots`` sequences of up to ``max_len``."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if min(num_layers, num_slots, num_kv_heads, max_len, head_dim) <= 0:
            raise ValueError("KVCache sizes must be positive")
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.capacity = max_len + 1  # the spare position (module docstring): a full read stays a strict slice
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lens = torch.zeros(num_slots, dtype=torch.long, device=device)

    @property
    def device(self) -> torch.device:
        return self.lens.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write_index(self, positions: torch.Tensor, slot_offset: int = 0) -> torch.Tensor:
        """Row indices into the ``[slots * nkv * capacity, d]`` view for new entries at
        ``positions [B, T]`` of slots ``offset..offset+B-1``, ordered (b, head, t) like
        ``k_new.reshape(-1, d)``. Computed once per forward and shared by every layer."""
        if positions.numel() and int(positions.max()) >= self.max_len:  # one host sync per forward
            raise IndexError(f"KV cache position {int(positions.max())} >= max_len {self.max_len}: "
                             f"sequence longer than the engine's context")
        b = positions.shape[0]
        slots = torch.arange(slot_offset, slot_offset + b, device=positions.device).view(b, 1, 1)
        heads = torch.arange(self.num_kv_heads, device=positions.device).view(1, -1, 1)
        return ((slots * self.num_kv_heads + heads) * self.capacity + positions.unsqueeze(1)).reshape(-1)

    def write(self, layer: int, index: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new, v_new [B, nkv, T, d]`` at rows ``index`` (from :meth:`write_index`).

        Positions are checked against ``max_len`` by the scheduler before a step (a host sync
        here on every layer would cost more than it saves).
        """
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k_new.reshape(-1, d).to(self.dtype))
        self.v[layer].view(-1, d).index_copy_(0, index, v_new.reshape(-1, d).to(self.dtype))

    def view(
        self, layer: int, batch: int, length: int, slot_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views ``[B, nkv, length, d]`` of slots ``offset..offset+batch-1`` (no copy)."""
        rows = slice(slot_offset, slot_offset + batch)
        return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst`` (compaction after a row leaves)."""
        if src == dst:
            return
        n = int(self.lens[src])
        for t in self.k + self.v:
            t[dst, :, :n] = t[src, :, :n]
        self.lens[dst] = n

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Share a prompt prefill: copy the first ``length`` positions of ``src`` into ``dsts``."""
        dsts = [d for d in dsts if d != src]
        if not dsts:
            return
        idx = torch.tensor(dsts, device=self.lens.device)
        for t in self.k + self.v:
            t[idx, :, :length] = t[src, :, :length].unsqueeze(0)
        self.lens[idx] = length

    def shift(self, slot: int, src: int, dst: int, n: int) -> None:
        """Move the ``n`` entries at positions ``src..`` of ``slot`` to ``dst..`` in every layer (a tree
        verify's winning second branch, written after the first, takes the first's place)."""
        if n <= 0 or src == dst:
            return
        for t in self.k + self.v:
            t[slot, :, dst:dst + n] = t[slot, :, src:src + n].clone()



READ_BUCKET = 32
"""Cache lengths a forward reads are rounded up to a multiple of this (see :func:`read_length`)."""


def read_length(kv_lens: torch.Tensor, max_len: int, bucket: int = READ_BUCKET) -> int:
    """Cache length a forward reads: the longest row's, rounded up to a multiple of ``bucket``
    (at most ``max_len``). One host sync.

    Why: oneDNN builds a primitive for each new bf16 matmul shape (about 0.6 ms on this CPU,
    against 0.04 ms for a decode-sized attention matmul) and keeps a bounded cache of them. With
    exact lengths every decode step meets a new ``[.., T, L]`` shape and the cache churns; in
    buckets a handful of lengths serve a whole generation. Keys past a row's length are masked
    out (:func:`attention_mask`), so the result is the same attention.
    """
    n = int(kv_lens.max())
    return min(-(-n // bucket) * bucket, max_len)


def tree_attention_mask(cache_positions: torch.Tensor, visible: torch.Tensor, length: int) -> torch.Tensor:
    """Attention mask of a forward whose new tokens form a tree (several branches after one root).

    Args:
        cache_positions: ``[B, T]`` cache position each new token is written to, ``cache_positions[:, 0]``
            the first (every earlier position of the row is its prefix, seen by all new tokens).
        visible: ``[B, T, T]`` bool, ``visible[b, i, j]``: new token i attends to new token j (its
            ancestors and itself).
        length: cache length read (``> cache_positions.max()``).
    Returns:
        ``[B, 1, T, length]`` bool, True where attention is allowed.
    """
    b, t = cache_positions.shape
    keys = torch.arange(length, device=cache_positions.device).view(1, 1, length)
    mask = (keys < cache_positions[:, :1].unsqueeze(-1)).expand(b, t, length).clone()  # the prefix
    mask.scatter_(2, cache_positions.unsqueeze(1).expand(b, t, t), visible)
    return mask.unsqueeze(1)


def attention_mask(q_positions: torch.Tensor, kv_lens: torch.Tensor, length: int) -> torch.Tensor:
    """Causal mask over cached keys: query at absolute position p sees keys 0..p.

    Args:
        q_positions: ``[B, T]`` absolute positions of the new tokens.
        kv_lens: ``[B]`` valid cache entries per row *including* the new tokens.
        length: cache length read (``>= kv_lens.max()``).
    Returns:
        ``[B, 1, T, length]`` bool, True where attention is allowed.
    """
    keys = torch.arange(length, device=q_positions.device).view(1, 1, 1, length)
    allowed = keys <= q_positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, L]
    return allowed & (keys < kv_lens.view(-1, 1, 1, 1))
