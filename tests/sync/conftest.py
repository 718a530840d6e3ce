"""Small real checkpoints for the weight-streaming tests (made once per session).

* ``qwen3`` / ``qwen3_other``: the same architecture with different weights (the engine starts
  on one, the sync must make it hold the other).
* ``llama_tied``: Llama with tied embeddings (no ``lm_head`` on the wire); ``qwen2``: q/k/v biases.
* ``eagle3``: an EAGLE-3 export (ModelOpt layout, reduced vocabulary with ``d2t``) for ``qwen3``,
  with random weights written by our own ``save_eagle3`` (no training needed to test transport).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_spec.models.hf_config import DecoderConfig
from megatron_spec.models.tiny import make_hf_checkpoint

QWEN3 = dict(family="qwen3", num_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_kv_heads=2, init_std=0.05)


@dataclasses.dataclass
class Ckpts:
    qwen3: str
    qwen3_other: str
    llama_tied: str
    qwen2: str
    eagle3: str
    eagle3_other: str
    cfg: DecoderConfig


def random_eagle3(target_cfg: DecoderConfig, seed: int, draft_vocab: int = 40):
    """An :class:`Eagle3Head` for ``target_cfg`` with every tensor random (norms around 1)."""
    from megatron_spec.draft.eagle3 import Eagle3Head
    from megatron_spec.draft.eagle3_config import Eagle3Config

    cfg = Eagle3Config(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=96,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=(0, 1),
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    head = Eagle3Head(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        ids = torch.randperm(target_cfg.vocab_size, generator=g)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> Ckpts:
    from megatron_spec.draft.modelopt_io import save_eagle3

    root = tmp_path_factory.mktemp("sync")
    a = make_hf_checkpoint(root / "qwen3", seed=11, **QWEN3)
    b = make_hf_checkpoint(root / "qwen3_other", seed=12, **QWEN3)
    llama = make_hf_checkpoint(root / "llama_tied", family="llama", num_layers=2, hidden_size=64,
                               intermediate_size=128, num_attention_heads=4, num_kv_heads=2,
                               tie_word_embeddings=True, seed=13)
    qwen2 = make_hf_checkpoint(
        root / "qwen2",
        family="qwen2",
        num_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=14,
    )
    cfg = DecoderConfig.from_pretrained(a)
    save_eagle3(random_eagle3(cfg, 21), root / "eagle3")
    save_eagle3(random_eagle3(cfg, 22), root / "eagle3_other")
    return Ckpts(
        str(a), str(b), str(llama), str(qwen2), str(root / "eagle3"), str(root / "eagle3_other"), cfg
    )
