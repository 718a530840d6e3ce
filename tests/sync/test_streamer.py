"""WeightStreamer against the real native engine (separate process) and an in-process stand-in.

The native engine shows the contract end to end: the engine holds exactly what was sent
(fingerprints equal), updates never cross groups, a dropped/stale draft update is caught by
the checksum, FP8 blocks are dequantised on arrival. The stand-in (``DictEngine``) makes the
pipeline properties observable: overlap of packing and sending, peak memory, failures.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_spec.draft.modelopt_io import startup_draft_tensors
from megatron_spec.interfaces import WeightReceiver
from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.sync.bucket import BucketWriter, alloc_bucket_buffer
from megatron_spec.sync.fingerprint import Fingerprint, fingerprint_tensors
from megatron_spec.sync.fp8 import dequantize_named, quantize_named
from megatron_spec.sync.streamer import WeightStreamer, WeightSyncError
from megatron_spec.sync.transport import make_bucket_payloads, read_bucket_payload


def ckpt_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    ck = HFCheckpoint(path)
    return [(n, ck.get(n)) for n in ck.weight_names()]


def draft_tensors(path: str, cfg) -> list[tuple[str, torch.Tensor]]:
    return startup_draft_tensors("eagle3", path, cfg)


@pytest.fixture(scope="module")
def engine(ckpts):
    cfg = EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3, num_threads=1,
                       max_batch_size=2, context_length=64)
    with NativeEngine(cfg) as eng:
        yield eng


def test_target_sync_lands_exactly_and_leaves_the_draft_alone(engine, ckpts):
    before = engine.health()
    st = WeightStreamer(engine, bucket_bytes=16 << 10, weight_dtype="fp32")
    named = ckpt_tensors(ckpts.qwen3_other)
    rep = st.sync_target_tensors(named, "t1")
    after = engine.health()
    assert after["weight_version"] == "t1" and after["draft_weight_version"] == before["draft_weight_version"]
    assert after["checksums"]["draft"] == before["checksums"]["draft"]
    assert Fingerprint.from_dict(after["checksums"]["target"]) == fingerprint_tensors(t for _, t in named)
    assert rep.checksums["sent"] == rep.checksums["engine"] == after["checksums"]["target"]
    assert rep.num_buckets > 3 and rep.bytes == sum(t.numel() * 4 for _, t in named) + rep.bytes % 4
    assert rep.num_tensors == len(named)


def test_draft_sync_lands_exactly_and_leaves_the_target_alone(engine, ckpts):
    before = engine.health()
    st = WeightStreamer(engine, bucket_bytes=16 << 10, weight_dtype="fp32")
    named = draft_tensors(ckpts.eagle3_other, ckpts.cfg)
    st.sync_draft(named, "d1")
    after = engine.health()
    assert after["draft_weight_version"] == "d1" and after["weight_version"] == before["weight_version"]
    assert after["checksums"]["target"] == before["checksums"]["target"]
    assert Fingerprint.from_dict(after["checksums"]["draft"]) == fingerprint_tensors(t for _, t in named)
    with pytest.raises(ValueError, match="d2t must not be re-sent"):
        st.sync_draft(named + [("d2t", torch.zeros(3, dtype=torch.long))], "d1")


class FailingBucket:
    """An engine proxy whose ``fail_at``-th bucket fails (the engine ran out of memory part-way)."""

    def __init__(self, engine, fail_at: int):
        self._engine, self.config, self.fail_at, self.n = engine, engine.config, fail_at, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def update_weights_from_tensor(self, payloads, selector, weight_version=None, flush_cache=True):
        self.n += 1
        if self.n == self.fail_at:
            raise RuntimeError("injected: engine out of memory")
        return self._engine.update_weights_from_tensor(payloads, selector, weight_version, flush_cache)


def test_failed_sync_is_aborted_and_the_engine_claims_no_version(engine, ckpts):
    """The streamer closes a failed session with ``abort_weight_update``: the native engine leaves
    the touched group without a version (never the partial weights as ``t-partial``), the other
    group as it was, and takes the next complete sync."""
    named = ckpt_tensors(ckpts.qwen3_other)
    before = engine.health()
    with pytest.raises(RuntimeError, match="injected"):
        WeightStreamer(
            FailingBucket(engine, 3), bucket_bytes=16 << 10, weight_dtype="fp32"
        ).sync_target_tensors(named, "t-partial")
    mid = engine.health()
    assert mid["weight_version"] is None and "target" not in mid["checksums"]
    assert mid["draft_weight_version"] == before["draft_weight_version"]
    assert mid["checksums"]["draft"] == before["checksums"]["draft"]
    engine.abort_weight_update()  # no session open: nothing to do
    WeightStreamer(engine, bucket_bytes=16 << 10, weight_dtype="fp32").sync_target_tensors(named, "t-whole")
    assert engine.health()["weight_version"] == "t-whole"


class StaleDraft:
    """An engine proxy that acknowledges draft updates but loads the previous draft instead:
    version bookkeeping says "updated", the weights say otherwise (the peers' silent failure)."""

    def __init__(self, engine, stale: list[tuple[str, torch.Tensor]]):
        self._engine, self.config = engine, engine.config
        w = BucketWriter(alloc_bucket_buffer(sum(t.numel() * 4 + 16 for _, t in stale)))
        for n, t in stale:
            w.add(n, t)
        self._stale = w.finish()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def update_weights_from_tensor(self, payloads, selector, weight_version=None, flush_cache=True):
        if selector == "draft":
            payloads = make_bucket_payloads(*self._stale, 1)
        return self._engine.update_weights_from_tensor(payloads, selector, weight_version, flush_cache)


def test_dropped_draft_update_is_detected_by_the_checksum(engine, ckpts):
    old = draft_tensors(ckpts.eagle3, ckpts.cfg)
    new = draft_tensors(ckpts.eagle3_other, ckpts.cfg)
    WeightStreamer(engine, weight_dtype="fp32").sync_draft(old, "d-old")
    st = WeightStreamer(StaleDraft(engine, old), weight_dtype="fp32")
    with pytest.raises(
        WeightSyncError, match="draft weight sync failed: engine holds different values"
    ) as err:
        st.sync_draft(new, "d-new")
    assert err.value.group == "draft"
    assert engine.health()["draft_weight_version"] == "d-new"  # the version alone would not have told


def test_bf16_streaming_is_verified_in_the_engine_dtype(engine, ckpts):
    named = ckpt_tensors(ckpts.qwen3)
    rep = WeightStreamer(engine, bucket_bytes=16 << 10, weight_dtype="bf16").sync_target_tensors(
        named, "t-bf16"
    )
    held = Fingerprint.from_dict(engine.health()["checksums"]["target"])
    assert held == fingerprint_tensors((t.to(torch.bfloat16) for _, t in named), torch.float32)
    assert rep.bytes < sum(t.numel() * 4 for _, t in named) * 0.51


def test_native_engine_dequantises_fp8_blocks(ckpts):
    cfg = EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3, num_threads=1,
                       max_batch_size=2, context_length=64, load_weights=False, fp8_weights=True)
    named = ckpt_tensors(ckpts.qwen3_other)
    with NativeEngine(cfg) as eng:
        st = WeightStreamer(eng, bucket_bytes=16 << 10, weight_dtype="fp8")
        rep = st.sync_target_tensors(named, "t-fp8")
        st.sync_draft(draft_tensors(ckpts.eagle3_other, ckpts.cfg), "d-fp8")  # the draft stays unquantised
        held = Fingerprint.from_dict(eng.health()["checksums"]["target"])
    expected = fingerprint_tensors(t for _, t in dequantize_named(quantize_named(named), torch.float32))
    assert held == expected and held != fingerprint_tensors(t for _, t in named)
    assert rep.bytes < sum(t.numel() * 4 for _, t in named) * 0.5


# ------------------------------------------------------------------------- in-process stand-in
class DictEngine(WeightReceiver):
    """Reads payloads like an engine (allowlist, shared memory), keeps only fingerprints."""

    def __init__(self, dtype="float32", delay_s=0.0, fail_at=None, cross=False, fp8=False):
        self.config = type("C", (), {"dtype": dtype})()
        self.delay_s, self.fail_at, self.cross, self.fp8 = delay_s, fail_at, cross, fp8
        self.fp = {"target": Fingerprint(), "draft": fingerprint_tensors([torch.ones(4)])}
        self.versions = {"target": None, "draft": "init"}
        self.calls: list[tuple[str, float, float]] = []
        self.session = None
        self.n = 0

    def begin_weight_update(self, selector="all"):
        self.session = {"selector": selector, "fp": Fingerprint(), "version": None}

    def update_weights_from_tensor(self, payloads, selector, weight_version=None, flush_cache=True):
        t0 = time.perf_counter()
        self.n += 1
        if self.fail_at == self.n:
            raise RuntimeError("engine out of memory")
        named = read_bucket_payload(payloads[0])
        if self.fp8:
            named = dequantize_named(named, torch.float32)
        for _, t in named:
            self.session["fp"].add(t, torch.float32)
        time.sleep(self.delay_s)
        self.session["version"] = weight_version
        self.calls.append((selector, t0, time.perf_counter()))
        return {}

    def end_weight_update(self):
        s, self.session = self.session, None
        g = s["selector"]
        if s["version"] is not None:
            self.fp[g], self.versions[g] = s["fp"], s["version"]
        if self.cross and g == "target":  # a buggy engine: the target update also touched the draft
            self.fp["draft"] = fingerprint_tensors([torch.zeros(4)])
        return self.health()

    def health(self):
        return {"weight_version": self.versions["target"], "draft_weight_version": self.versions["draft"],
                "checksums": {g: f.to_dict() for g, f in self.fp.items()}}


def _slow_items(named, per_item_s):
    for n, t in named:
        time.sleep(per_item_s)  # stands in for the TP gather of one parameter
        yield n, t


def test_packing_overlaps_sending():
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 64)) for i in range(6)]
    eng = DictEngine(delay_s=0.15)
    st = WeightStreamer(eng, bucket_bytes=64 * 64 * 4 + 64, weight_dtype="fp32")  # one tensor per bucket
    st.sync_target_tensors([("warm.weight", torch.ones(1))], "w")
    t0 = time.perf_counter()
    rep = st.sync_target_tensors(_slow_items(named, 0.15), "v", shapes={n: t.shape for n, t in named})
    elapsed = time.perf_counter() - t0
    assert rep.num_buckets == 6
    # serial: 6 x (0.15 pack + 0.15 send) = 1.8 s; double-buffered: ~0.15 + 6 x 0.15 = 1.05 s
    assert elapsed < 1.5, elapsed
    starts = [c[1] for c in eng.calls[1:]]
    ends = [c[2] for c in eng.calls[1:]]
    assert all(s < e for s, e in zip(starts[1:], ends[1:]))


def test_peak_extra_memory_is_two_buckets():
    g = torch.Generator().manual_seed(0)
    named = [
        (f"model.layers.{i}.mlp.down_proj.weight", torch.randn(512, 512, generator=g)) for i in range(24)
    ]
    st = WeightStreamer(DictEngine(), bucket_bytes=4 << 20, weight_dtype="fp32", measure_memory=True)
    st.sync_target_tensors(named[:2], "warm")  # first-use costs (thread, imports) are not the streamer's
    rep = st.sync_target_tensors(named, "v")
    assert rep.num_buckets >= 6 and rep.peak_extra_bytes is not None
    assert rep.peak_extra_bytes <= 2.2 * rep.bucket_capacity, (rep.peak_extra_bytes, rep.bucket_capacity)


def test_buckets_close_at_bucket_bytes_and_a_larger_tensor_travels_alone():
    """Buffers grow to the largest tensor; buckets still close at ``bucket_bytes`` (on CPU a
    bucket that fits the cache is read back by the engine from there)."""
    named = [("model.embed_tokens.weight", torch.randn(256, 64))]  # 64 KiB
    named += [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(16, 64)) for i in range(8)]  # 4 KiB each
    eng = DictEngine()
    rep = WeightStreamer(eng, bucket_bytes=9 << 10, weight_dtype="fp32").sync_target_tensors(named, "v")
    assert rep.bucket_capacity >= 64 << 10
    assert rep.num_buckets == 5  # the embedding alone, then two layer tensors per 9 KiB bucket
    assert eng.fp["target"] == fingerprint_tensors(t for _, t in named)


def test_stream_order_puts_the_large_outer_tensors_in_the_middle():
    from megatron_spec.models.gpt import _stream_order

    params = [("embedding.word_embeddings.weight", 0)] + [(f"decoder.layers.{i}.w", i) for i in range(4)] \
        + [("decoder.final_layernorm.weight", 0), ("output_layer.weight", 0)]
    names = [n for n, _ in _stream_order(params)]
    assert sorted(names) == sorted(n for n, _ in params)
    assert names[0] == "decoder.layers.0.w" and names[-1] == "decoder.layers.3.w"
    assert names[2:5] == [
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]


def test_engine_failure_mid_stream_is_named_and_does_not_hang():
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 64)) for i in range(6)]
    eng = DictEngine(fail_at=2)
    st = WeightStreamer(eng, bucket_bytes=64 * 64 * 4 + 64, weight_dtype="fp32")
    with pytest.raises(
        WeightSyncError, match="target weight sync failed: engine update failed: engine out of memory"
    ):
        st.sync_target_tensors(named, "v")
    assert eng.session is None  # the session was closed (the native engine then refuses the partial update)
    assert threading.active_count() < 10


def test_crossed_update_is_detected():
    eng = DictEngine(cross=True)
    st = WeightStreamer(eng, weight_dtype="fp32")
    st.sync_draft([("layers.0.mlp.up_proj.weight", torch.randn(4, 4))], "d1")
    with pytest.raises(
        WeightSyncError, match="draft weight sync failed: changed while the other group was updated"
    ):
        st.sync_target_tensors([("model.norm.weight", torch.ones(4))], "t1")


def test_wrong_version_is_detected():
    class Lagging(DictEngine):
        def health(self):
            h = super().health()
            h["weight_version"] = "t0"
            return h

    with pytest.raises(WeightSyncError, match="engine reports version 't0', sent 't1'"):
        WeightStreamer(Lagging(), weight_dtype="fp32").sync_target_tensors(
            [("model.norm.weight", torch.ones(4))], "t1"
        )


def test_fp8_fingerprint_of_tall_weights_matches_the_receivers_dequantisation():
    g = torch.Generator().manual_seed(5)
    named = [("model.layers.0.mlp.down_proj.weight", torch.randn(2500, 300, generator=g) * 0.02),
             ("model.layers.0.mlp.up_proj.weight", torch.randn(1100, 130, generator=g)),
             ("model.norm.weight", torch.randn(300, generator=g))]
    eng = DictEngine(fp8=True)
    rep = WeightStreamer(eng, bucket_bytes=1 << 20, weight_dtype="fp8").sync_target_tensors(named, "v")
    expected = fingerprint_tensors(
        (t for _, t in dequantize_named(quantize_named(named), torch.float32)), torch.float32
    )
    assert Fingerprint.from_dict(rep.checksums["sent"]) == expected


@pytest.mark.parametrize("keep", [True, False])
def test_engine_reports_and_lets_go_of_the_mapped_buckets(ckpts, keep):
    """Issue 27, defect 6: the engine maps the sender's bucket buffers. On a CPU it keeps the last two
    mapped between syncs (the sender reuses them); on a GPU it must let go at the end of each update,
    or torch keeps the sent CUDA blocks alive in the trainer. ``health()`` reports what it still maps;
    here the GPU policy is switched on for a CPU engine (the GPU run: tests/sync/test_streamer_cuda.py)."""
    from megatron_spec.rollout.native.server import EngineServer

    server = EngineServer(
        EngineConfig(model_path=ckpts.qwen3, max_batch_size=2, context_length=32, num_threads=1)
    )
    assert server._keep_mapped  # the CPU default
    server._keep_mapped = keep
    WeightStreamer(server, bucket_bytes=16 << 10, weight_dtype="fp32").sync_target_tensors(
        ckpt_tensors(ckpts.qwen3_other), "t1")
    mapped = server.health()["mapped_bucket_bytes"]
    assert (mapped >= 2 * (16 << 10)) if keep else mapped == 0
    server.release_memory()
    assert server.health()["mapped_bucket_bytes"] == 0


def test_sync_reports_its_pieces_and_checksums_only_what_changed(ckpts, monkeypatch):
    """Issue 55: every sync says where its seconds went, the engine's side included; a group's checksum
    is taken while its tensors are copied in (no second pass over them), so a draft sync does not read the
    target again and a target sync reads nothing twice, and the other group's check still compares what the
    engine reports. A tensor written twice in one update leaves the sums of its first values behind: then the
    checksum is counted afresh from the parameters."""
    from megatron_spec.rollout.native import server as server_mod
    from megatron_spec.sync.streamer import SYNC_PIECES

    server = server_mod.EngineServer(
        EngineConfig(
            model_path=ckpts.qwen3,
            draft_kind="eagle3",
            draft_path=ckpts.eagle3,
            max_batch_size=2,
            context_length=32,
            num_threads=1,
            warm_up=False,
        )
    )
    counted: list[int] = []
    real = server_mod.tensor_group_checksum
    monkeypatch.setattr(server_mod, "tensor_group_checksum", lambda ts: counted.append(1) or real(ts))
    st = WeightStreamer(server, bucket_bytes=16 << 10, weight_dtype="fp32")
    rep = st.sync_target_tensors(ckpt_tensors(ckpts.qwen3_other), "t1")
    assert set(rep.timings) == set(SYNC_PIECES) | set(server_mod.SYNC_TIMINGS)
    assert all(v >= 0 for v in rep.timings.values()) and rep.timings["engine_load_s"] > 0
    assert rep.timings["end_s"] >= rep.timings["engine_repack_s"] + rep.timings["engine_checksum_s"]
    calls = len(counted)
    st.sync_draft(draft_tensors(ckpts.eagle3_other, ckpts.cfg), "d1")
    assert len(counted) == calls  # the draft's taken while loading; the target's was kept
    health = server.health()
    held = Fingerprint.from_dict(health["checksums"]["target"])
    assert held == fingerprint_tensors(t for _, t in ckpt_tensors(ckpts.qwen3_other))
    assert held == Fingerprint.from_dict(real(server.target.parameters()))
    assert health["checksums"]["draft"] == real(server._draft_module().parameters())
    st.sync_target_tensors(ckpt_tensors(ckpts.qwen3), "t2")  # written again: summed again while loading
    assert len(counted) == calls
    assert Fingerprint.from_dict(server.health()["checksums"]["target"]) == fingerprint_tensors(
        t for _, t in ckpt_tensors(ckpts.qwen3))
    # one tensor sent twice in an update (its last values are held): the checksum is counted afresh
    named = ckpt_tensors(ckpts.qwen3_other)
    twice = named + [(named[0][0], named[0][1] + 1)]
    server.begin_weight_update("target")
    for name, tensor in twice:
        buf = alloc_bucket_buffer(tensor.numel() * tensor.element_size() + 64, torch.device("cpu"))
        w = BucketWriter(buf)
        w.add(name, tensor)
        server.update_weights_from_tensor(make_bucket_payloads(*w.finish(), 1), "target", "t3")
    out = server.end_weight_update()
    assert len(counted) == calls + 1
    assert out["checksums"]["target"] == real(server.target.parameters())
    assert Fingerprint.from_dict(out["checksums"]["target"]) == fingerprint_tensors(
        [named[0][1] + 1] + [t for _, t in named[1:]])
