"""Under torchrun: build the Megatron policy from an HF checkpoint and check it against HF.

Checks, for each checkpoint in turn (each rank asserts; rank 0 writes the log-probs for cross-TP comparison):
  * HF -> Megatron -> HF export is bit-exact;
  * Megatron logits equal transformers' logits within 1e-5 (fp32);
  * token log-probs (vocab-parallel, temperature 0.7) equal log_softmax(HF logits / 0.7).
Usage: gpt_parity.py TP OUT_DIR CKPT_DIR [CKPT_DIR ...]: writes OUT_DIR/<basename of CKPT_DIR>.pt and prints
``OK <basename> tp=TP`` for each (one launch for all of them: a launch costs more than the checks).
"""

import os
import sys

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel


def main() -> None:
    tp, out_dir, ckpt_dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    info = init_parallel(tp_size=tp, seed=1)
    for ckpt_dir in ckpt_dirs:
        check(ckpt_dir, info, os.path.join(out_dir, os.path.basename(os.path.normpath(ckpt_dir)) + ".pt"))
    destroy_parallel()


def check(ckpt_dir: str, info, out_path: str) -> None:
    tp = info.tp_size
    label = os.path.basename(os.path.normpath(ckpt_dir))
    ckpt = HFCheckpoint(ckpt_dir)
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt)
    model.eval()

    # 1. round trip, bit-exact
    exported = export_hf_state_dict(model)
    names = ckpt.names() - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(exported) == names, (set(exported) ^ names)
    for name in names:
        ref = ckpt.get(name)
        assert torch.equal(exported[name], ref), f"round trip differs at {name}"

    # 2. logits vs transformers
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab_size, (3, 17), generator=g)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        shard = model(ids, pos, attention_mask=None)  # [B, S, V_local]
        ref_logits = hf(input_ids=ids).logits
    parts = [torch.empty_like(shard) for _ in range(info.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=info.tp_group)
    full = torch.cat(parts, dim=-1)[..., : cfg.vocab_size]
    err = (full - ref_logits).abs().max().item()
    assert err < 1e-5, f"logits differ from transformers by {err}"

    # 3. log-probs of the next tokens at T=0.7
    targets = ids[:, 1:]
    with torch.no_grad():
        lp = vocab_parallel_token_logprobs(shard[:, :-1], targets, vocab_size=cfg.vocab_size,
                                           temperature=0.7, tp_group=info.tp_group)
    ref_lp = torch.log_softmax(ref_logits[:, :-1] / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lp_err = (lp - ref_lp).abs().max().item()
    assert lp_err < 1e-5, f"log-probs differ from transformers by {lp_err}"
    if info.rank == 0:
        torch.save({"logprobs": lp, "logits_err": err, "lp_err": lp_err}, out_path)
        print(f"OK {label} tp={tp} logits_err={err:.2e} lp_err={lp_err:.2e}")


if __name__ == "__main__":
    main()
