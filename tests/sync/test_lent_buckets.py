"""Lent buckets (issue 55): the native engine computes with the trainer's bucket buffers, not copies of them.

A lent sync gives each bucket of a group a buffer of its own, kept by the streamer and rewritten only by that
group's next sync; the engine's target parameters become views of those buffers (fused q/k/v and gate/up
included: the stream keeps their pieces in one bucket), and everything it holds and computes must equal an
engine that copied the same weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.layers.linear import Linear, TiedLinear, linear_layers
from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.hf_weights import rows_of_panels
from megatron_spec.rollout.native.server import EngineServer
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.bucket import BucketWriter, alloc_bucket_buffer
from megatron_spec.sync.fingerprint import Fingerprint, fingerprint_tensors
from megatron_spec.sync.fused_pieces import fused_order
from megatron_spec.sync.streamer import WeightStreamer
from megatron_spec.sync.transport import make_bucket_payloads


def ckpt_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    ck = HFCheckpoint(path)
    return [(n, ck.get(n)) for n in ck.weight_names()]


def server(ckpts) -> EngineServer:
    return EngineServer(EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3,
                                     max_batch_size=2, context_length=32, num_threads=1, warm_up=False))


def greedy(engine: EngineServer) -> list[list[int]]:
    reqs = [GenerateRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=12))
            for i, p in enumerate(([5, 6, 7], [9, 3]))]
    samples, _ = engine.generate(reqs, seed=3)
    return [s.output_ids for s in sorted(samples, key=lambda s: s.request_id)]


def in_buffers(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= t.data_ptr() and t.data_ptr() + t.nbytes <= b.data_ptr() + b.nbytes
               for b in buffers)


def held(engine: EngineServer) -> dict[str, torch.Tensor]:
    """The target's parameters as rows (a layer holding its weight as panels: their rows)."""
    panels = {name for layer, name in linear_layers(engine.target) if layer.holds_panels}
    return {n: (rows_of_panels(p) if n in panels else p).detach().clone()
            for n, p in engine.target.named_parameters()}


def test_a_lent_sync_makes_the_targets_parameters_views_of_the_senders_buckets(ckpts):
    lent, copied = server(ckpts), server(ckpts)
    st = WeightStreamer(lent, bucket_bytes=96 << 10, weight_dtype="fp32")
    ref = WeightStreamer(copied, bucket_bytes=96 << 10, weight_dtype="fp32", lend_buckets=False)
    assert st.lend_buckets and not ref.lend_buckets
    for version, path in (("t1", ckpts.qwen3_other), ("t2", ckpts.qwen3)):
        named = ckpt_tensors(path)
        rep = st.sync_target_tensors(named, version)  # verified: the engine's sums equal the sent ones
        ref.sync_target_tensors(named, version)
        assert rep.num_buckets > 2 and len(st._pools["target"]) == rep.num_buckets
        buffers = st._pools["target"]
        for name, p in lent.target.named_parameters():
            assert p.is_shared() and in_buffers(p, buffers), f"{name} is not a view of a lent bucket"
        assert not any(p.is_shared() for p in copied.target.parameters())
        assert all(not p.is_shared() for p in lent._draft_module().parameters())  # the draft copies
        want, got = held(copied), held(lent)
        assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
        assert Fingerprint.from_dict(lent.health()["checksums"]["target"]) == fingerprint_tensors(
            t for _, t in named)
        assert greedy(lent) == greedy(copied)  # the linears packed from the views compute the same


def test_a_lent_bucket_keeps_the_pieces_of_a_fused_parameter_together(ckpts):
    """40 KiB buckets: q, k and v (16 + 8 + 8 KiB) and gate and up (32 + 32 KiB) would be split between two
    buckets here and there by size alone; lent, each fused parameter is still one view."""
    engine = server(ckpts)
    st = WeightStreamer(engine, bucket_bytes=40 << 10, weight_dtype="fp32")
    st.sync_target_tensors(ckpt_tensors(ckpts.qwen3_other), "t1")
    fused = {n: p for n, p in engine.target.named_parameters() if "qkv_proj" in n or "gate_up_proj" in n}
    assert len(fused) == 4 and all(p.is_shared() for p in fused.values())


def test_a_parameter_leaves_a_lent_bucket_before_it_is_written_by_copy(ckpts):
    """After a lent sync, a sync that copies (another streamer, not lending) gives every parameter its own
    memory again: what the first streamer writes into its buffers later no longer reaches the engine."""
    engine, copied = server(ckpts), server(ckpts)
    st = WeightStreamer(engine, bucket_bytes=96 << 10, weight_dtype="fp32")
    st.sync_target_tensors(ckpt_tensors(ckpts.qwen3_other), "t1")
    named = ckpt_tensors(ckpts.qwen3)
    copying = WeightStreamer(engine, bucket_bytes=64 << 10, weight_dtype="fp32", lend_buckets=False)
    copying.sync_target_tensors(named, "t2")
    WeightStreamer(copied, bucket_bytes=64 << 10, weight_dtype="fp32").sync_target_tensors(named, "t2")
    assert not any(p.is_shared() for p in engine.target.parameters())
    for b in st._pools["target"]:
        b.fill_(7)  # the first streamer reuses its buffers
    want, got = held(copied), held(engine)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert greedy(engine) == greedy(copied)


def send_lent(engine: EngineServer, named: list[tuple[str, torch.Tensor]], panels) -> None:
    """``named`` to the target as one lent bucket (``panels``: those names in the kernel's panel layout), as
    version t1, inside an open update."""
    writer = BucketWriter(alloc_bucket_buffer(sum(t.nbytes + 16 for _, t in named), torch.device("cpu")))
    for name, tensor in named:
        if name in panels:
            out = writer.reserve(name, tuple(tensor.shape), tensor.dtype)
            torch.ops.megatron_spec.linear_pack_into(tensor, out.view(-1, tensor.shape[1], 16))
        else:
            writer.add(name, tensor)
    engine.update_weights_from_tensor(make_bucket_payloads(*writer.finish(), 1, lent=True, panels=panels),
                                      "target", "t1")


def fresh_panels(engine: EngineServer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each target linear layer's panels and a fresh pack of its weight's rows now."""
    rows = held(engine)
    return {name: (layer._small, Linear._pack_panels(rows[name] if name in rows else layer.weight.detach(),
                                                     None, None)[0])
            for layer, name in linear_layers(engine.target)}


def test_a_lent_sync_packs_each_layer_as_its_bucket_arrives_and_sums_what_it_packed(ckpts):
    """The engine packs a layer whose weight a lent bucket held whole while the sender fills the next one, and
    its checksum is summed in that pass, from the weights it packs (none summed twice, none left out)."""
    engine = server(ckpts)
    st = WeightStreamer(engine, bucket_bytes=64 << 10, weight_dtype="fp32")
    for version, path in (("t1", ckpts.qwen3_other), ("t2", ckpts.qwen3)):
        named = ckpt_tensors(path)
        rep = st.sync_target_tensors(named, version)
        assert rep.timings["engine_pack_s"] > 0 and rep.num_buckets > 2
        assert not engine._owed and all(torch.equal(*pair) for pair in fresh_panels(engine).values())
        assert Fingerprint.from_dict(rep.checksums["engine"]) == fingerprint_tensors(t for _, t in named)


@pytest.mark.parametrize("in_panels", [False, True])
def test_a_layer_packed_early_is_packed_again_when_its_weight_is_written_again(ckpts, in_panels):
    """A weight sent again later in the same update, by copy, after its layer was packed from a lent bucket
    (or held as the panels it came in: its other pieces are turned back into rows): the end of the update
    packs every layer from what it holds then, and counts the checksum afresh."""
    engine = server(ckpts)
    named = ckpt_tensors(ckpts.qwen3_other)
    again = next(n for n, _ in named if "q_proj" in n)
    panels = engine.lent_panel_names({n: tuple(t.shape) for n, t in named}) if in_panels else frozenset()
    engine.begin_weight_update("target")
    send_lent(engine, fused_order(named), panels)
    assert any(layer.holds_panels for layer, _ in linear_layers(engine.target)) is in_panels
    assert all(layer.is_packed for layer, _ in linear_layers(engine.target))  # packed as the bucket arrived
    final = dict(named)
    final[again] = final[again] + 1
    writer = BucketWriter(alloc_bucket_buffer(final[again].nbytes + 16, torch.device("cpu")))
    writer.add(again, final[again])
    engine.update_weights_from_tensor(make_bucket_payloads(*writer.finish(), 1), "target", "t1")
    out = engine.end_weight_update()
    assert all(torch.equal(*pair) for pair in fresh_panels(engine).values())
    assert Fingerprint.from_dict(out["checksums"]["target"]) == fingerprint_tensors(final.values())
    ref = server(ckpts)
    ref.target.load_weights(final.items())  # by copy: the rows the engine must hold
    want, got = held(ref), held(engine)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_lending_is_refused_where_the_engine_would_not_read_lent_buckets():
    with pytest.raises(ValueError, match="lend_buckets"):
        WeightStreamer(None, engine_dtype="float32", for_sglang=True, lend_buckets=True)
    assert not WeightStreamer(None, engine_dtype="float32").lend_buckets


def test_a_lent_sync_writes_the_linear_weights_as_the_kernels_panels(ckpts):
    """fp32 into an fp32 engine: the trainer writes each projection in the kernel's panel layout and the
    engine computes with those panels as they are (no pack of its own, none of its memory), at every row
    count; the same weights sent as rows (``lend_panels=False``) give the same panels and the same tokens."""
    engine, rows_engine = server(ckpts), server(ckpts)
    st = WeightStreamer(engine, bucket_bytes=64 << 10, weight_dtype="fp32")
    rows = WeightStreamer(rows_engine, bucket_bytes=64 << 10, weight_dtype="fp32", lend_panels=False)
    for version, path in (("t1", ckpts.qwen3_other), ("t2", ckpts.qwen3)):
        named = ckpt_tensors(path)
        rep = st.sync_target_tensors(named, version)  # verified: the engine's sums of its panels
        rows.sync_target_tensors(named, version)
        layers = [(layer, name) for layer, name in linear_layers(engine.target)
                  if not isinstance(layer, TiedLinear) and layer.out_features % 16 == 0]
        assert not engine.target.lm_head.holds_panels  # 84 rows: not whole panels, sent as rows
        assert len(layers) == 8 and all(layer.holds_panels
                                        and layer._small.data_ptr() == layer.weight.data_ptr()
                              and in_buffers(layer._small, st._pools["target"]) for layer, _ in layers)
        assert not any(layer.holds_panels for layer, _ in linear_layers(rows_engine.target))
        want, got = held(rows_engine), held(engine)
        assert all(torch.equal(want[n], got[n]) for n in want)
        assert all(torch.equal(*pair) for pair in fresh_panels(engine).values())
        assert Fingerprint.from_dict(rep.checksums["engine"]) == fingerprint_tensors(t for _, t in named)
        assert greedy(engine) == greedy(rows_engine)
    layer = layers[0][0]
    x = torch.randn(300, layer.in_features)  # a prefill's rows: the kernel, on the lent panels
    with torch.no_grad():
        want = torch.ops.megatron_spec.linear_small_f32(x, layer._small.clone(), layer.bias,
                                                        layer.out_features)
        assert torch.equal(layer(x), want)
        bias = 0 if layer.bias is None else layer.bias
        torch.testing.assert_close(want, x @ held(engine)[layers[0][1]].t() + bias)
    layer.unpack()
    with pytest.raises(RuntimeError, match="held as panels"):
        layer(x)
    with pytest.raises(ValueError, match="cannot be held as fp32 panels"):
        engine.target.lm_head.hold_panels(True)  # 84 rows: not whole panels


def test_pieces_of_one_parameter_in_both_layouts_are_copied_as_rows(ckpts):
    """A lent bucket whose q comes as panels and k, v as rows (never sent so; a receiver must not view them as
    one parameter): the engine copies all three, q's panels turned back into rows."""
    engine, ref = server(ckpts), server(ckpts)
    named = fused_order(ckpt_tensors(ckpts.qwen3_other))
    q = next(n for n, _ in named if "q_proj" in n)
    for eng, panels in ((engine, [q]), (ref, [])):
        eng.begin_weight_update("target")
        send_lent(eng, named, panels)
        eng.end_weight_update()  # its checksum is of the rows it holds
    qkv = q.replace("model.", "").replace("q_proj", "qkv_proj")
    assert not dict(engine.target.named_parameters())[qkv].is_shared()
    want, got = held(ref), held(engine)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_tied_table_lent_as_the_heads_panels_serves_lookups_and_the_head(tmp_path):
    """A tied embedding of whole panels (96 tokens) travels in the head's panel layout: the head computes with
    it as it lies, a lookup gathers each row from its panel, and the engine holds and generates what one fed
    rows does."""
    from megatron_spec.models.tiny import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "tied", family="llama", num_layers=1, hidden_size=64,
                              intermediate_size=128, num_attention_heads=4, num_kv_heads=2,
                              tie_word_embeddings=True, vocab_size=96, seed=5)
    cfg = EngineConfig(model_path=str(path), max_batch_size=2, context_length=32, num_threads=1,
                       warm_up=False)
    engine, rows_engine = EngineServer(cfg), EngineServer(cfg)
    named = ckpt_tensors(str(path))
    WeightStreamer(engine, bucket_bytes=32 << 10, weight_dtype="fp32").sync_target_tensors(named, "t1")
    WeightStreamer(rows_engine, bucket_bytes=32 << 10, weight_dtype="fp32",
                   lend_panels=False).sync_target_tensors(named, "t1")
    table, head = engine.target.embed_tokens, engine.target.tied_head
    assert table.holds_panels and head.holds_panels and head._small.data_ptr() == table.weight.data_ptr()
    assert not rows_engine.target.embed_tokens.holds_panels
    ids = torch.tensor([[0, 17, 95], [16, 15, 31]])
    with torch.no_grad():
        assert torch.equal(table(ids), rows_engine.target.embed_tokens(ids))
    want, got = held(rows_engine), held(engine)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert greedy(engine) == greedy(rows_engine)
    with pytest.raises(TypeError, match="owner"):
        head.hold_panels(True)
