"""Cost of capture and of online draft training, side by side in one run, on a demo-sized policy.

    python benchmarks/bench_capture.py [--hidden 512 --layers 8 --ffn 1536 --vocab 4096]
        [--batch 16 --prompt 64 --response 192] [--ttt-steps 3] [--draft-rows-per-step 1024]
        [--repeats 7] [--threads 1]

Measured on one Megatron policy (TP=1), interleaved so that machine noise hits both sides alike,
median of ``--repeats``:

* logprob forward (``2 * repeats`` pairs): the GRPO old-log-prob recompute (no grad; forward +
  vocab-parallel token log-probs), alone and inside ``Capture.record`` (EAGLE-3 features of
  ModelOpt's default aux layers, embeddings, top-32 teacher on a reduced draft vocabulary, bf16
  storage) plus ``take``.
  ``capture_overhead_fraction`` = median over ABBA-ordered pairs of with / without - 1;
  ``capture_hook_fraction`` = time spent inside the hooks / without (the same cost measured from
  the inside, immune to the machine's noise).
* policy training step: forward + backward of a GRPO-like loss + AdamW step on the same batch.
* draft training step: ``Eagle3Trainer.train_step`` (``--ttt-steps`` unroll, soft CE) on the
  captured rows, with the per-step row budget ``--draft-rows-per-step`` (whole segments drawn at
  random) and with all rows. ``draft_train_fraction`` = budgeted draft step / policy step.

The EAGLE-3 head has the layout ModelOpt exports for this target (intermediate size, heads and
head dim of the target; random weights: cost does not depend on them). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(args, tmp: str):
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.models.tiny import make_hf_checkpoint

    path = make_hf_checkpoint(
        os.path.join(tmp, "target"),
        family="qwen3",
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=1024,
        seed=0,
    )
    ckpt = HFCheckpoint(path)
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=128)
    load_hf_weights(model, ckpt)
    return model, cfg


def make_trainer(cfg, args, rows: int | None):
    from megatron_spec.draft.eagle3 import Eagle3Config, Eagle3Head
    from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer

    ecfg = Eagle3Config.for_target(cfg, args.draft_vocab, max_position_embeddings=1024)
    torch.manual_seed(1)
    head = Eagle3Head(ecfg)
    with torch.no_grad():
        ids = torch.randperm(cfg.vocab_size)[: args.draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(args.draft_vocab))
    return Eagle3Trainer(
        head,
        DraftTrainerConfig(
            lr=1e-4, ttt_steps=args.ttt_steps, max_rows_per_step=rows, micro_batch_rows=args.micro_batch_rows
        ),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-rows-per-step", type=int, default=1024)
    ap.add_argument("--micro-batch-rows", type=int, default=4096)
    ap.add_argument("--teacher-topk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 by default: on a shared machine 2 threads spin against other jobs)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from megatron_spec._ext import cpu_facts
    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
    from megatron_spec.parallel import destroy_parallel, init_parallel

    init_parallel(tp_size=1, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = build(args, tmp)
    g = torch.Generator().manual_seed(0)
    s = args.prompt + args.response
    ids = torch.randint(4, cfg.vocab_size, (args.batch, s), generator=g)
    pos = torch.arange(s).expand_as(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, args.prompt :] = True
    tmask = mask[:, 1:].float()
    adv = torch.randn(args.batch, generator=g)

    budgeted = make_trainer(cfg, args, args.draft_rows_per_step)
    unbudgeted = make_trainer(cfg, args, None)
    capture = Capture.for_trainer(
        budgeted, CaptureConfig(teacher_topk=args.teacher_topk, storage_dtype="bfloat16")
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def logprob_forward():
        with torch.no_grad():
            logits = model(ids, pos, attention_mask=None)
            return vocab_parallel_token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size)

    def captured_forward():
        with capture.record(model, mask):
            out = logprob_forward()
        return out, capture.take()

    def policy_step(old):
        opt.zero_grad(set_to_none=True)
        logits = model(ids, pos, attention_mask=None)
        lp = vocab_parallel_token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size)
        loss = -((lp - old).exp() * adv.unsqueeze(1) * tmask).sum() / tmask.sum()
        loss.backward()
        opt.step()

    def timed(fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        return time.perf_counter() - t0, out

    old, cache = captured_forward()  # warm-up of every path
    policy_step(old)
    budgeted.train_step(cache)
    unbudgeted.train_step(cache)
    t = {k: [] for k in ("plain", "captured", "hooks", "policy", "draft", "draft_all")}
    ratios = []
    for r in range(2 * args.repeats):  # forward pairs in ABBA order: drifts in machine load cancel
        order = ("plain", "captured") if r % 2 == 0 else ("captured", "plain")
        pair = {}
        for kind in order:
            if kind == "plain":
                pair[kind] = timed(logprob_forward)[0]
            else:
                capture.reset_metrics()
                pair[kind], (old, cache) = timed(captured_forward)
                t["hooks"].append(capture.metrics()["capture/seconds"])
        t["plain"].append(pair["plain"])
        t["captured"].append(pair["captured"])
        ratios.append(pair["captured"] / pair["plain"] - 1.0)
    for _ in range(args.repeats):
        t["policy"].append(timed(policy_step, old)[0])
        t["draft"].append(timed(budgeted.train_step, cache)[0])
        t["draft_all"].append(timed(unbudgeted.train_step, cache)[0])
    med = {k: statistics.median(v) for k, v in t.items()}
    last = budgeted.train_step(cache)
    result = {
        "capture_overhead_fraction": round(statistics.median(ratios), 4),
        "capture_hook_fraction": round(med["hooks"] / med["plain"], 4),
        "draft_train_fraction": round(med["draft"] / med["policy"], 4),
        "draft_train_fraction_all_rows": round(med["draft_all"] / med["policy"], 4),
        "logprob_forward_s": round(med["plain"], 4),
        "logprob_forward_captured_s": round(med["captured"], 4),
        "policy_train_step_s": round(med["policy"], 4),
        "draft_train_step_s": round(med["draft"], 4),
        "draft_train_step_all_rows_s": round(med["draft_all"], 4),
        "draft_rows_per_step": int(last["draft/rows"]),
        "captured_rows": cache.num_rows,
        "cache_bytes": cache.nbytes,
        "ttt_steps": args.ttt_steps,
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "draft_vocab": args.draft_vocab,
            "batch": args.batch,
            "seq": s,
            "response": args.response,
        },
        "threads": args.threads,
        "repeats": args.repeats,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **cpu_facts(),
    }
    destroy_parallel()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
