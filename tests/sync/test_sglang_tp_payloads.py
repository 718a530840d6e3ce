"""SGLang at tensor parallelism T > 1: which GPUs the engine uses and one payload per engine TP rank.

Against SGLang 0.5.23's own code on CPU (sglang_support):

* placement: the ``ServerArgs`` we build pass SGLang's resolution, and SGLang's own GPU formula
  (the ``gpu_id`` expression of ``Engine._launch_scheduler_processes`` with ``_calculate_rank_ranges``,
  compiled from the installed source, and ``weight_cache.protocol.compute_local_gpu_id``) puts TP
  rank i on ``gpu_ids[i]``, the GPU of the trainer rank colocated with it;
* payloads: one ``UpdateWeightsFromTensorReqInput`` whose ``serialized_named_tensors`` holds two
  payloads packed by our bucket code (each "trainer rank" packs into its own buffer) goes through
  SGLang's msgpack hop, its scheduler-side ``SchedulerWeightUpdaterManager``,
  ``TpModelWorker.deserialize_own_rank``, the model runner's ``WeightUpdater`` (flattened bucket,
  ``FlattenedTensorBucket``) and SGLang's Qwen3 loader into SGLang's own parallel layers built at
  TP rank 0 and 1. Each rank deserialises its own entry, once, and receives the *full* tensors:
  the layers' ``weight_loader``s narrow them to the rank's shard. So each payload must carry the
  full (gathered) tensors, living on its own rank's GPU;
* counts: SGLang indexes ``serialized_named_tensors[tp_rank]`` (a short list is an IndexError in
  a scheduler, extra entries are never opened); ``SGLangEngine`` refuses any count but T first.

Stand-ins only for what needs a GPU or other processes (the TP barrier, CUDA graphs; see
``sglang_support.TpRank``).
"""

from __future__ import annotations

import ast
import functools
import json
import os

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.rollout import sglang_protocol as proto
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.sync.bucket import BucketWriter, alloc_bucket_buffer
from megatron_spec.sync.streamer import WeightStreamer
from megatron_spec.sync.transport import make_bucket_payload
from tests.sync import sglang_support as ss

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")


@pytest.fixture(autouse=True)
def _fresh_sglang_context():
    yield
    from sglang.srt.runtime_context import reset_context

    reset_context()  # each test publishes its own ranks
    ss.undo_torch_reduction_patch()  # SGLang's TP worker code patched torch's reductions process-wide


def _resolved(kw):
    args = ss.srt()["sglang.srt.server_args"].ServerArgs(**{"device": "cuda", **kw})
    args.resolve_once()  # what sglang.Engine runs first
    return args


# ------------------------------------------------------------------ which GPUs
def _sglang_gpu_ids(args) -> list[int]:
    """The GPU of each TP rank as SGLang's launcher computes it (one node), from its own source."""
    from sglang.srt.runtime_context import SpawnRanks, get_device, get_parallel, publish

    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    _, tree = ss.source("srt/entrypoints/engine.py")
    ranges = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_calculate_rank_ranges"
    )
    ns = {"get_parallel": get_parallel, "Tuple": tuple}
    exec(compile(ast.Module(body=[ranges], type_ignores=[]), "engine.py", "exec"), ns)
    pp_ranks, tp_ranks, pp_per_node, tp_per_node = ns["_calculate_rank_ranges"](get_parallel().node_rank)
    launch = next(n for n in ast.walk(tree)
                  if isinstance(n, ast.FunctionDef) and n.name == "_launch_scheduler_processes")
    expr = next(n.value for n in ast.walk(launch) if isinstance(n, ast.Assign)
                and [ast.unparse(t) for t in n.targets] == ["gpu_id"])
    code = compile(ast.Expression(expr), "engine.py", "eval")
    return [
        eval(
            code,
            {"get_device": get_device},
            {"pp_rank": pp, "tp_rank": tp, "pp_size_per_node": pp_per_node, "tp_size_per_node": tp_per_node},
        )
        for pp in pp_ranks
        for tp in tp_ranks
    ]


@pytest.mark.parametrize("gpu_ids", [(0,), (5,), (0, 1), (2, 3), (4, 6), (4, 5, 6, 7)])
def test_sglang_places_tp_rank_i_on_gpu_ids_i(ckpts, gpu_ids):
    from sglang.srt.weight_cache.protocol import compute_local_gpu_id

    cfg = EngineConfig(model_path=ckpts.qwen3, dtype="bfloat16", context_length=256)
    t = len(gpu_ids)
    args = _resolved(proto.server_kwargs(cfg, tp_size=t, gpu_ids=gpu_ids))
    assert _sglang_gpu_ids(args) == list(gpu_ids)
    assert [compute_local_gpu_id(0, i, 1, t, args.base_gpu_id, args.gpu_id_step) for i in range(t)] == list(
        gpu_ids
    )


@pytest.mark.parametrize("tp,gpu_ids,match", [
    (2, (3, 2), "not increasing in equal steps"), (3, (0, 1, 3), "not increasing in equal steps"),
    (2, (1, 1), "not increasing in equal steps"), (2, (0,), "one GPU per TP rank"),
    (1, (-1,), "local CUDA device indices >= 0")])
def test_gpu_ids_sglang_cannot_place_are_refused(ckpts, tp, gpu_ids, match):
    from megatron_spec.rollout.sglang_backend import SGLangEngine

    cfg = EngineConfig(model_path=ckpts.qwen3, dtype="bfloat16", context_length=256)
    with pytest.raises(ValueError, match=match):
        SGLangEngine(cfg, tp_size=tp, gpu_ids=gpu_ids, launch=pytest.fail)
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        SGLangEngine(cfg, tp_size=0, launch=pytest.fail)


# ------------------------------------------------------------------ one payload per TP rank
def _hf_named(path):
    ck = HFCheckpoint(path)
    return [(n, ck.get(n)) for n in sorted(ck.names())]


def _pack(named) -> tuple[torch.Tensor, bytes]:
    """What one colocated trainer rank does: pack the bucket into its own buffer, serialise it."""
    w = BucketWriter(alloc_bucket_buffer(sum(t.numel() * t.element_size() + 16 for _, t in named)))
    for n, t in named:
        w.add(n, t)
    flat, meta = w.finish()
    return flat, make_bucket_payload(flat, meta, for_sglang=True)


def _shard(full: dict[str, torch.Tensor], name: str, rank: int, tp: int, vocab_padded: int) -> torch.Tensor:
    """Rank ``rank``'s part of SGLang parameter ``name``, cut by hand from the full HF tensors."""
    def rows(t):
        return t.chunk(tp, dim=0)[rank]

    if name.endswith("qkv_proj.weight"):
        p = name.removesuffix("qkv_proj.weight")
        return torch.cat([rows(full[p + f"{x}_proj.weight"]) for x in "qkv"])
    if name.endswith("gate_up_proj.weight"):
        p = name.removesuffix("gate_up_proj.weight")
        return torch.cat([rows(full[p + "gate_proj.weight"]), rows(full[p + "up_proj.weight"])])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full[name].chunk(tp, dim=1)[rank]
    # vocab padded to a multiple of 64, then split
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = full[name]
        return rows(torch.cat([t, t.new_zeros(vocab_padded - t.shape[0], t.shape[1])]))
    return full[name]  # norms: replicated


@pytest.fixture
def tp2_args(ckpts):
    cfg = EngineConfig(model_path=ckpts.qwen3, dtype="float32", context_length=256)
    return _resolved(proto.server_kwargs(cfg, tp_size=2, gpu_ids=(2, 3)))


@pytest.mark.parametrize("content,dtype", [("equal", torch.float32), ("equal", torch.bfloat16),
                                           ("distinct", torch.float32)], ids=["equal-fp32", "equal-bf16",
                                                                                "distinct-fp32"])
def test_each_tp_rank_loads_its_own_payload_and_narrows_full_tensors(ckpts, tp2_args, content, dtype):
    """``equal``: what the trainer sends (the same bucket packed on each rank's device, two IPC
    handles); ``distinct``: rank 1's entry holds other weights, so a rank that read the wrong
    entry would hold the wrong shard."""
    hf_config = json.load(open(os.path.join(ckpts.qwen3, "config.json")))
    sent = [_hf_named(ckpts.qwen3_other), _hf_named(ckpts.qwen3_other if content == "equal" else ckpts.qwen3)]
    sent = [[(n, t.to(dtype)) for n, t in named] for named in sent]
    packed = [_pack(named) for named in sent]
    buffers, payloads = [b for b, _ in packed], [p for _, p in packed]
    assert payloads[0] != payloads[1]  # two buffers: different handles, whatever the content
    req = proto.update_request(payloads, "target", "v1", flush_cache=True)
    vocab = hf_config["vocab_size"]
    vocab_padded = -(-vocab // 64) * 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE
    for rank in (0, 1):
        r = ss.TpRank(tp2_args, rank, gpu_id=2 + rank, hf_config=hf_config, dtype=dtype)
        try:
            assert r.handle(proto.session_request(True, "target")).success
            out = r.handle(req)
            assert out.success, out.message
            assert r.versions == ["v1"] and not r.model.log.warnings
            # its own entry, deserialised once; the other rank's entry is never opened here
            assert r.serializer.calls == [payloads[rank]]
            ptr = buffers[rank].untyped_storage().data_ptr()
            # views of its own buffer
            assert all(t.untyped_storage().data_ptr() == ptr for _, t in r.model.received)
            # full (unsharded) tensors reach the loader ...
            assert [n for n, _ in r.model.received] == [n for n, _ in sent[rank]]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(r.model.received, sent[rank]))
            # ... and SGLang's layers keep this rank's shard of them
            full = dict(sent[rank])
            for name, param in r.model.named_parameters():
                assert not param.isnan().any(), f"{name} never loaded on TP rank {rank}"
                assert param.dtype == dtype and torch.equal(
                    param, _shard(full, name, rank, 2, vocab_padded)
                ), (name, rank)
            assert r.model.model.embed_tokens.weight.shape[0] == vocab_padded // 2
        finally:
            r.close()


def test_payload_count_other_than_tp_size(ckpts, tp2_args):
    """SGLang's own code with a wrong count, and SGLangEngine refusing it before it is sent."""
    hf_config = json.load(open(os.path.join(ckpts.qwen3, "config.json")))
    named = _hf_named(ckpts.qwen3_other)
    packed = [_pack(named) for _ in range(3)]
    payloads = [p for _, p in packed]
    short = proto.update_request(payloads[:1], "target", "v1", flush_cache=True)
    r = ss.TpRank(tp2_args, 1, gpu_id=3, hf_config=hf_config)
    try:
        r.handle(proto.session_request(True, "target"))
        with pytest.raises(IndexError):  # in a scheduler process this exception takes the scheduler down
            r.handle(short)
        long = proto.update_request(payloads, "target", "v1", flush_cache=True)
        assert r.handle(long).success and r.serializer.calls == [payloads[1]]  # payloads[2]: never opened
    finally:
        r.close()

    from megatron_spec.rollout.sglang_backend import SGLangEngine

    launch = functools.partial(ss.FakeSGLangEngine, lambda model, weights: None, ())
    with SGLangEngine(EngineConfig(model_path=ckpts.qwen3, dtype="float32", context_length=256), tp_size=2,
                      gpu_ids=(2, 3), launch=launch) as eng:
        fake = eng._engine
        assert (fake.server_args.tp_size, fake.server_args.base_gpu_id, fake.server_args.gpu_id_step) == (
            2,
            2,
            1,
        )
        assert eng.info["gpu_ids"] == [2, 3]
        eng.begin_weight_update("target")
        for bad in (payloads[0], payloads[:1], payloads):
            with pytest.raises(
                ValueError,
                match=r"runs TP=2 on GPUs \[2, 3\]: update_weights_from_tensor needs "
                r"exactly one payload per engine TP rank .* got [13]",
            ):
                eng.update_weights_from_tensor(bad, "target", "v1")
        assert not any(isinstance(q, fake.io.UpdateWeightsFromTensorReqInput) for q in fake.requests)
        assert eng.update_weights_from_tensor(payloads[:2], "target", "v1")["weight_version"] == "v1"
        assert fake.payload_counts == [2]
        eng.end_weight_update()


def test_streamer_sends_tp_size_payloads_through_sglang_engine(ckpts):
    """``WeightStreamer`` on an ``SGLangEngine`` at TP=2: every bucket goes out as two payloads
    with equal content (the stand-in engine deserialises each rank's entry with SGLang's
    serializer and checks), and the engine holds what was sent."""
    from megatron_spec.rollout.sglang_backend import SGLangEngine
    from tests.sync.test_sglang_backend import LOADERS, _expected_store, target_params

    cfg = HFCheckpoint(ckpts.qwen3).decoder_config
    tfn, _ = ss.loader(*LOADERS["qwen3"])
    launch = functools.partial(ss.FakeSGLangEngine, tfn, target_params(cfg, False))
    with SGLangEngine(EngineConfig(model_path=ckpts.qwen3, dtype="float32", context_length=256), tp_size=2,
                      launch=launch) as eng:
        st = WeightStreamer(eng, bucket_bytes=16 << 10, weight_dtype="fp32", for_sglang=True)
        named = _hf_named(ckpts.qwen3_other)
        rep = st.sync_target_tensors(named, "t1")
        fake = eng._engine
        assert rep.num_buckets > 2 and fake.payload_counts == [2] * rep.num_buckets
        for key, t in _expected_store(named).items():
            assert torch.equal(fake.models["target"].store[key], t), key
        assert eng.health()["weight_version"] == "t1"


def test_cpu_payloads_serialise_after_sglangs_cuda_reduction_patch(ckpts):
    """SGLang's ``monkey_patch_torch_reductions`` (applied by the transport for CUDA payloads and by
    each TP worker) treats every tensor's reduction as a CUDA one; our CPU payloads (the draft
    re-pushed from its host copy) must still serialise in that process (an IndexError before)."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    from megatron_spec.sync.transport import read_bucket_payload

    monkey_patch_torch_reductions()  # process-wide and permanent, as in a trainer that sent CUDA payloads
    named = _hf_named(ckpts.qwen3)[:3]
    _, payload = _pack(named)
    back = read_bucket_payload(payload)
    assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(back, named))
    assert set(MultiprocessingSerializer.deserialize(payload)) == {"flattened_tensor", "metadata"}
