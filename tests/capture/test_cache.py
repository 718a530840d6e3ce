"""DraftCache arithmetic: segment runs, selection, concatenation, padding, micro-batching."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.capture.cache import DraftCache, micro_batches, segment_runs


def _cache(lens: list[int], k: int = 2, h: int = 3) -> DraftCache:
    n = sum(lens)
    rows = torch.arange(n)
    return DraftCache(
        tokens=rows + 100,
        positions=rows,
        next_tokens=rows + 101,
        next_logprobs=-rows.float(),
        teacher_logprobs=torch.full((n, k), -1.0),
        teacher_ids=torch.zeros(n, k, dtype=torch.long),
        cu_seqlens=torch.tensor([0] + lens).cumsum(0),
        embeds=rows.float().unsqueeze(1).expand(n, h),
        aux=None,
        hidden=None,
    )


def test_segment_runs_split_at_holes_and_rows():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    # row 0: runs at 1 (len 2) and 4 (len 3); row 1: at 0 (len 2) and 6 (len 1)
    assert segment_runs(mask) == [(0, 1, 2), (0, 4, 3), (1, 0, 2), (1, 6, 1)]
    assert segment_runs(torch.zeros(2, 3, dtype=torch.bool)) == []


def test_select_segments_keeps_rows_of_each_segment_in_order():
    c = _cache([2, 3, 1])  # rows 0-1 | 2-4 | 5
    sel = c.select_segments([2, 0])
    assert sel.tokens.tolist() == [105, 100, 101]
    assert sel.cu_seqlens.tolist() == [0, 1, 3]
    assert sel.embeds[:, 0].tolist() == [5.0, 0.0, 1.0]
    assert c.select_segments([]).num_rows == 0


def test_concat_offsets_segments_and_sums_drops():
    a, b = _cache([2]), _cache([1, 2])
    b.dropped_rows = 4
    c = DraftCache.concat([a, b])
    assert c.cu_seqlens.tolist() == [0, 2, 3, 5]
    assert c.tokens.tolist() == [100, 101, 100, 101, 102]
    assert c.dropped_rows == 4
    assert c.nbytes == a.nbytes + b.nbytes - 8  # one cu_seqlens entry fewer than two separate caches


def test_concat_refuses_mixed_fields():
    a, b = _cache([2]), _cache([1])
    b.embeds = None
    with pytest.raises(ValueError, match="embeds captured in some parts only"):
        DraftCache.concat([a, b])


def test_padded_right_pads_per_segment():
    c = _cache([2, 3])
    out = c.padded("tokens", [1, 0], pad_value=-1)
    assert out.tolist() == [[102, 103, 104], [100, 101, -1]]
    with pytest.raises(ValueError, match="has no aux"):
        c.padded("aux", [0])


def test_rows_must_agree():
    c = _cache([2])
    with pytest.raises(ValueError, match="positions has 1 rows, tokens has 2"):
        DraftCache(
            tokens=c.tokens,
            positions=c.positions[:1],
            next_tokens=c.next_tokens,
            next_logprobs=c.next_logprobs,
            teacher_logprobs=c.teacher_logprobs,
            cu_seqlens=c.cu_seqlens,
        )


def test_micro_batches_bound_padded_rows():
    lens = [5, 1, 4, 4, 2]
    batches = micro_batches(lens, max_rows=8)
    # longest first: [5] (2*5 > 8 stops), [4, 4] (8), [2, 1] (4)
    assert batches == [[0], [2, 3], [4, 1]]
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert micro_batches([9], max_rows=4) == [[0]]  # a long segment gets its own batch
