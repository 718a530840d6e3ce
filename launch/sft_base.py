"""Make the demo's base policy: a small model trained by SFT on a synthetic task.

    python launch/sft_base.py --out runs/demo/base --task sum --steps 600
    python launch/sft_base.py --out runs/math/base --data train.jsonl --prompt-key question \
        --eval-data interpolate.jsonl --reward math --steps 600

Starts from a freshly initialised HF checkpoint (transformers' own init, character
tokenizer), trains it as a megatron-core GPTModel on prompt + step-by-step solution (loss on
the solution tokens only), exports it back to an HF checkpoint, and reports its greedy
accuracy on held-out prompts. Runs under torchrun too (TP/DP), like the GRPO launcher.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output HF checkpoint directory")
    ap.add_argument("--task", default="sum")
    ap.add_argument(
        "--data",
        default=None,
        help="train on a prompt set (JSONL/Parquet/datasets folder, read as "
        "--prompt-data is) instead of --task: prompt -> answer",
    )
    ap.add_argument(
        "--eval-data", default=None, help="held-out prompt set for the final accuracy (with --data)"
    )
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--answer-key", default="answer")
    ap.add_argument(
        "--reward", default="synthetic", help="reward scoring the held-out accuracy (math with --data)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=96, help="response length of the held-out accuracy")
    ap.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--noisy-frac", type=float, default=0.0,
                    help="share of SFT targets with a systematic error (rl.tasks.corrupt_solution: the last "
                         "step one too high): the model learns the task and, at temperature 1, the error "
                         "with that share, which GRPO then removes")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 0.0 <= args.noisy_frac < 1.0:
        raise SystemExit(f"--noisy-frac {args.noisy_frac} must be in [0, 1)")
    if args.noisy_frac and (args.task != "sum" or args.data):
        raise SystemExit(f"--noisy-frac is defined for the sum task, not {args.data or args.task!r}")
    if bool(args.data) != bool(args.eval_data):
        raise SystemExit("--data and --eval-data go together (a prompt set and its held-out prompts)")
    import random

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
    from megatron_spec.models import HFCheckpoint, save_hf_checkpoint
    from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
    from megatron_spec.models.tiny import make_hf_checkpoint
    from megatron_spec.parallel import destroy_parallel, init_parallel
    from megatron_spec.rl.rollouts import Rollout, pack
    from megatron_spec.rl.synthetic_tasks import corrupt_solution, generate, iterate
    from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads

    info = init_parallel(tp_size=args.tensor_model_parallel_size, seed=args.seed)
    rank0 = info.rank == 0
    init_dir = tempfile.mkdtemp(prefix="sft-init-")
    if rank0:
        make_hf_checkpoint(init_dir, family=args.family, hidden_size=args.hidden_size,
                           intermediate_size=args.intermediate_size, num_layers=args.num_layers,
                           num_attention_heads=args.num_attention_heads, num_kv_heads=args.num_kv_heads,
                           seed=args.seed, max_position_embeddings=512, nontrivial_norms=False)
    if info.world_size > 1:
        box = [init_dir]
        torch.distributed.broadcast_object_list(box, src=0)
        init_dir = box[0]
    ckpt = HFCheckpoint(init_dir)
    cfg = ckpt.decoder_config
    tok = AutoTokenizer.from_pretrained(init_dir)
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt)
    ddp = wrap_ddp(model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    device = params[0].device  # the batches go where the model is (a GPU under torchrun on a GPU node)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    stream = (iterate(args.task, seed=args.seed + 1 + info.dp_rank) if not args.data
              else data_stream(args, seed=args.seed + 1 + info.dp_rank))
    noise_rng = random.Random(args.seed + 7919 + info.dp_rank)
    per_rank = args.batch_size // info.dp_size
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="sft", disable=not rank0, file=sys.stderr)
    for step in bar:
        examples = [next(stream) for _ in range(per_rank)]
        targets = [corrupt_solution(e, noise_rng) if noise_rng.random() < args.noisy_frac else e.solution
                   for e in examples]
        rows = [Rollout(0, 0, tok(e.prompt, add_special_tokens=False)["input_ids"],
                        tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [], "stop", 0)
                for e, t in zip(examples, targets)]
        for r in rows:
            r.engine_logprobs = [0.0] * len(r.response_ids)
        batch = pack(rows, tok.pad_token_id, device=device)
        zero_grads(ddp)
        logits = ddp(batch.input_ids, batch.position_ids, attention_mask=None)[:, :-1]
        lp = vocab_parallel_token_logprobs(
            logits, batch.targets, vocab_size=cfg.vocab_size, tp_group=info.tp_group
        )
        loss = -(lp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
        finalize_grads(ddp)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if rank0 and step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
    train_s = time.perf_counter() - t0
    state = export_hf_state_dict(model)
    if rank0:
        save_hf_checkpoint(args.out, state, ckpt.config_dict, copy_files_from=init_dir)
        if args.data:
            held_out = load_examples(args.eval_data, args)[:args.eval_prompts]
        else:
            held_out = generate(args.task, args.eval_prompts, seed=10_000 + args.seed)
        acc = greedy_accuracy(args.out, held_out, reward=args.reward, max_new_tokens=args.max_new_tokens)
        sampled = greedy_accuracy(args.out, held_out, temperature=1.0, reward=args.reward,
                                  max_new_tokens=args.max_new_tokens)
        print(
            json.dumps(
                {
                    "out": args.out,
                    "params": cfg.num_params,
                    "steps": args.steps,
                    "final_loss": loss.item(),
                    "train_s": round(train_s, 1),
                    "noisy_frac": args.noisy_frac,
                    "greedy_accuracy": acc,
                    "sampled_accuracy_t1": sampled,
                }
            ),
            flush=True,
        )
    destroy_parallel()
    return 0


def load_examples(spec: str, args):
    """A prompt set as SFT examples: the target is the answer column, as it is."""
    from megatron_spec.rl.data import load_prompts
    from megatron_spec.rl.synthetic_tasks import Example

    return [Example(e.prompt, e.answer, e.answer)
            for e in load_prompts(spec, prompt_key=args.prompt_key, answer_key=args.answer_key)]


def data_stream(args, seed: int):
    """The prompt set's examples in a fresh seeded order every epoch."""
    import random

    examples = load_examples(args.data, args)
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in order:
            yield examples[i]


def greedy_accuracy(model_dir: str, examples, temperature: float = 0.0, reward: str = "synthetic",
                    max_new_tokens: int = 96) -> float:
    """Share of held-out prompts the exported checkpoint solves (native engine; greedy unless a
    temperature is given)."""
    from transformers import AutoTokenizer

    from megatron_spec.rl.rewards import get_reward
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    reward_fn = get_reward(reward)
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    reqs = [GenerateRequest(str(i), tok(e.prompt, add_special_tokens=False)["input_ids"], sp)
            for i, e in enumerate(examples)]
    longest = max(len(r.input_ids) for r in reqs)
    srv = EngineServer(EngineConfig(model_path=model_dir, max_batch_size=32,
                                    context_length=max(64, longest) + max_new_tokens))
    samples, _ = srv.generate(reqs, seed=0)
    texts = tok.batch_decode([s.output_ids for s in samples], skip_special_tokens=True)
    return sum(reward_fn(e.prompt, t, e.answer) for e, t in zip(examples, texts)) / len(examples)


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
