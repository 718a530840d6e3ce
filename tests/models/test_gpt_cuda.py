"""The Megatron policy on a GPU against transformers on the same GPU (in-process, TP=1).

Issue 27: nothing had run on a GPU. fp32 logits must equal transformers' within 1e-4 relative (TF32 is
off for matmuls by default), bf16 logits within bf16 rounding; the HF round trip stays bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def parallel():
    info = init_parallel(tp_size=1, seed=0)
    yield info
    destroy_parallel()


@pytest.mark.parametrize("name", ["qwen3", "llama_tied_rope_scaling", "qwen2"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_logits_equal_transformers(parallel, hf_checkpoints, name, dtype, tol):
    import transformers

    ckpt = HFCheckpoint(hf_checkpoints[name])
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg, params_dtype=dtype, vocab_divisible_by=8)
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"cuda"}
    load_hf_weights(model, ckpt)
    model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoints[name], dtype=dtype).cuda().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab_size, (3, 17), generator=g).cuda()
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    with torch.no_grad():
        ours = model(ids, pos, attention_mask=None)[..., : cfg.vocab_size].float()
        ref = hf(input_ids=ids).logits.float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < tol, f"{name} {dtype}: logits differ from transformers by {rel:.2e} (relative)"
    if dtype == torch.float32:
        exported = export_hf_state_dict(model)
        for hf_name, t in exported.items():
            assert torch.equal(t.cpu(), ckpt.get(hf_name)), f"round trip differs at {hf_name}"
