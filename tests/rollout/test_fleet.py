"""The engine layout (which rank owns and feeds which engine) and the per-step sharding of prompts."""

from __future__ import annotations

import pytest

from megatron_spec.config import ConfigError
from megatron_spec.rollout.fleet import EngineLayout, imbalance, request_work, shard_requests


def layout(world, tp=1, n=None, t=None, per_node=None, backend="native"):
    return EngineLayout.resolve(world_size=world, trainer_tp_size=tp, num_engines=n, engine_tp_size=t,
                                ranks_per_node=per_node or world, backend=backend)


def test_default_is_one_engine_per_node():
    assert layout(16, per_node=8).num_engines == 2
    assert layout(4).num_engines == 1
    lay = layout(16, per_node=8, backend="sglang")
    assert lay.engine_tp_size == 8 and list(lay.senders(1)) == list(range(8, 16))  # the whole node


def test_owners_blocks_and_senders():
    lay = layout(4, tp=2, n=2)
    assert [lay.owner(e) for e in range(2)] == [0, 2]
    assert [lay.engine_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [lay.is_owner(r) for r in range(4)] == [True, False, True, False]
    assert [lay.sender_engine(r) for r in range(4)] == [0, None, 1, None]
    # rank 1 shares rank 0's trainer TP group: it takes part in engine 0's gathers only
    assert lay.gathers(1, [0]) and not lay.gathers(1, [1]) and not lay.gathers(3, [0])
    assert "2 rollout engine(s)" in lay.describe()


def test_engines_inside_one_tp_group_all_gather_together():
    lay = layout(2, tp=2, n=2)  # each rank owns an engine; both are in one TP group
    assert lay.gathers(0, [1]) and lay.gathers(1, [0])


def test_sglang_engine_senders_are_its_first_t_ranks():
    lay = layout(8, tp=2, n=2, t=2, per_node=8, backend="sglang")
    assert list(lay.senders(1)) == [4, 5] and lay.sender_engine(5) == 1 and lay.sender_engine(6) is None


@pytest.mark.parametrize("kw, message", [
    (dict(world=4, n=3), "does not divide the world size 4"),
    (dict(world=4, n=2, t=2), "native engine runs on one device"),
    (dict(world=4, n=2, t=3, backend="sglang"), "must be in 1..2"),
    (dict(world=16, n=1, t=16, per_node=8, backend="sglang"), "exceeds the 8 ranks of a node"),
    (dict(world=24, n=2, t=1, per_node=8, backend="sglang"), "do not tile nodes"),
])
def test_bad_layouts_are_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        layout(**kw)


def test_shards_keep_groups_whole_and_balance_work():
    work = [request_work(8, 20, 64)] * 6 + [request_work(8, 200, 64)] * 2
    shards = shard_requests(work, 3)
    assert sorted(i for s in shards for i in s) == list(range(8))  # every request exactly once
    assert all(s == sorted(s) for s in shards)
    loads = [sum(work[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(work)  # LPT: within one request of even
    assert shard_requests(work, 3) == shards  # deterministic
    assert shard_requests([1.0, 1.0], 4) == [[0], [1], [], []]
    assert shard_requests([], 2) == [[], []]
    with pytest.raises(ValueError):
        shard_requests([1.0], 0)


def test_imbalance():
    assert imbalance([2.0, 2.0]) == 1.0
    assert imbalance([3.0, 1.0]) == pytest.approx(1.5)
    assert imbalance([1.0, 0.0]) == 1.0 and imbalance([]) == 1.0
