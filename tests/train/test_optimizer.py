"""The policy's optimizer (train/optimizer.py) on megatron-core DDP: a --bf16 checkpoint (megatron-core
dist_checkpointing, as the trainer saves it) resumes from its fp32 main weights, not from the rounded bf16
weights."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads
from megatron_spec.train.optimizer import MixedPrecisionAdamW


@pytest.fixture(scope="module")
def parallel():
    info = init_parallel(tp_size=1, seed=0)
    yield info
    destroy_parallel()


def build(path: str):
    ckpt = HFCheckpoint(path)
    model = build_gpt_model(ckpt.decoder_config, params_dtype=torch.bfloat16)
    load_hf_weights(model, ckpt)
    ddp = wrap_ddp(model)
    opt = MixedPrecisionAdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-5)
    return model, ddp, opt, ckpt.decoder_config.vocab_size


def step(ddp, opt, vocab: int, seed: int) -> None:
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(seed))
    zero_grads(ddp)
    logits = ddp(ids, torch.arange(10).expand(2, 10), attention_mask=None)
    torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten()).backward()
    finalize_grads(ddp, as_param_grad=False)
    opt.step()


def sharded(model, opt) -> dict:
    msd = model.sharded_state_dict()
    return {"model": msd, "optimizer": opt.sharded_state_dict(msd)}


def test_bf16_resume_is_exact(parallel, hf_checkpoints, tmp_path):
    from megatron_spec.rl.checkpoint import dist_checkpointing

    dc = dist_checkpointing()
    path = hf_checkpoints["qwen3"]
    model, ddp, opt, vocab = build(path)
    assert opt.has_main_copies
    for i in range(3):
        step(ddp, opt, vocab, i)
    dc.save(sharded(model, opt), str(tmp_path))  # through files, as a checkpoint goes
    # the main weights hold what the bf16 weights lost: resuming from the weights alone would drop it
    assert any(not torch.equal(m, p.float()) for p, m in zip(opt.params, opt.main_params) if m is not p)

    model2, ddp2, opt2, _ = build(path)
    loaded = dc.load(sharded(model2, opt2), str(tmp_path))
    model2.load_state_dict(loaded["model"])
    opt2.load_sharded_state_dict(loaded["optimizer"])
    for a, b in zip(opt.main_params, opt2.main_params):
        assert torch.equal(a, b)
    step(ddp, opt, vocab, 9)
    step(ddp2, opt2, vocab, 9)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
