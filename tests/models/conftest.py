"""Small real HF checkpoints shared by the model tests (made once per session)."""

from __future__ import annotations

import pytest

from megatron_spec.models.tiny import make_hf_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

CHECKPOINTS = {
    # name: (family, kwargs)
    "llama_sharded": ("llama", dict(max_shard_size="20KB")),
    "llama_tied_rope_scaling": ("llama", dict(tie_word_embeddings=True, max_position_embeddings=16384,
                                              extra_config={"rope_parameters": LLAMA3_ROPE})),
    "qwen2": ("qwen2", dict(vocab_size=90)),
    "qwen3": ("qwen3", dict(num_attention_heads=8, num_kv_heads=2, head_dim=8)),
}


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_checkpoint(root / name, family=fam, seed=i, **kw)
            for i, (name, (fam, kw)) in enumerate(CHECKPOINTS.items())}
