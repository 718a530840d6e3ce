"""Weights streamed over CUDA IPC into the native engine on the same GPU (issue 27: defects 2 and 6).

The trainer side holds the weights on the GPU; the streamer packs them into GPU buckets and sends CUDA
IPC handles; the engine process (on the same GPU) loads them. What the engine holds is checked by
fingerprint after every sync (fp32, bf16, FP8), greedy rollouts of fp32 weights equal the CPU engine's,
and the GPU memory the sync used goes back: the engine lets go of the mapped buckets at the end of each
update and the trainer's ``torch.cuda.ipc_collect()`` returns them (docs/memory_plan.md).
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.streamer import WeightStreamer
from tests.sync.test_streamer import ckpt_tensors, draft_tensors

pytestmark = pytest.mark.gpu

REQS = [
    GenerateRequest(
        f"r{i}",
        (5 + i, 6, 7, 8 + i),
        SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
        n=2,
    )
    for i in range(4)
]


def _engine(ckpts, device: str, dtype: str, fp8: bool = False) -> NativeEngine:
    return NativeEngine(EngineConfig(model_path=ckpts.qwen3, draft_kind="eagle3", draft_path=ckpts.eagle3,
                                     num_draft_tokens=3, device=device, dtype=dtype, load_weights=False,
                                     fp8_weights=fp8, max_batch_size=8, context_length=64))


def _outputs(engine: NativeEngine) -> list[list[int]]:
    return [s.output_ids for s in engine.generate(REQS)[0]]


@pytest.mark.parametrize("weight_dtype, engine_dtype", [("fp32", "float32"), ("bf16", "bfloat16"),
                                                        ("fp8", "bfloat16")])
def test_cuda_ipc_sync_lands_exactly_and_frees_its_buckets(ckpts, weight_dtype, engine_dtype):
    target = [(n, t.cuda()) for n, t in ckpt_tensors(ckpts.qwen3_other)]
    draft = [(n, t.cuda()) for n, t in draft_tensors(ckpts.eagle3, ckpts.cfg)]
    with _engine(ckpts, "cuda", engine_dtype, fp8=weight_dtype == "fp8") as engine:
        assert engine.info["device"].startswith("cuda")
        streamer = WeightStreamer(engine, bucket_bytes=32 << 10, weight_dtype=weight_dtype)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_reserved()
        for version in ("v1", "v2"):  # verify=True: fingerprints of what was sent == what the engine holds
            rep = streamer.sync_target_tensors(target, version)
            assert rep.checksums["sent"] == rep.checksums["engine"]
            streamer.sync_draft(draft, version)
        health = engine.health()
        assert health["weight_version"] == "v2" and health["mapped_bucket_bytes"] == 0
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() <= baseline, "the sync's bucket buffers were not handed back"
        spec = _outputs(engine)
        engine.set_speculation(False)
        assert _outputs(engine) == spec  # greedy speculative == autoregressive on the GPU
    if weight_dtype == "fp32":  # the same weights on the CPU engine: the same tokens
        with _engine(ckpts, "cpu", "float32") as cpu:
            WeightStreamer(cpu, bucket_bytes=32 << 10, weight_dtype="fp32").sync_target_tensors(
                [(n, t.cpu()) for n, t in target], "v1")
            WeightStreamer(cpu, bucket_bytes=32 << 10, weight_dtype="fp32").sync_draft(
                [(n, t.cpu()) for n, t in draft], "v1")
            assert _outputs(cpu) == spec
