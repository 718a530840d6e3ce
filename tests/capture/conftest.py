"""A small target checkpoint and a TP=1 Megatron policy built from it (per module)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.models.tiny import make_hf_checkpoint


@pytest.fixture(scope="session")
def capture_target(tmp_path_factory) -> str:
    # 8 layers: ModelOpt's default aux layers sorted({1, L//2-1, L-4}) = (1, 3, 4) are distinct
    return make_hf_checkpoint(
        tmp_path_factory.mktemp("capture") / "target",
        family="qwen3",
        num_layers=8,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=11,
        init_std=0.05,
    )


@pytest.fixture(scope="module")
def policy(capture_target):
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and far faster on a loaded machine
    init_parallel(tp_size=1, seed=0)
    ckpt = HFCheckpoint(capture_target)
    model = build_gpt_model(ckpt.decoder_config, vocab_divisible_by=8)
    load_hf_weights(model, ckpt)
    model.eval()
    yield model
    destroy_parallel()
    torch.set_num_threads(threads)
