"""One tiny target and two EAGLE-3 drafts trained and exported by the real nvidia-modelopt (per session).

- ``reduced``: draft vocabulary 32 of 84 (``d2t`` calibrated by ModelOpt), ModelOpt's default
  feature layers (``[0, 1]`` for 4 layers) and its default exported YaRN ``rope_scaling``.
- ``full``: full vocabulary (no ``d2t``), feature layers ``[0, 1, 2]``, exported without RoPE scaling.

Both keep the trained ModelOpt model (``result.model``) so tests can run ModelOpt's own forward.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.models.tiny import make_hf_checkpoint


@dataclasses.dataclass
class DraftSetup:
    target_dir: str
    target_cfg: DecoderConfig
    sequences: list[list[int]]
    reduced: object  # Eagle3TrainResult
    full: object


def training_sequences(n: int = 24, seed: int = 0, vocab: int = 84) -> list[list[int]]:
    """Token ids with a skewed frequency profile (so the calibrated draft vocabulary is non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.linspace(3.0, 0.2, vocab - 4)  # ids 4..V-1, lower ids more frequent
    return [(torch.multinomial(weights, int(torch.randint(20, 40, (1,), generator=g)), replacement=True,
                               generator=g) + 4).tolist() for _ in range(n)]


@pytest.fixture(scope="session")
def drafts(tmp_path_factory) -> DraftSetup:
    pytest.importorskip("modelopt.torch.speculative")
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3

    root = tmp_path_factory.mktemp("eagle3")
    target = make_hf_checkpoint(
        root / "target",
        family="qwen3",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=3,
    )
    cfg = DecoderConfig.from_pretrained(target)
    seqs = training_sequences(vocab=cfg.vocab_size)
    common = dict(steps=4, batch_size=4, max_len=32, ttt_steps=2, lr=3e-3, progress=False, keep_model=True)
    reduced = train_and_export_eagle3(target, os.path.join(root, "draft_reduced"), seqs, draft_vocab_size=32,
                                      seed=1, **common)
    full = train_and_export_eagle3(target, os.path.join(root, "draft_full"), seqs, aux_layer_ids=[0, 1, 2],
                                   export_rope_scaling={}, seed=2, **common)
    return DraftSetup(target, cfg, seqs, reduced, full)


def peaked_target(path, num_layers: int):
    """A tiny Qwen3 target with peaked next-token distributions (small residual writes, a large
    lm_head), so an EAGLE-3 head can learn it in a few steps. Returns (path, HFCheckpoint, CausalLM)."""
    from safetensors.torch import load_file, save_file

    from megatron_spec.models import HFCheckpoint
    from megatron_spec.rollout.native.model import CausalLM

    path = make_hf_checkpoint(
        path,
        family="qwen3",
        num_layers=num_layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=3,
        init_std=0.05,
    )
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = sd[name] * 0.2
        elif name == "lm_head.weight":
            sd[name] = sd[name] * 20.0
    save_file(sd, weights, metadata={"format": "pt"})
    ckpt = HFCheckpoint(path)
    target = CausalLM(ckpt.decoder_config).eval()
    target.load_weights((n, ckpt.get(n)) for n in ckpt.names())
    return path, ckpt, target
