"""The vLLM backend against vLLM itself (its CPU build, ``.venv-vllm``): weights pushed through vLLM's own
update path reach its kernels, greedy output equals the native engine's with the same weights, greedy
speculation equals plain decoding, a killed engine is reported at once, and what it refuses it refuses at
start. The statistical checks are in ``test_vllm_distribution.py``.

Needs vLLM's environment (``scripts/setup_env.sh --with-vllm``): skipped without it, unless
``MEGATRON_SPEC_REQUIRE_VLLM=1`` (``scripts/test.sh`` sets it: it makes the environment).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.vllm]


def vllm_or_skip() -> str:
    from megatron_spec.rollout.vllm_backend import vllm_python

    try:
        return vllm_python()
    except FileNotFoundError as exc:
        if os.environ.get("MEGATRON_SPEC_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2() -> str:
    vllm_or_skip()
    from megatron_spec.models.fetch import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def chat(smollm2) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for c in ("What is 7 times 8?", "Count from 1 to 10.", "Name three colours.", "Say hello in French.")
    ]


def greedy(prompts, n_tokens: int = 16, ignore_eos: bool = False) -> list[GenerateRequest]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=ignore_eos)
    return [GenerateRequest(str(i), p, sp) for i, p in enumerate(prompts)]


def checkpoint_tensors(path, scale: dict[str, float] | None = None):
    from megatron_spec.models import HFCheckpoint

    ck = HFCheckpoint(path)
    return [(n, ck.get(n) * (scale or {}).get(n, 1.0)) for n in ck.weight_names()]


@pytest.fixture(scope="module")
def pushed(smollm2):
    """A vLLM engine started with dummy weights, then sent SmolLM2's through the streamer (fp32)."""
    from megatron_spec.rollout.vllm_backend import VllmEngine
    from megatron_spec.sync.streamer import WeightStreamer

    eng = VllmEngine(
        EngineConfig(
            model_path=smollm2, max_batch_size=8, context_length=256, load_weights=False, dtype="float32"
        )
    )
    streamer = WeightStreamer(eng, weight_dtype="fp32", bucket_bytes=64 << 20)  # 8 buckets: layers span two
    streamer.sync_target_tensors(checkpoint_tensors(smollm2), "v1")
    yield eng, streamer
    eng.shutdown()


def test_pushed_weights_give_the_native_engines_greedy_output(pushed, smollm2, chat):
    from megatron_spec.rollout.native.client import NativeEngine

    eng, _ = pushed
    assert eng.info["backend"] == "vllm" and eng.info["vllm_version"] == "0.32.0"
    out, stats = eng.generate(greedy(chat), seed=0)
    with NativeEngine(EngineConfig(model_path=smollm2, max_batch_size=8, context_length=256,
                                   dtype="float32")) as native:
        ref, _ = native.generate(greedy(chat), seed=0)
    assert [s.output_ids for s in out] == [s.output_ids for s in ref]
    for a, b in zip(out, ref):  # the greedy token's log-prob under the unscaled policy, as ours
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert a.weight_version == "v1" and a.num_verify_steps == len(a.output_ids)
    assert stats.num_tokens == sum(len(s.output_ids) for s in out)


def test_changed_weights_reach_the_kernels_and_come_back_exactly(pushed, smollm2, chat):
    """The CPU build computes with pre-packed copies of the weights: an update that refreshed only the
    parameters would change nothing here."""
    eng, streamer = pushed
    before, _ = eng.generate(greedy(chat), seed=0)
    layer = {n: 0.0 for n, _ in checkpoint_tensors(smollm2) if ".layers.5.mlp." in n}
    streamer.sync_target_tensors(checkpoint_tensors(smollm2, layer), "v2")
    changed, _ = eng.generate(greedy(chat), seed=0)
    assert [s.output_ids for s in changed] != [s.output_ids for s in before]
    assert {s.weight_version for s in changed} == {"v2"}
    streamer.sync_target_tensors(checkpoint_tensors(smollm2), "v3")
    back, _ = eng.generate(greedy(chat), seed=0)
    assert [s.output_ids for s in back] == [s.output_ids for s in before]
    assert [s.logprobs for s in back] == [s.logprobs for s in before]  # the same bits, the same kernels


def test_an_incomplete_update_is_refused_and_blocks_generation(pushed, smollm2, chat):
    from megatron_spec.interfaces import EngineCallError
    from megatron_spec.sync.streamer import WeightSyncError

    eng, streamer = pushed
    partial = [(n, t) for n, t in checkpoint_tensors(smollm2) if ".layers.29." not in n]
    with pytest.raises(WeightSyncError, match="incomplete"):
        streamer.sync_target_tensors(partial, "v4")
    assert eng.health()["weight_version"] is None
    with pytest.raises(EngineCallError, match="generate refused"):
        eng.generate(greedy(chat[:1]))
    streamer.sync_target_tensors(checkpoint_tensors(smollm2), "v5")  # whole again: accepted and verified
    assert eng.health()["weight_version"] == "v5"


def test_seeded_sampling_repeats_and_samples_differ(pushed, chat):
    eng, _ = pushed
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    a, _ = eng.generate([GenerateRequest("p", chat[0], sp, n=4)], seed=11)
    b, _ = eng.generate([GenerateRequest("p", chat[0], sp, n=4)], seed=11)
    c, _ = eng.generate([GenerateRequest("p", chat[0], sp, n=4)], seed=12)
    assert [s.output_ids for s in a] == [s.output_ids for s in b] != [s.output_ids for s in c]
    assert len({tuple(s.output_ids) for s in a}) > 1 and [s.sample_index for s in a] == [0, 1, 2, 3]
    g, _ = eng.generate(
        [GenerateRequest("g", chat[0], SamplingParams(temperature=0.0, max_new_tokens=8), n=3)]
    )
    # vLLM: n=1 only
    assert [s.sample_index for s in g] == [0, 1, 2] and len({tuple(s.output_ids) for s in g}) == 1


def test_release_on_the_cpu_frees_nothing_and_refuses_generation(pushed, chat):
    from megatron_spec.interfaces import EngineCallError

    eng, _ = pushed
    rss = eng.health()["rss_bytes"]
    eng.release_memory()
    h = eng.health()
    # vLLM ignores sleep
    assert h["released"] == ["kv_cache", "weights"] and abs(h["rss_bytes"] - rss) < 0.05 * rss
    with pytest.raises(EngineCallError, match="released"):
        eng.generate(greedy(chat[:1]))
    eng.resume_memory()
    assert eng.health()["released"] == [] and eng.generate(greedy(chat[:1], 4))[0]


def test_greedy_ngram_speculation_equals_plain_decoding(smollm2, chat):
    from megatron_spec.rollout.vllm_backend import VllmEngine

    prompts = chat[:2]
    kw = dict(model_path=smollm2, max_batch_size=4, context_length=256, dtype="float32")
    with VllmEngine(EngineConfig(**kw)) as plain:
        ref, _ = plain.generate(greedy(prompts, 32, ignore_eos=True), seed=0)
    with VllmEngine(EngineConfig(**kw, draft_kind="ngram", num_draft_tokens=3)) as spec:
        out, stats = spec.generate(greedy(prompts, 32, ignore_eos=True), seed=0)
        with pytest.raises(Exception, match="vllm#55005"):  # sampled speculation: refused per call too
            spec.generate(
                [GenerateRequest("s", prompts[0], SamplingParams(temperature=1.0, max_new_tokens=4))]
            )
    assert [s.output_ids for s in out] == [s.output_ids for s in ref]
    assert stats.spec_steps > 0 and stats.spec_accept_length > 1.0  # counting prompt: n-gram drafts accepted
    for s in out:  # vLLM's own per-request counters: every token is a verify step's or an accepted draft
        assert s.num_verify_steps == len(s.output_ids) - sum(s.accepted_per_step)


@pytest.fixture(scope="module")
def smollm2_eagle3(smollm2, chat, tmp_path_factory) -> str:
    """A ModelOpt EAGLE-3 export for SmolLM2 trained a few steps on its own greedy answers (a draft that
    proposes something; exactness does not need a good one), reduced draft vocabulary (64: a ``d2t`` map)."""
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.rollout.native.client import NativeEngine

    with NativeEngine(EngineConfig(model_path=smollm2, max_batch_size=4, context_length=256,
                                   dtype="float32")) as native:
        answers, _ = native.generate(greedy(chat, 32, ignore_eos=True), seed=0)
    out = str(tmp_path_factory.mktemp("eagle3") / "smollm2_eagle3")
    train_and_export_eagle3(
        smollm2,
        out,
        [p + s.output_ids for p, s in zip(chat, answers)],
        steps=4,
        batch_size=4,
        max_len=96,
        draft_vocab_size=64,
        progress=False,
    )
    return out


def test_eagle3_draft_weights_are_streamed_and_speculation_stays_exact(smollm2, smollm2_eagle3, chat):
    """Both groups pushed into a dummy-initialised engine, verified by the worker's fingerprints; greedy
    speculative output equals vLLM's plain decoding."""
    from megatron_spec.draft.modelopt_io import startup_draft_tensors
    from megatron_spec.models.hf_config import DecoderConfig
    from megatron_spec.rollout.vllm_backend import VllmEngine
    from megatron_spec.sync.streamer import WeightStreamer

    prompts = chat[:2]
    kw = dict(model_path=smollm2, max_batch_size=4, context_length=256, dtype="float32")
    with VllmEngine(EngineConfig(**kw)) as plain:
        ref, _ = plain.generate(greedy(prompts, 24, ignore_eos=True), seed=0)
    with VllmEngine(EngineConfig(**kw, draft_kind="eagle3", draft_path=smollm2_eagle3, num_draft_tokens=3,
                                 load_weights=False)) as eng:
        streamer = WeightStreamer(eng, weight_dtype="fp32", bucket_bytes=64 << 20)
        streamer.sync_target_tensors(checkpoint_tensors(smollm2), "1")
        draft = startup_draft_tensors("eagle3", smollm2_eagle3, DecoderConfig.from_pretrained(smollm2))
        rep = streamer.sync_draft(draft, "d1")
        assert rep.checksums["engine"] == rep.checksums["sent"]  # the worker loaded exactly what was sent
        h = eng.health()
        assert (h["weight_version"], h["draft_weight_version"]) == ("1", "d1")
        out, stats = eng.generate(greedy(prompts, 24, ignore_eos=True), seed=0)
    assert [s.output_ids for s in out] == [s.output_ids for s in ref]
    assert stats.spec_steps > 0 and {s.draft_weight_version for s in out} == {"d1"}


def test_a_killed_engine_is_reported_at_once(smollm2, chat):
    from megatron_spec.interfaces import EngineDiedError
    from megatron_spec.rollout.vllm_backend import VllmEngine

    eng = VllmEngine(EngineConfig(model_path=smollm2, max_batch_size=4, context_length=512, dtype="float32"))
    try:
        threading.Timer(2.0, os.kill, (eng.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDiedError, match=r"vLLM engine process \d+ died \(signal 9\)"):
            eng.generate(greedy(chat, 400, ignore_eos=True))
        assert time.monotonic() - t0 < 10
        assert not eng.is_alive()
    finally:
        eng.shutdown()


def test_a_missing_environment_is_one_clear_error(smollm2, tmp_path):
    from megatron_spec.rollout.vllm_backend import VllmEngine

    with pytest.raises(FileNotFoundError, match="scripts/setup_env.sh --with-vllm"):
        VllmEngine(EngineConfig(model_path=smollm2), python=str(tmp_path / "no-python"))
