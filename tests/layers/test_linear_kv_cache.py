"""The shared layers' engine helpers: the oneDNN warm-up of packed linears and the bucketed
cache length attention reads."""

from __future__ import annotations

import torch

from megatron_spec.layers.kv_cache import read_length
from megatron_spec.layers.linear import Linear, pack_linears, warm_linears


def test_warm_linears_calls_each_distinct_packed_shape_per_row_count(monkeypatch):
    from megatron_spec.layers import linear

    net = torch.nn.Sequential(Linear(8, 16, bias=False), Linear(8, 16, bias=False), Linear(16, 4))
    pack_linears(net)
    if net[0]._small is not None:  # fp32 with the kernel's panels: no oneDNN copy, no primitive to build
        assert not net[0]._packed.is_mkldnn and warm_linears([net], 5) == 0
    monkeypatch.setattr(linear, "ONEDNN_COPY_F32", True)
    # two layers of one shape, one of another, one left unpacked: 2 distinct packed shapes
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


def test_tied_head_packs_the_embedding_table_and_follows_its_updates():
    from megatron_spec.layers.linear import TiedLinear

    torch.manual_seed(0)
    emb = torch.nn.Embedding(300, 24)
    head = TiedLinear(emb)
    assert list(head.parameters()) == [] and head.state_dict() == {}  # the table stays the embedding's
    assert (head.in_features, head.out_features) == (24, 300)
    x = torch.randn(5, 24)
    with torch.inference_mode():
        plain = head(x)
        torch.testing.assert_close(plain, x @ emb.weight.t(), rtol=0, atol=0)
        packed = pack_linears(torch.nn.ModuleList([head]))
        torch.testing.assert_close(head(x), plain, rtol=1e-5, atol=1e-5)
        if packed:
            assert head._packed is not None
        with torch.no_grad():
            emb.weight.mul_(2)  # a weight update: the packed copy is stale until packed again
        pack_linears(torch.nn.ModuleList([head]))
        torch.testing.assert_close(head(x), 2 * plain, rtol=1e-5, atol=1e-5)


def test_rotary_tables_are_shared_within_a_forward_and_rotate_as_before():
    from megatron_spec.layers.decoder import Rotary

    rot = Rotary(8, 64, 10000.0, None)
    pos = torch.tensor([[3, 4, 5], [9, 10, 11]])
    q, k = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 3, 8)
    cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)

    def written_out(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    with rot.reuse_tables():
        first = rot.tables(pos, torch.float32)
        assert rot.tables(pos, torch.float32)[0] is first[0]  # looked up once for the same tensor
        assert rot.tables(pos.clone(), torch.float32)[0] is not first[0]  # another tensor: its own lookup
        qr, kr = rot(q, k, pos)
        both = rot.apply(torch.cat([q, k], 1), pos)  # queries and keys stacked: the same values
    assert rot._memo is None  # nothing kept past the block
    assert torch.equal(qr, written_out(q)) and torch.equal(kr, written_out(k))
    assert torch.equal(both, torch.cat([qr, kr], 1))


def test_fused_attention_choice_gives_the_same_attention():
    import torch.nn.functional as F

    from megatron_spec.layers.decoder import gqa_attention, use_fused_attention

    assert use_fused_attention(torch.float32, 1, 4) and use_fused_attention(torch.float32, 16, 1)
    assert not use_fused_attention(torch.float32, 16, 4)
    assert use_fused_attention(torch.bfloat16, 1, 1) and not use_fused_attention(torch.bfloat16, 1, 8)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.arange(40).view(1, 1, 1, 40) <= torch.tensor([[30, 31, 32], [20, 21, 22]]).view(2, 1, 3, 1)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(fused, gqa_attention(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-6)


def test_linear_stores_the_weight_as_loaded_and_reads_state_dicts_of_the_transposed_storage():
    torch.manual_seed(0)
    lin = Linear(6, 4)
    assert lin.weight.shape == (4, 6) and lin.weight.is_contiguous()  # [out, in]: a load is one straight copy
    torch.manual_seed(0)
    drawn = torch.empty(6, 4).normal_(std=0.02)  # the values the earlier [in, out] storage drew
    assert torch.equal(lin.weight, drawn.t())
    old = {"weight_t": torch.randn(6, 4), "bias": torch.randn(4)}  # a checkpoint of that storage
    lin.load_state_dict(dict(old))
    assert torch.equal(lin.weight, old["weight_t"].t()) and torch.equal(lin.bias, old["bias"])
    x = torch.randn(3, 6)
    assert torch.allclose(lin(x), x @ old["weight_t"] + old["bias"], atol=1e-6)
