"""Shared pytest set-up: GPU tests skip cleanly without CUDA; a session-wide small target with a
ModelOpt-trained EAGLE-3 draft (``setup``) for the engine, sync and GRPO tests."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.models.tiny import make_hf_checkpoint

os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@dataclasses.dataclass
class Setup:
    target: str
    cfg: DecoderConfig
    eagle3: str
    draft_model: str
    other_target: str  # same architecture, different weights (weight-update tests)


def load_native(path: str, dtype=torch.float32):
    from megatron_spec.rollout.native.model import CausalLM

    ck = HFCheckpoint(path)
    cfg = ck.decoder_config
    m = CausalLM(cfg).to(dtype).eval()
    m.load_weights((n, ck.get(n)) for n in ck.names() if not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    return m


@pytest.fixture(scope="session")
def setup(tmp_path_factory) -> Setup:
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.rollout.native.engine import EngineCore
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    root = tmp_path_factory.mktemp("rollout")
    kw = dict(family="qwen3", num_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_kv_heads=2)
    target = make_hf_checkpoint(root / "target", seed=3, init_std=0.05, **kw)
    other = make_hf_checkpoint(root / "other", seed=4, init_std=0.05, **kw)
    draft_model = make_hf_checkpoint(root / "draft_model", family="qwen3", num_layers=1, hidden_size=32,
                                     intermediate_size=64, num_attention_heads=2, num_kv_heads=1, seed=5)
    cfg = DecoderConfig.from_pretrained(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (6,), generator=g).tolist() for _ in range(32)]
    core = EngineCore(load_native(target), None, max_batch_size=32, context_length=64)
    samples, _ = core.generate([GenerateRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_new_tokens=30,
                                                                             ignore_eos=True))
                                for i, p in enumerate(prompts)])
    seqs = [p + s.output_ids for p, s in zip(prompts, samples)]
    train_and_export_eagle3(target, os.path.join(root, "eagle3"), seqs, steps=60, batch_size=8, max_len=40,
                            draft_vocab_size=48, ttt_steps=2, lr=3e-3, progress=False, export_rope_scaling={})
    return Setup(target, cfg, os.path.join(root, "eagle3"), draft_model, other)
