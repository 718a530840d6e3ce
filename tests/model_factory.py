"""The small models the tests share (``setup`` in tests/conftest.py), made here or read from a prepared
folder.

``python -m tests.model_factory DIR`` writes them to DIR (``setup.json`` names each one); the GPU check kit
(scripts/gpu_check.sh) carries that folder to a machine without NVIDIA ModelOpt, where the session fixture
reads it (``MEGATRON_SPEC_TEST_MODELS=DIR``) instead of training the EAGLE-3 draft again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.models.tiny import make_hf_checkpoint


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
    m.load_weights(
        (n, ck.get(n)) for n in ck.names() if not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    return m


def make_setup(root) -> Setup:
    """Make the models under ``root`` (deterministic: the same bits on every machine and run)."""
    root = Path(root)
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.rollout.native.engine import EngineCore
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

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


def save_setup(root) -> Setup:
    """:func:`make_setup` plus ``root/setup.json`` naming each model relative to ``root``."""
    made = make_setup(root)
    names = {
        f.name: os.path.relpath(getattr(made, f.name), root)
        for f in dataclasses.fields(Setup)
        if f.name != "cfg"
    }
    with open(os.path.join(root, "setup.json"), "w") as f:
        json.dump(names, f, indent=1)
    return made


def load_setup(root) -> Setup:
    """The models :func:`save_setup` wrote under ``root``."""
    path = os.path.join(root, "setup.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no prepared test models (python -m tests.model_factory {root})")
    with open(path) as f:
        names = {k: os.path.join(os.path.abspath(root), v) for k, v in json.load(f).items()}
    return Setup(cfg=DecoderConfig.from_pretrained(names["target"]), **names)


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    print(save_setup(out))
