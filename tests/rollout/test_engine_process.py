"""The engine process boundary: start-up errors, crashes, timeouts, weight updates."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from megatron_spec.interfaces import EngineCallError, EngineDiedError
from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.bucket import pack_bucket
from megatron_spec.sync.transport import make_bucket_payload, serialize


def _cfg(setup, **kw) -> EngineConfig:
    base = dict(model_path=setup.target, draft_kind="eagle3", draft_path=setup.eagle3, context_length=600,
                max_batch_size=4, num_threads=1)
    base.update(kw)
    return EngineConfig(**base)


def _greedy(n_new=8):
    return SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)


def _payload(tensors: list[tuple[str, torch.Tensor]]):
    flat, meta = pack_bucket(tensors)
    return flat, make_bucket_payload(flat, meta)


@pytest.fixture(scope="module")
def engine(setup):
    with NativeEngine(_cfg(setup)) as eng:
        yield eng


def test_generate_through_the_process_with_progress(engine):
    seen = []
    samples, stats = engine.generate(
        [GenerateRequest("a", [5, 6, 7], _greedy(), n=3)], on_progress=seen.append
    )
    assert [s.sample_index for s in samples] == [0, 1, 2]
    assert all(len(s.output_ids) == 8 for s in samples)
    assert stats.num_tokens == 24 and stats.mean_accept_length >= 1.0
    assert engine.health()["weight_version"] == "init"


def test_engine_exception_comes_back_named(engine):
    with pytest.raises(EngineCallError, match="request x: prompt of 700 tokens"):
        engine.generate([GenerateRequest("x", [5] * 700, _greedy())])
    assert engine.is_alive()  # a bad request does not kill the engine


def test_startup_failure_is_reported(setup, tmp_path):
    from megatron_spec.models.tiny import make_hf_checkpoint

    other = make_hf_checkpoint(tmp_path / "wide", family="qwen3", hidden_size=96, num_layers=4,
                               num_attention_heads=4, num_kv_heads=2)
    with pytest.raises(EngineCallError, match="hidden_size"):
        NativeEngine(EngineConfig(model_path=other, draft_kind="eagle3", draft_path=setup.eagle3,
                                  startup_timeout_s=120))


def test_killed_engine_raises_within_seconds(setup):
    eng = NativeEngine(_cfg(setup))
    try:
        reqs = [GenerateRequest(f"r{i}", [5, 6, 7], _greedy(500)) for i in range(16)]
        threading.Timer(1.5, lambda: os.kill(eng.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDiedError, match="died \\(signal 9\\)"):
            eng.generate(reqs)
        assert time.monotonic() - t0 < 15
        with pytest.raises(EngineDiedError):
            eng.health()
    finally:
        eng.shutdown()


def test_target_update_changes_outputs_and_leaves_draft_untouched(setup, engine):
    from tests.conftest import load_native

    before = engine.health()
    other = HFCheckpoint(setup.other_target)
    tensors = [(n, other.get(n)) for n in sorted(other.names())]
    flat, payload = _payload(tensors)
    engine.begin_weight_update()
    engine.update_weights_from_tensor(payload, selector="target", weight_version="v1")
    after = engine.end_weight_update()
    assert after["weight_version"] == "v1" and after["draft_weight_version"] == before["draft_weight_version"]
    assert after["checksums"]["draft"] == before["checksums"]["draft"]
    assert after["checksums"]["target"] != before["checksums"]["target"]
    # outputs now follow the other checkpoint
    from megatron_spec.rollout.native.engine import EngineCore

    ref, _ = EngineCore(load_native(setup.other_target), None, context_length=64).generate(
        [GenerateRequest("a", [5, 6, 7], _greedy())])
    got, _ = engine.generate([GenerateRequest("a", [5, 6, 7], _greedy())])
    assert got[0].output_ids == ref[0].output_ids and got[0].weight_version == "v1"
    # and back, so other tests see the original target
    orig = HFCheckpoint(setup.target)
    flat2, payload2 = _payload([(n, orig.get(n)) for n in sorted(orig.names())])
    engine.begin_weight_update()
    engine.update_weights_from_tensor(payload2, selector="target", weight_version="v2")
    engine.end_weight_update()


def test_draft_update_leaves_target_untouched(setup, engine):
    from megatron_spec.draft.modelopt_io import load_eagle3

    head = load_eagle3(setup.eagle3, setup.cfg)
    tensors = [(n, t * 1.01) for n, t in head.named_export_tensors() if n != "d2t"]
    before = engine.health()
    flat, payload = _payload(tensors)
    engine.begin_weight_update()
    engine.update_weights_from_tensor(payload, selector="draft", weight_version="d1")
    after = engine.end_weight_update()
    assert after["checksums"]["target"] == before["checksums"]["target"]
    assert after["checksums"]["draft"] != before["checksums"]["draft"]
    assert after["draft_weight_version"] == "d1"


def test_target_tensors_sent_to_the_draft_are_refused(setup, engine):
    ck = HFCheckpoint(setup.target)
    flat, payload = _payload([("model.norm.weight", ck.get("model.norm.weight"))])
    engine.begin_weight_update()
    with pytest.raises(EngineCallError, match="unexpected tensor model.norm.weight"):
        engine.update_weights_from_tensor(payload, selector="draft", weight_version="bad")
    with pytest.raises(EngineCallError, match="selector must be 'target' or 'draft'"):
        engine.update_weights_from_tensor(payload, selector="all", weight_version="bad")
    engine.end_weight_update()


def test_incomplete_update_fails_loudly(setup, engine):
    ck = HFCheckpoint(setup.target)
    flat, payload = _payload([("model.norm.weight", ck.get("model.norm.weight"))])
    engine.begin_weight_update()
    engine.update_weights_from_tensor(payload, selector="target", weight_version="partial")
    with pytest.raises(EngineCallError, match="target weight update incomplete"):
        engine.end_weight_update()
    with pytest.raises(EngineCallError, match="no weights loaded for \\['target'\\]"):
        engine.generate([GenerateRequest("a", [5, 6], _greedy())])
    full = [(n, ck.get(n)) for n in sorted(ck.names())]
    flat, payload = _payload(full)
    engine.begin_weight_update()
    engine.update_weights_from_tensor(payload, selector="target", weight_version="v3")
    engine.end_weight_update()


def test_release_resume_needs_both_groups_pushed_again(setup):
    from megatron_spec.draft.modelopt_io import load_eagle3

    with NativeEngine(_cfg(setup)) as eng:
        ref, _ = eng.generate([GenerateRequest("a", [5, 6, 7], _greedy())])
        eng.release_memory()
        eng.resume_memory()
        with pytest.raises(EngineCallError, match="no weights loaded for \\['target', 'draft'\\]"):
            eng.generate([GenerateRequest("a", [5, 6, 7], _greedy())])
        ck = HFCheckpoint(setup.target)
        _, tp = _payload([(n, ck.get(n)) for n in sorted(ck.names())])
        eng.begin_weight_update()
        eng.update_weights_from_tensor(tp, selector="target", weight_version="t")
        eng.end_weight_update()
        with pytest.raises(EngineCallError, match="no weights loaded for \\['draft'\\]"):
            eng.generate([GenerateRequest("a", [5, 6, 7], _greedy())])
        head = load_eagle3(setup.eagle3, setup.cfg)
        _, dp = _payload([(n, t) for n, t in head.named_export_tensors() if n != "d2t"])
        eng.begin_weight_update()
        eng.update_weights_from_tensor(dp, selector="draft", weight_version="d")
        eng.end_weight_update()
        got, _ = eng.generate([GenerateRequest("a", [5, 6, 7], _greedy())])
        assert got[0].output_ids == ref[0].output_ids


def test_payload_with_a_non_tensor_object_is_refused(engine):
    class Sneaky:
        def __reduce__(self):
            return (os.getcwd, ())

    engine.begin_weight_update()
    with pytest.raises(EngineCallError, match="payload refused: global posix.getcwd"):
        engine.update_weights_from_tensor(serialize({"flattened_tensor": torch.zeros(4, dtype=torch.uint8),
                                                     "metadata": [Sneaky()]}), selector="target")
    engine.end_weight_update()
