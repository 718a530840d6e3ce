"""Check that an HF checkpoint runs as a Megatron policy at a given TP size.

    torchrun --nproc_per_node 2 launch/check_policy.py --hf-checkpoint DIR \
        --tensor-model-parallel-size 2 [--compare-transformers]

Builds the megatron-core GPTModel, loads the HF weights into the TP shards, exports them
back and compares bit for bit, runs a forward on a few tokenised prompts and reports the
token log-probs; with ``--compare-transformers`` also the largest logit difference from
transformers' own model (fp32). Exits non-zero on any mismatch. Use it before a long run
on a new checkpoint or a new parallel layout.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel

PROMPTS = ["12+7=19", "The quick brown fox", "3*4=12; 12-5=7"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-checkpoint", required=True)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    ap.add_argument("--compare-transformers", action="store_true")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args()

    t0 = time.perf_counter()
    info = init_parallel(tp_size=args.tensor_model_parallel_size)
    ckpt = HFCheckpoint(args.hf_checkpoint)
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=args.make_vocab_size_divisible_by)
    load_hf_weights(model, ckpt)
    model.eval()
    load_s = time.perf_counter() - t0

    exported = export_hf_state_dict(model)
    mismatched = [n for n, t in exported.items() if not torch.equal(t, ckpt.get(n))]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.tensor([e + [tok.pad_token_id or 0] * (width - len(e)) for e in enc])
    lengths = torch.tensor([len(e) for e in enc])
    pos = torch.arange(width).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)
        lp = vocab_parallel_token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size,
                                           tp_group=info.tp_group)
    valid = torch.arange(width - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    report = {
        "architecture": cfg.architecture,
        "num_params": cfg.num_params,
        "tp": info.tp_size,
        "dp": info.dp_size,
        "load_s": round(load_s, 2),
        "roundtrip_bit_exact": not mismatched,
        "mean_token_logprob": round(lp[valid].mean().item(), 4),
    }
    if args.compare_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32).eval()
        parts = [torch.empty_like(logits) for _ in range(info.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=info.tp_group)
        full = torch.cat(parts, -1)[..., : cfg.vocab_size]
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        report["max_logit_diff_vs_transformers"] = (full - ref).abs().max().item()
    if info.rank == 0:
        print(json.dumps(report))
    destroy_parallel()
    ok = not mismatched and report.get("max_logit_diff_vs_transformers", 0.0) <= args.tolerance
    if not ok and info.rank == 0:
        print(f"FAILED: round-trip mismatches {mismatched[:3]}; see report above")
    return 0 if ok else 1


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
