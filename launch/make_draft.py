"""Train and export an EAGLE-3 draft for a policy with NVIDIA ModelOpt.

    python launch/make_draft.py --target runs/demo/base --out runs/demo/eagle3 --task sum

The training set is the policy's own rollouts: prompts of the task, continued by the native
engine at the RL sampling temperature, so the draft learns the distribution it will have to
predict during GRPO. ModelOpt converts the target (transformers) to an EAGLE-3 model, trains
the draft with its training-time test, and exports it (``export_speculative_decoding``); the
export is what ``--spec-draft-path`` takes. RoPE scaling is exported as trained (the short
contexts of the demo do not need ModelOpt's default YaRN extension).

``--refine-steps N`` then trains the export further from cached target states
(``megatron_spec.draft.refine``: one target forward over the rollouts, N draft steps without one;
the online trainer's code), holding out the rollouts of every 16th prompt to report the expected
acceptance before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="policy HF checkpoint")
    ap.add_argument("--out", required=True, help="output directory (ModelOpt export)")
    ap.add_argument("--task", default="sum", help="synthetic task whose prompts are continued")
    ap.add_argument("--prompt-data", default=None, help="or a JSONL/Parquet prompt set (column 'prompt')")
    ap.add_argument("--prompt-key", default="prompt", help="the prompt column of --prompt-data")
    ap.add_argument("--apply-chat-template", action="store_true",
                    help="format each prompt as a user turn with the target's chat template (a chat model)")
    ap.add_argument("--prompt-template", default=None,
                    help="each prompt becomes this text with {prompt} replaced, as GRPO's --prompt-template")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype for the rollouts (auto, float32, bfloat16)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--samples-per-prompt", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refine-steps", type=int, default=0,
                    help="then this many steps from cached target states (megatron_spec.draft.refine); 0 = none")
    ap.add_argument("--refine-lr", type=float, default=2e-3)
    ap.add_argument("--refine-rows-per-step", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.refine_steps < 0:
        ap.error(f"--refine-steps must be >= 0, got {args.refine_steps}")

    import torch
    from transformers import AutoTokenizer

    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.rl.data import load_prompts
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.target)
    spec = args.prompt_data or f"synthetic:{args.task}"
    examples = load_prompts(spec, prompt_key=args.prompt_key, num_synthetic=args.num_prompts,
                            seed=args.seed + 99)[: args.num_prompts]
    if args.apply_chat_template:  # the chat model's own turns: what it will be asked to continue in GRPO
        from megatron_spec.rl.prompting import encode_prompt

        prompts = [encode_prompt(tok, e.prompt, chat_template=True, template=args.prompt_template) for e in examples]
    else:
        from megatron_spec.rl.prompting import apply_prompt_template

        prompts = [tok(apply_prompt_template(args.prompt_template, e.prompt), add_special_tokens=False)["input_ids"]
                   for e in examples]
    context = max(map(len, prompts)) + args.max_new_tokens
    srv = EngineServer(EngineConfig(model_path=args.target, max_batch_size=64, context_length=context, seed=args.seed,
                                    dtype=args.dtype))
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    samples, stats = srv.generate([GenerateRequest(str(i), p, sp, n=args.samples_per_prompt)
                                   for i, p in enumerate(prompts)])
    rollouts = [(prompts[int(s.request_id)], list(s.output_ids)) for s in samples]
    # --refine-steps: the rollouts of every 16th prompt are held out (of both trainings) to measure acceptance
    held_out = [bool(args.refine_steps) and int(s.request_id) % 16 == 15 for s in samples]
    held = [r for r, h in zip(rollouts, held_out) if h and r[1]]
    rollouts = [r for r, h in zip(rollouts, held_out) if not h]
    if args.refine_steps and not held:
        ap.error(f"--refine-steps holds out every 16th prompt's rollouts: {len(prompts)} prompts give none")
    seqs = [p + r for p, r in rollouts]
    print(f"[make_draft] {len(seqs)} rollouts, {stats.num_tokens} tokens at {stats.tokens_per_s:.0f} tokens/s",
          file=sys.stderr, flush=True)
    del srv
    res = train_and_export_eagle3(args.target, args.out, seqs, steps=args.steps, batch_size=args.batch_size,
                                  max_len=min(context, max(map(len, seqs))), ttt_steps=args.ttt_steps, lr=args.lr,
                                  draft_vocab_size=args.draft_vocab_size, seed=args.seed, export_rope_scaling={},
                                  progress=True)
    summary = {"out": args.out, "steps": args.steps, "final_loss": res.losses[-1] if res.losses else None,
               "final_top1": [round(a, 3) for a in res.accuracies[-1]] if res.accuracies else None,
               "seconds": round(res.seconds, 1)}
    if args.refine_steps:
        from megatron_spec.draft.refine import refine_eagle3
        from megatron_spec.parallel import init_parallel

        init_parallel(tp_size=1, seed=args.seed)
        ref = refine_eagle3(args.target, args.out, [r for r in rollouts if r[1]], held, steps=args.refine_steps,
                            lr=args.refine_lr, rows_per_step=args.refine_rows_per_step, ttt_steps=args.ttt_steps,
                            seed=args.seed)
        summary.update({"refine_steps": args.refine_steps,
                        "held_out_tau_before": round(ref["before"]["draft/eval_tau"], 3),
                        "held_out_tau_after": round(ref["after"]["draft/eval_tau"], 3),
                        "held_out_accept_after": [round(ref["after"][f"draft/eval_accept{s}"], 3)
                                                  for s in range(args.ttt_steps)],
                        "refine_seconds": round(ref["capture_seconds"] + ref["train_seconds"], 1)})
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
