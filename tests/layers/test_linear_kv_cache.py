"""The shared layers' engine helpers: the oneDNN warm-up of packed linears and the bucketed
cache length attention reads."""

from __future__ import annotations

import torch

from megatron_spec.layers.kv_cache import read_length
from megatron_spec.layers.linear import Linear, pack_linears, warm_linears


def test_warm_linears_calls_each_distinct_packed_shape_per_row_count():
    # two layers of one shape, one of another, one left unpacked: 2 distinct packed shapes
    net = torch.nn.Sequential(Linear(8, 16, bias=False), Linear(8, 16, bias=False), Linear(16, 4))
    pack_linears(net)
    if net[0]._packed is None:  # no oneDNN in this torch build: nothing to warm
        assert warm_linears([net], 5) == 0
        return
    calls = []
    for m in net:
        m.register_forward_hook(lambda mod, args, out: calls.append((mod.in_features, args[0].shape[0])))
    assert warm_linears([net], 5) == 10
    assert sorted(calls) == sorted([(8, r) for r in range(1, 6)] + [(16, r) for r in range(1, 6)])
    calls.clear()
    assert warm_linears([net], 5, max_primitives=6) == 6  # capped: 3 row counts x 2 shapes
    assert max(r for _, r in calls) == 3
    net[2].unpack()
    assert warm_linears([net], 2) == 2  # unpacked layers take the plain path: nothing to build


def test_read_length_buckets_the_longest_row_and_caps_at_the_cache():
    assert read_length(torch.tensor([3, 17, 9]), max_len=200) == 32
    assert read_length(torch.tensor([32]), max_len=200) == 32
    assert read_length(torch.tensor([33, 1]), max_len=200) == 64
    assert read_length(torch.tensor([150]), max_len=140) == 140  # never past the cache
    assert read_length(torch.tensor([5]), max_len=200, bucket=1) == 5
