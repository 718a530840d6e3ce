"""The SGLang backend on CPU, against SGLang 0.5.23's own classes, up to ``sglang.Engine``.

* Our payloads, read by SGLang's ``MultiprocessingSerializer`` into its ``FlattenedTensorBucket``,
  reach every parameter of SGLang's Qwen3 / Qwen2 / Llama and ``LlamaForCausalLMEagle3`` through
  those models' own ``load_weights`` (compiled from the installed source; the parameter names
  are checked against the modules' ``__init__``), with the exact values sent. A name the loader
  would skip fails here.
* The ``ServerArgs`` we build pass SGLang's own resolution (``resolve_once``, what ``sglang.Engine``
  runs at launch) and the lossless guard; the draft's model config is SGLang's (FP8 for the target
  only); the request objects are SGLang's own.
* ``SGLangEngine`` + ``WeightStreamer`` end to end against a stand-in engine that runs SGLang's
  resolution, load-format choice, scheduler memory manager and weight checksums
  (``sglang_support.FakeSGLangEngine``): selectors, versions, digest verification, a dropped draft
  update, release/resume with the draft re-pushed, the draft and its ``d2t`` read at launch.
The real engine needs a GPU: ``test_real_sglang_engine`` (marked gpu).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout import sglang_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.bucket import BucketWriter, alloc_bucket_buffer
from megatron_spec.sync.fp8 import quantize_named
from megatron_spec.sync.streamer import WeightStreamer, WeightSyncError
from megatron_spec.sync.transport import make_bucket_payloads
from tests.sync import sglang_support as ss

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# ------------------------------------------------------------------ SGLang's parameter names
def _fp8_registers_weight_scale_inv() -> bool:
    _, tree = ss.source("srt/layers/quantization/fp8.py")
    return any(
        isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "register_parameter"
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value == "weight_scale_inv"
        for n in ast.walk(tree)
    )


def _has(relpath, cls, *attrs):
    got = ss.init_attributes(relpath, cls)
    missing = set(attrs) - got
    assert not missing, f"SGLang {relpath}:{cls} no longer assigns {sorted(missing)}"


def target_params(cfg, fp8: bool) -> set[str]:
    """Parameter names of SGLang's model for ``cfg`` (module attributes checked in the source)."""
    if cfg.family == "llama":
        _has("srt/models/llama.py", "LlamaForCausalLM", "model", "lm_head")
        _has("srt/models/llama.py", "LlamaModel", "embed_tokens", "layers", "norm")
        _has(
            "srt/models/llama.py",
            "LlamaDecoderLayer",
            "self_attn",
            "mlp",
            "input_layernorm",
            "post_attention_layernorm",
        )
        _has("srt/models/llama.py", "LlamaAttention", "qkv_proj", "o_proj")
        _has("srt/models/llama.py", "LlamaMLP", "gate_up_proj", "down_proj")
    else:
        mod = f"srt/models/{cfg.family}.py"
        prefix = "Qwen3" if cfg.family == "qwen3" else "Qwen2"
        _has(mod, f"{prefix}ForCausalLM", "model", "lm_head")
        _has("srt/models/qwen2.py", "Qwen2Model", "embed_tokens", "layers", "norm")
        _has(mod, f"{prefix}DecoderLayer", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        _has(mod, f"{prefix}Attention", "qkv_proj", "o_proj", *(("q_norm", "k_norm") if cfg.qk_norm else ()))
        _has("srt/models/qwen2.py", "Qwen2MLP", "gate_up_proj", "down_proj")
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")  # tied: lm_head *is* embed_tokens, named once
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        names |= {f"{p}.{lin}.weight" for lin in LINEARS}
        if cfg.qkv_bias:
            names.add(f"{p}.self_attn.qkv_proj.bias")
        if cfg.qk_norm:
            names |= {f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"}
        if fp8:
            assert _fp8_registers_weight_scale_inv()
            names |= {f"{p}.{lin}.weight_scale_inv" for lin in LINEARS}
    return names


def draft_params() -> set[str]:
    _has("srt/models/llama_eagle3.py", "LlamaForCausalLMEagle3", "model", "lm_head")
    _has("srt/models/llama_eagle3.py", "LlamaModel", "embed_tokens", "fc", "layers", "norm")
    _has("srt/models/llama_eagle3.py", "LlamaDecoderLayer", "hidden_norm", "mlp", "self_attn.qkv_proj")
    _has(
        "srt/models/llama.py", "LlamaDecoderLayer", "input_layernorm", "post_attention_layernorm", "self_attn"
    )
    p = "model.layers.0"
    return {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
            f"{p}.hidden_norm.weight", f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
            *(f"{p}.{lin}.weight" for lin in LINEARS)}


def shards(name: str) -> set:
    return {"q", "k", "v"} if "qkv_proj" in name else {0, 1} if "gate_up_proj" in name else {None}


LOADERS = {
    "qwen3": ("srt/models/qwen3.py", "Qwen3ForCausalLM", "load_weights"),
    "qwen2": ("srt/models/qwen2.py", "Qwen2ForCausalLM", "_legacy_load_weights"),  # the default (V2 env off)
    "llama": ("srt/models/llama.py", "LlamaForCausalLM", "_legacy_load_weights"),  # the default (V2 env off)
}
DRAFT_LOADER = ("srt/models/llama_eagle3.py", "LlamaForCausalLMEagle3", "load_weights")


def _through_sglang(named, model, fn) -> None:
    """Our bucket -> SGLang's deserializer and FlattenedTensorBucket -> SGLang's loader."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    w = BucketWriter(alloc_bucket_buffer(sum(t.numel() * t.element_size() + 16 for _, t in named)))
    for n, t in named:
        w.add(n, t)
    data = MultiprocessingSerializer.deserialize(make_bucket_payloads(*w.finish(), 1, for_sglang=True)[0])
    fn(model, FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
       .reconstruct_tensors())


def _hf(path):
    ck = HFCheckpoint(path)
    tied = ck.decoder_config.tie_word_embeddings
    return ck.decoder_config, [
        (n, ck.get(n)) for n in sorted(ck.names()) if not (tied and n == "lm_head.weight")
    ]


def _expected_store(named):
    """(sglang param, shard) -> tensor that SGLang's loader must receive for our HF names."""
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    out = {}
    for n, t in named:
        key = (n if n.startswith(("model.", "lm_head")) else f"model.{n}", None)
        for piece, (fused, shard) in stacked.items():
            if f".{piece}." in n:
                key = (key[0].replace(f".{piece}.", f".{fused}."), shard)
        out[key] = t
    return out


@pytest.mark.parametrize(
    "arch,dtype",
    [
        ("qwen3", "fp32"),
        ("qwen3", "bf16"),
        ("qwen3", "fp8"),
        ("qwen2", "bf16"),
        ("qwen2", "fp8"),
        ("llama", "bf16"),
    ],
)
def test_target_loader_takes_every_tensor_exactly(ckpts, arch, dtype):
    path = {"qwen3": ckpts.qwen3, "qwen2": ckpts.qwen2, "llama": ckpts.llama_tied}[arch]
    cfg, named = _hf(path)
    if dtype == "fp8":
        named = list(quantize_named(named))
    elif dtype == "bf16":
        named = [(n, t.to(torch.bfloat16)) for n, t in named]
    fn, log = ss.loader(*LOADERS[arch])
    model = ss.FakeModel(target_params(cfg, dtype == "fp8"), cfg.tie_word_embeddings)
    _through_sglang(named, model, fn)
    assert not log.warnings, log.warnings
    loaded = {}
    for (name, shard) in model.store:
        loaded.setdefault(name, set()).add(shard)
    assert loaded == {n: shards(n) for n in target_params(cfg, dtype == "fp8")}
    assert set(model.counts.values()) == {1}  # each (parameter, shard) written once
    expected = _expected_store(named)
    assert set(model.store) == set(expected)
    for key, t in expected.items():
        assert model.store[key].dtype == t.dtype and torch.equal(model.store[key].view(torch.uint8),
                                                                 t.contiguous().view(torch.uint8)), key


def test_llama_loader_would_drop_fp8_scales_so_the_backend_refuses(ckpts, tmp_path):
    from megatron_spec.rollout.sglang_backend import SGLangEngine

    cfg, named = _hf(ckpts.llama_tied)
    fn, log = ss.loader(*LOADERS["llama"])
    model = ss.FakeModel(target_params(cfg, fp8=True), cfg.tie_word_embeddings)
    _through_sglang(list(quantize_named(named)), model, fn)
    scales = {n for n in target_params(cfg, True) if n.endswith("weight_scale_inv")}
    assert scales.isdisjoint(n for n, _ in model.store)  # every block scale dropped
    # ... and loading goes on: a log line per scale is all SGLang says, the layers keep garbage scales
    assert all("weight_scale not found" in w for w in log.warnings) and len(log.warnings) >= len(scales)
    with pytest.raises(ValueError, match="renames it to \\*.weight_scale and drops it"):
        SGLangEngine(EngineConfig(model_path=ckpts.llama_tied, fp8_weights=True), launch=pytest.fail)


def test_eagle3_loader_takes_every_draft_tensor(ckpts):
    from megatron_spec.draft.modelopt_io import load_eagle3

    named = [(n, t.detach()) for n, t in load_eagle3(ckpts.eagle3_other, ckpts.cfg).named_export_tensors()
             if n != "d2t"]
    fn, log = ss.loader(*DRAFT_LOADER)
    model = ss.FakeModel(draft_params())
    _through_sglang(named, model, fn)
    assert not log.warnings, log.warnings
    loaded = {}
    for (name, shard) in model.store:
        loaded.setdefault(name, set()).add(shard)
    # everything but the embedding, which the draft shares with the target (set_embed)
    assert loaded == {n: shards(n) for n in draft_params() - {"model.embed_tokens.weight"}}
    for key, t in _expected_store(named).items():
        assert torch.equal(model.store[key], t), key
    assert not hasattr(model, "hot_token_id")  # d2t was not re-sent (SGLang reads it once at start)


# ------------------------------------------------------------------ launch arguments and requests
def _resolved(kw):
    """SGLang's own validation of launch arguments: ``ServerArgs(**kw)`` only stores them (0.5.23
    validates in ``resolve_once``, which ``sglang.Engine`` runs at launch). ``device`` "cuda": the
    GPU SGLang would detect."""
    from sglang.srt.arg_groups.overrides import resolving_view

    args = ss.srt()["sglang.srt.server_args"].ServerArgs(**{"device": "cuda", **kw})
    args.resolve_once()
    return args, resolving_view(args)


def test_server_args_pass_sglangs_own_validation_and_are_lossless(ckpts):
    from megatron_spec.speculative import LossyConfigError, check_lossless

    cfg = EngineConfig(
        model_path=ckpts.qwen3,
        draft_kind="eagle3",
        draft_path=ckpts.eagle3,
        num_draft_tokens=3,
        dtype="bfloat16",
        context_length=256,
        max_batch_size=8,
    )
    args, view = _resolved(proto.server_kwargs(cfg, tp_size=2))
    check_lossless(args)
    assert (view.speculative_algorithm, view.speculative_num_steps, view.speculative_eagle_topk,
            view.speculative_num_draft_tokens) == ("EAGLE3", 3, 1, 4)
    assert view.speculative_use_rejection_sampling and view.enable_memory_saver and view.tp_size == 2
    assert view.speculative_accept_threshold_single == view.speculative_accept_threshold_acc == 1.0
    assert not view.disable_radix_cache
    unshared, _ = _resolved(proto.server_kwargs(dataclasses.replace(cfg, share_prefix=False), tp_size=2))
    assert unshared.disable_radix_cache  # --no-rollout-share-prefix
    # SGLang refuses
    with pytest.raises(ValueError, match="rejection sampling ignores the accept thresholds"):
        _resolved(proto.server_kwargs(cfg, overrides={"speculative_accept_threshold_acc": 0.5}))
    with pytest.raises(LossyConfigError, match="speculative_accept_threshold_acc = 0.5"):  # and so do we
        check_lossless(proto.server_kwargs(cfg, overrides={"speculative_accept_threshold_acc": 0.5}))
    with pytest.raises(ValueError, match="draft_kind 'ngram' is not launched by the SGLang backend"):
        proto.server_kwargs(EngineConfig(model_path=ckpts.qwen3, draft_kind="ngram"))
    # --rollout-engine-kwargs reach ServerArgs (make_engine's overrides), through SGLang's checks and ours
    from megatron_spec.rollout.config import parse_engine_kwargs

    extra = parse_engine_kwargs('{"chunked_prefill_size": 4096, "schedule_policy": "fcfs"}', "sglang")
    args, view = _resolved(proto.server_kwargs(cfg, overrides=extra))
    check_lossless(args)
    assert view.chunked_prefill_size == 4096 and view.schedule_policy == "fcfs"
    with pytest.raises(TypeError, match="no_such_field"):  # SGLang's own refusal of an unknown field
        _resolved(proto.server_kwargs(cfg, overrides=parse_engine_kwargs('{"no_such_field": 1}', "sglang")))


def test_draft_model_runs_sglangs_exact_point_mass_verify(ckpts):
    """Issue 15, defect 3: SGLang 0.5.23 refuses rejection sampling for STANDALONE (NotImplementedError
    in ``_handle_eagle_family``); the backend launches it with SGLang's default verify (point-mass q)."""
    from megatron_spec.speculative import check_lossless

    cfg = EngineConfig(
        model_path=ckpts.qwen3,
        draft_kind="model",
        draft_path=ckpts.qwen3_other,
        num_draft_tokens=3,
        dtype="bfloat16",
        context_length=256,
        max_batch_size=8,
    )
    kw = proto.server_kwargs(cfg)
    with pytest.raises(NotImplementedError, match="only supported for EAGLE / EAGLE3 / NEXTN, not "
                                                  "speculative_algorithm=STANDALONE"):
        _resolved(dict(kw, speculative_use_rejection_sampling=True))
    args, view = _resolved(kw)
    check_lossless(args)
    assert view.speculative_algorithm == "STANDALONE" and not view.speculative_use_rejection_sampling
    assert view.speculative_accept_threshold_single == view.speculative_accept_threshold_acc == 1.0


def test_fp8_quantization_config_reaches_the_target_only(ckpts, tmp_path):
    """Issue 15, defect 4: SGLang's ``ModelConfig`` for the target is block FP8; the draft's
    (``is_draft_model=True``, as SGLang's draft runner builds it) is unquantised."""
    cfg = EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3, fp8_weights=True,
                       load_weights=False, dtype="bfloat16", context_length=256)
    with pytest.raises(ValueError, match="need fp8_config_file"):
        proto.server_kwargs(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(proto.fp8_target_config(ckpts.qwen3)))
    args, view = _resolved(proto.server_kwargs(cfg, fp8_config_file=str(path)))
    assert (view.load_format, view.speculative_draft_load_format) == ("dummy", "auto")
    model_config = ss.srt()["sglang.srt.configs.model_config"].ModelConfig
    target = model_config.from_server_args(args)
    assert target.quantization == "fp8" and target.hf_config.quantization_config["weight_block_size"] == [
        128,
        128,
    ]
    draft = model_config.from_server_args(
        args,
        model_path=view.speculative_draft_model_path,
        model_revision=view.speculative_draft_model_revision,
        is_draft_model=True,
    )
    assert draft.hf_config.architectures == ["LlamaForCausalLMEagle3"]
    assert draft.quantization is None and getattr(draft.hf_config, "quantization_config", None) is None


@pytest.fixture
def io_struct(monkeypatch):
    return ss.install_io_struct(monkeypatch)


def test_request_objects_are_sglangs(io_struct):
    import msgspec

    req = proto.update_request([b"p0", b"p1"], "draft", "v3", flush_cache=False)
    assert isinstance(req, io_struct.UpdateWeightsFromTensorReqInput)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=io_struct.UpdateWeightsFromTensorReqInput)
    assert (
        back.serialized_named_tensors,
        back.load_format,
        back.selector,
        back.weight_version,
        back.flush_cache,
    ) == ([b"p0", b"p1"], "flattened_bucket", "draft", "v3", False)
    assert proto.session_request(True, "target").selector == "target"
    assert isinstance(proto.session_request(False), io_struct.EndWeightUpdateReqInput)
    assert proto.checksum_request("draft").skip_tensor_list == ["embed_tokens"]
    with pytest.raises(ValueError, match="never|'all' loads target tensors"):
        proto.update_request([b"p"], "all", "v", True)


def test_parse_output_counts_prefill_as_a_verify_step():
    meta = {"finish_reason": {"type": "length"}, "completion_tokens": 7, "spec_verify_ct": 3,
            "spec_correct_drafts_histogram": [1, 0, 2], "weight_version": "v1",
            "output_token_logprobs": [(-0.1 * i, 10 + i, None) for i in range(7)]}
    s = proto.parse_output({"output_ids": list(range(10, 17)), "meta_info": meta}, "r", 0, speculative=True,
                           target_version="v1", draft_version="d1")
    # prefill 1 token + steps emitting 1, 3, 3 tokens (0, 2, 2 drafts accepted + bonus) = 7
    assert s.num_verify_steps == 4 and sorted(s.accepted_per_step) == [0, 2, 2] and s.accept_length == 7 / 4
    assert s.logprobs == pytest.approx([-0.1 * i for i in range(7)]) and s.finish_reason == "length"
    plain = dict(meta, spec_verify_ct=0, spec_correct_drafts_histogram=None)
    assert (
        proto.parse_output(
            {"output_ids": list(range(10, 17)), "meta_info": plain},
            "r",
            0,
            speculative=False,
            target_version="v1",
            draft_version=None,
        ).num_verify_steps
        == 7
    )
    with pytest.raises(proto.SGLangOutputError, match="aborted"):
        proto.parse_output(
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}},
            "r",
            0,
            speculative=True,
            target_version="v1",
            draft_version="d1",
        )
    with pytest.raises(proto.SGLangOutputError, match="logprob 1 is for token 99"):
        bad = dict(
            meta, output_token_logprobs=[(0.0, 10, None), (0.0, 99, None)] + meta["output_token_logprobs"][2:]
        )
        proto.parse_output({"output_ids": list(range(10, 17)), "meta_info": bad}, "r", 0, speculative=True,
                           target_version="v1", draft_version="d1")
    with pytest.raises(proto.SGLangOutputError, match="weight_version 'v0'"):
        proto.parse_output(
            {"output_ids": list(range(10, 17)), "meta_info": dict(meta, weight_version="v0")},
            "r",
            0,
            speculative=True,
            target_version="v1",
            draft_version="d1",
        )


# ------------------------------------------------------------------ SGLangEngine end to end (stand-in engine)
@pytest.fixture
def sgl(ckpts, io_struct):
    from megatron_spec.rollout.sglang_backend import SGLangEngine

    cfg = HFCheckpoint(ckpts.qwen3).decoder_config
    tfn, _ = ss.loader(*LOADERS["qwen3"])
    dfn, _ = ss.loader(*DRAFT_LOADER)
    launch = functools.partial(ss.FakeSGLangEngine, tfn, target_params(cfg, False), dfn, draft_params())
    eng = SGLangEngine(EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3,
                                    num_draft_tokens=3, dtype="float32", context_length=256), launch=launch)
    yield eng
    eng.shutdown()


def _draft(path, cfg):
    from megatron_spec.draft.modelopt_io import load_eagle3

    return [(n, t.detach().clone()) for n, t in load_eagle3(path, cfg).named_export_tensors() if n != "d2t"]


def test_sglang_engine_syncs_verifies_and_generates(sgl, ckpts):
    fake = sgl._engine
    st = WeightStreamer(sgl, bucket_bytes=16 << 10, weight_dtype="fp32", for_sglang=True)
    draft_digest = sgl.health()["checksums"]["draft"]
    _, named = _hf(ckpts.qwen3_other)
    rep = st.sync_target_tensors(named, "t1")
    assert rep.num_buckets > 2 and sgl.health()["checksums"]["draft"] == draft_digest  # untouched
    ups = [r for r in fake.requests if isinstance(r, fake.io.UpdateWeightsFromTensorReqInput)]
    assert {r.selector for r in ups} == {"target"} and {r.load_format for r in ups} == {"flattened_bucket"}
    assert [r.flush_cache for r in ups] == [False] * (len(ups) - 1) + [True]
    assert fake.requests[0].selector == "target"  # the session was opened for the target only
    # the engine holds what was sent, in its own layout
    for key, t in _expected_store(named).items():
        assert torch.equal(fake.models["target"].store[key], t), key
    # the draft: first sync of the start-up weights leaves the digest unchanged; resolved from the checkpoint
    calls = []
    startup = sgl.startup_fingerprint
    sgl.startup_fingerprint = lambda g: calls.append(g) or startup(g)
    st.sync_draft(_draft(ckpts.eagle3, ckpts.cfg), "t1")
    assert calls == ["draft"]
    st.sync_draft(_draft(ckpts.eagle3_other, ckpts.cfg), "t1")
    h = sgl.health()
    assert (h["weight_version"], h["draft_weight_version"]) == ("t1", "t1")
    samples, stats = sgl.generate(
        [GenerateRequest("a", [5, 6, 7], SamplingParams(temperature=0.7, max_new_tokens=9), n=2)]
    )
    assert [s.sample_index for s in samples] == [0, 1] and stats.num_tokens == 18
    assert stats.mean_accept_length == pytest.approx(18 / sum(s.num_verify_steps for s in samples))
    assert fake.generated[-1]["sampling_params"][0]["top_k"] == -1


def test_dropped_draft_update_is_caught_on_sglang(sgl, ckpts):
    st = WeightStreamer(sgl, bucket_bytes=16 << 10, weight_dtype="fp32", for_sglang=True)
    st.sync_draft(_draft(ckpts.eagle3_other, ckpts.cfg), "d1")
    sgl._engine.drop_draft = True  # acknowledged, version recorded, nothing loaded
    with pytest.raises(WeightSyncError, match="draft weight sync failed: .*update dropped") as err:
        st.sync_draft(_draft(ckpts.eagle3, ckpts.cfg), "d2")
    assert err.value.group == "draft"


def test_release_resume_repushes_the_draft_and_refuses_a_stale_target(sgl, ckpts):
    from megatron_spec.speculative import LossyConfigError

    st = WeightStreamer(sgl, bucket_bytes=16 << 10, weight_dtype="fp32", for_sglang=True)
    _, named = _hf(ckpts.qwen3_other)
    st.sync_target_tensors(named, "t1")
    draft = _draft(ckpts.eagle3_other, ckpts.cfg)
    st.sync_draft(draft, "t1")
    before = sgl.health()["checksums"]["draft"]
    sgl.release_memory()
    with pytest.raises(RuntimeError, match="memory is released"):
        sgl.generate([GenerateRequest("a", [5], SamplingParams(max_new_tokens=2))])
    sgl.resume_memory()  # the last verified draft goes back in, verified against the digest ledger
    h = sgl.health()
    assert (
        h["draft_weight_version"] == "t1"
        and h["checksums"]["draft"] == before
        and h["weight_version"] is None
    )
    with pytest.raises(RuntimeError, match=r"no weights loaded for \['target'\]"):
        sgl.generate([GenerateRequest("a", [5], SamplingParams(max_new_tokens=2))])
    st.sync_target_tensors(named, "t2")
    with pytest.raises(LossyConfigError, match="min_p"):
        sgl.generate(
            [GenerateRequest("a", [5], SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=2))]
        )
    samples, _ = sgl.generate([GenerateRequest("a", [5], SamplingParams(max_new_tokens=2))])
    assert samples[0].weight_version == "t2"


def test_resume_only_what_was_released_as_sglangs_scheduler_requires(sgl, ckpts):
    """Issue 15, defect 1: SGLang's scheduler resumes a tag with ``offload_tags.remove(tag)``; a tag
    never released is a KeyError that kills the scheduler and the trainer with it. The trainer
    resumes at the start of every sync, the first included, and after a relaunch."""
    fake = sgl._engine
    with pytest.raises(KeyError, match="kv_cache"):  # SGLang's own behaviour, for the record
        fake.updater.resume_memory_occupation(fake.io.ResumeMemoryOccupationReqInput(tags=["kv_cache"]))
    sgl.resume_memory()  # the trainer's first sync: nothing released, nothing sent
    assert fake.memory_saver.calls == [] and fake.updater.offload_tags == set()
    sgl.release_memory()
    sgl.release_memory(("kv_cache",))  # already released: not sent again
    assert fake.updater.offload_tags == {"kv_cache", "weights"}
    sgl.resume_memory()
    assert fake.updater.offload_tags == set() and fake.memory_saver.paused == set()
    assert sgl.health()["draft_weight_version"] == "init"  # re-pushed from the checkpoint after the resume
    sgl.release_memory()
    sgl.set_speculation(False)  # the watchdog's relaunch: a new engine that has released nothing
    sgl.resume_memory()
    assert sgl._engine is not fake and sgl._engine.dead is None and sgl._engine.memory_saver.calls == []


def test_draft_and_its_token_map_are_read_at_launch_when_the_target_is_dummy(ckpts, io_struct):
    """Issue 15, defect 2: the trainer launches with ``load_weights=False`` (target "dummy"); SGLang
    gives an unset draft load format the target's, so the draft would start random and SGLang's
    EAGLE worker, which reads ``d2t`` once at start-up, would never get the token map."""
    from megatron_spec.draft.modelopt_io import load_eagle3
    from megatron_spec.rollout.sglang_backend import SGLangEngine

    cfg = HFCheckpoint(ckpts.qwen3).decoder_config
    tfn, _ = ss.loader(*LOADERS["qwen3"])
    dfn, _ = ss.loader(*DRAFT_LOADER)
    launch = functools.partial(ss.FakeSGLangEngine, tfn, target_params(cfg, False), dfn, draft_params())
    with SGLangEngine(
        EngineConfig(
            model_path=ckpts.qwen3,
            draft_kind="eagle3",
            draft_path=ckpts.eagle3,
            num_draft_tokens=3,
            dtype="float32",
            load_weights=False,
            context_length=256,
        ),
        launch=launch,
    ) as eng:
        fake = eng._engine
        assert fake.load_formats == {"target": "dummy", "draft": "auto"}  # SGLang's build_load_config
        head = load_eagle3(ckpts.eagle3, ckpts.cfg)
        d2t = head.d2t.detach()
        assert torch.equal(fake.models["draft"].hot_token_id, d2t + torch.arange(d2t.numel()))
        for key, t in _expected_store(_draft(ckpts.eagle3, ckpts.cfg)).items():
            assert torch.equal(fake.models["draft"].store[key], t), key
        # what the engine reports at start is the checkpoint's digest, so the first draft sync verifies
        st = WeightStreamer(eng, bucket_bytes=16 << 10, weight_dtype="fp32", for_sglang=True)
        st.sync_draft(_draft(ckpts.eagle3, ckpts.cfg), "d0")
        assert eng.health()["draft_weight_version"] == "d0"


@pytest.mark.gpu
def test_real_sglang_engine(ckpts):
    """On a GPU with the full SGLang install: launch, sync target and draft, verify, generate."""
    from megatron_spec.rollout.sglang_backend import SGLangEngine

    cfg = EngineConfig(
        model_path=ckpts.qwen3,
        draft_kind="eagle3",
        draft_path=ckpts.eagle3,
        num_draft_tokens=3,
        dtype="bfloat16",
        context_length=256,
        max_batch_size=4,
    )
    with SGLangEngine(cfg, server_overrides={"mem_fraction_static": 0.3}) as eng:
        st = WeightStreamer(eng, weight_dtype="bf16", for_sglang=True)
        _, named = _hf(ckpts.qwen3_other)
        st.sync_target_tensors([(n, t.cuda()) for n, t in named], "t1")
        st.sync_draft([(n, t.cuda()) for n, t in _draft(ckpts.eagle3_other, ckpts.cfg)], "t1")
        samples, stats = eng.generate([GenerateRequest("a", [5, 6, 7], SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=16))])
        assert len(samples[0].output_ids) == 16 and stats.num_verify_steps >= 1
        eng.release_memory()
        eng.resume_memory()
        st.sync_target_tensors([(n, t.cuda()) for n, t in named], "t2")
        assert eng.health()["draft_weight_version"] == "t1"


def test_engines_of_one_node_take_nccl_ports_from_blocks_of_their_own(ckpts):
    """Several engines started together on a node: SGLang's own choice (a free port of 22000-29999
    at that moment, bound later by the scheduler) can give two of them the same port. Each engine
    takes its port from a block of its own, and SGLang's PortArgs uses it."""
    import random
    import socket

    from sglang.srt.server_args import PortArgs

    ports = {}
    for e in range(8):
        cfg = EngineConfig(model_path=ckpts.qwen3, dtype="bfloat16", context_length=256, engine_index=e)
        args, _ = _resolved(proto.server_kwargs(cfg, tp_size=1))
        ports[e] = PortArgs.init_new(args).nccl_port
        lo = proto.NCCL_PORT_LOW + e * proto.NCCL_PORT_BLOCK
        assert lo <= ports[e] < lo + proto.NCCL_PORT_BLOCK, (e, ports[e])
    assert len(set(ports.values())) == 8
    # a port in use is passed over; a block with none free is a clear error
    lo = proto.NCCL_PORT_LOW + 3 * proto.NCCL_PORT_BLOCK
    socks = []
    try:
        for p in range(lo, lo + 4):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", p))
            except OSError:
                s.close()
                continue
            socks.append(s)
        taken = {s.getsockname()[1] for s in socks}
        for seed in range(20):
            assert proto.nccl_port(3, rng=random.Random(seed)) not in taken
        with pytest.raises(RuntimeError, match="no free port"):
            proto.nccl_port(3, attempts=len(taken), rng=_FirstPorts(sorted(taken)))
    finally:
        for s in socks:
            s.close()


class _FirstPorts:
    """A stand-in for ``random.Random`` whose ``sample`` offers only the given ports."""

    def __init__(self, ports):
        self.ports = ports

    def sample(self, population, k):
        return self.ports[:k]
