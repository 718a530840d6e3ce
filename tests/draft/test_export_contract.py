"""A draft trained online and exported: what the native engine and SGLang's EAGLE-3 loader make of it.

* The export (``save_eagle3`` after each update) is a ModelOpt-format directory: the native engine
  starts from it, and a streamed update (``named_update_tensors`` in a flattened bucket, selector
  ``draft``) into an engine started from the *initial* draft lands the same weights.
* SGLang 0.5.23's ``LlamaForCausalLMEagle3.load_weights``, compiled from the installed source and
  run against a recording stand-in model (``tests/sync/sglang_support.py``; the module itself does
  not import on CPU), takes every exported tensor: each SGLang draft parameter but the shared
  embedding is written exactly once with our values, ``d2t`` becomes its ``hot_token_id``, nothing
  is skipped. Its ``config.json`` is what SGLang's model reads (``num_aux`` from ``eagle_config``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.draft.modelopt_io import load_eagle3
from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.bucket import pack_bucket
from megatron_spec.sync.transport import make_bucket_payload

pytestmark = [pytest.mark.modelopt, pytest.mark.sglang]

EAGLE3 = "srt/models/llama_eagle3.py"


@pytest.fixture(scope="module")
def trained(drafts, tmp_path_factory):
    """The reduced-vocabulary ModelOpt draft after three online updates, exported."""
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_parallel(tp_size=1, seed=0)
    ckpt = HFCheckpoint(drafts.target_dir)
    policy = build_gpt_model(ckpt.decoder_config, vocab_divisible_by=8)
    load_hf_weights(policy, ckpt)
    export = str(tmp_path_factory.mktemp("contract") / "online")
    trainer = Eagle3Trainer.from_modelopt(
        drafts.reduced.path, drafts.target_cfg, DraftTrainerConfig(lr=1e-2), export_dir=export
    )
    ids = torch.tensor([s[:20] for s in drafts.sequences if len(s) >= 20][:6])
    for _ in range(3):
        cap = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=8))
        with torch.no_grad(), cap.record(policy, torch.ones_like(ids, dtype=torch.bool)):
            policy(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
        trainer.train_step(cap.take())
    yield trainer, export
    destroy_parallel()
    torch.set_num_threads(threads)


def test_native_engine_loads_the_export_and_the_stream(drafts, trained):
    from megatron_spec.rollout.native.server import EngineServer

    trainer, export = trained
    exported = dict(load_eagle3(export, drafts.target_cfg).named_export_tensors())
    for name, t in trainer.head.named_export_tensors():  # the export is the head after the last update
        assert torch.equal(exported[name], t.detach()), name
    common = dict(
        model_path=drafts.target_dir,
        draft_kind="eagle3",
        num_draft_tokens=3,
        max_batch_size=2,
        context_length=48,
    )
    req = [
        GenerateRequest(
            "a", (5, 9, 11, 7), SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
        )
    ]
    from_export = EngineServer(EngineConfig(draft_path=export, seed=1, **common))
    streamed = EngineServer(
        EngineConfig(draft_path=drafts.reduced.path, seed=1, **common)
    )  # the initial draft
    flat, meta = pack_bucket(list(trainer.named_update_tensors()))
    streamed.begin_weight_update()
    streamed.update_weights_from_tensor(
        [make_bucket_payload(flat, meta)], selector="draft", weight_version="d3"
    )
    assert streamed.end_weight_update()["draft_weight_version"] == "d3"
    for (n, a), (_, b) in zip(
        from_export.drafter.head.named_export_tensors(), streamed.drafter.head.named_export_tensors()
    ):
        assert torch.equal(a, b), n
    a, _ = from_export.generate(req)
    b, _ = streamed.generate(req)
    assert a[0].output_ids == b[0].output_ids and a[0].accepted_per_step == b[0].accepted_per_step


def _sglang_draft_params() -> set[str]:
    """SGLang's LlamaForCausalLMEagle3 parameter names, each module attribute checked in its source."""
    from tests.sync import sglang_support as ss

    def has(relpath, cls, *attrs):
        missing = set(attrs) - ss.init_attributes(relpath, cls)
        assert not missing, f"SGLang {relpath}:{cls} no longer assigns {sorted(missing)}"

    has(EAGLE3, "LlamaForCausalLMEagle3", "model", "lm_head")
    has(EAGLE3, "LlamaModel", "embed_tokens", "fc", "layers", "norm")
    has(EAGLE3, "LlamaDecoderLayer", "hidden_norm", "mlp", "self_attn.qkv_proj")
    has(
        "srt/models/llama.py", "LlamaDecoderLayer", "input_layernorm", "post_attention_layernorm", "self_attn"
    )
    has("srt/models/llama.py", "LlamaAttention", "qkv_proj", "o_proj")
    has("srt/models/llama.py", "LlamaMLP", "gate_up_proj", "down_proj")
    p = "model.layers.0"
    return {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        f"{p}.hidden_norm.weight",
        f"{p}.input_layernorm.weight",
        f"{p}.post_attention_layernorm.weight",
        f"{p}.self_attn.qkv_proj.weight",
        f"{p}.self_attn.o_proj.weight",
        f"{p}.mlp.gate_up_proj.weight",
        f"{p}.mlp.down_proj.weight",
    }


def _shards(name: str) -> set:
    return {"q", "k", "v"} if "qkv_proj" in name else {0, 1} if "gate_up_proj" in name else {None}


def test_sglang_eagle3_loader_takes_the_online_export(drafts, trained):
    pytest.importorskip("sglang")
    from safetensors.torch import load_file
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from tests.sync import sglang_support as ss

    trainer, export = trained
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # SGLang's num_aux rule: eagle_config.eagle_aux_hidden_state_layer_ids; fc takes n_aux * H
    assert (
        len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * config["hidden_size"]
        == trainer.head.fc.in_features
    )
    assert config["draft_vocab_size"] == 32 and "t2d" not in load_file(
        os.path.join(export, "model.safetensors")
    )

    params = _sglang_draft_params()
    fn, log = ss.loader(EAGLE3, "LlamaForCausalLMEagle3")
    on_disk = sorted(
        load_file(os.path.join(export, "model.safetensors")).items()
    )  # start-up load, d2t included
    model = ss.FakeModel(params)
    fn(model, on_disk)
    assert not log.warnings, log.warnings
    loaded: dict[str, set] = {}
    for name, shard in model.store:
        loaded.setdefault(name, set()).add(shard)
    assert loaded == {
        n: _shards(n) for n in params - {"model.embed_tokens.weight"}
    }  # embedding: the target's
    assert set(model.counts.values()) == {1}
    assert torch.equal(model.hot_token_id, trainer.head.target_ids)
    stacked = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    for name, t in on_disk:
        if name == "d2t":
            continue
        key = (name if name.startswith("lm_head") else f"model.{name}", None)
        for piece, (fused, shard) in stacked.items():
            if f".{piece}." in name:
                key = (key[0].replace(f".{piece}.", f".{fused}."), shard)
        assert torch.equal(model.store[key], t), name

    # a streamed update through SGLang's own deserializer and bucket, into a fresh store: every
    # parameter again, no d2t (SGLang reads it once at start-up)
    flat, meta = pack_bucket(list(trainer.named_update_tensors()))
    data = MultiprocessingSerializer.deserialize(make_bucket_payload(flat, meta, for_sglang=True))
    named = FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    ).reconstruct_tensors()
    update = ss.FakeModel(params)
    fn(update, named)
    assert set(update.store) == set(model.store) and not hasattr(update, "hot_token_id")
    for key, t in update.store.items():
        assert torch.equal(t, model.store[key]), key
