"""Train and export an EAGLE-3 draft for a policy with NVIDIA ModelOpt.

    python launch/make_draft.py --target runs/demo/base --out runs/demo/eagle3 --task sum

The training set is the policy's own rollouts: prompts of the task, continued by the native
engine at the RL sampling temperature, so the draft learns the distribution it will have to
predict during GRPO. ModelOpt converts the target (transformers) to an EAGLE-3 model, trains
the draft with its training-time test, and exports it (``export_speculative_decoding``); the
export is what ``--spec-draft-path`` takes. RoPE scaling is exported as trained (the short
contexts of the demo do not need ModelOpt's default YaRN extension).

``--refine-steps N`` then trains the export (written to ``OUT.modelopt`` and kept) further from cached target
states
(``megatron_spec.draft.refine``: one target forward over the rollouts, N draft steps without one;
the online trainer's code), holding out the rollouts of every 16th prompt to report the expected
acceptance before and after. A run stopped during the refinement and started again with the same
settings and ``--rollouts`` reuses ``OUT.modelopt`` (its ``make_draft.json`` says what made it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_rollouts(args) -> list[tuple[int, list[int], list[int]]]:
    """The target's own answers to the prompts (``--samples-per-prompt`` each, at ``--temperature``):
    ``(prompt index, prompt ids, response ids)``."""
    from transformers import AutoTokenizer

    from megatron_spec.rl.data import load_prompts
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.target)
    spec = args.prompt_data or f"synthetic:{args.task}"
    examples = load_prompts(spec, prompt_key=args.prompt_key, num_synthetic=args.num_prompts,
                            seed=args.seed + 99)[: args.num_prompts]
    from megatron_spec.rl.prompting import encode_prompt

    # the trainer's encoding (rl/prompting.py): the token sequences GRPO will send, BOS and chat turns alike
    prompts = [
        encode_prompt(tok, e.prompt, chat_template=args.apply_chat_template, template=args.prompt_template)
        for e in examples
    ]
    context = max(map(len, prompts)) + args.max_new_tokens
    srv = EngineServer(
        EngineConfig(
            model_path=args.target,
            max_batch_size=64,
            context_length=context,
            seed=args.seed,
            dtype=args.dtype,
        )
    )
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    samples, stats = srv.generate([GenerateRequest(str(i), p, sp, n=args.samples_per_prompt)
                                   for i, p in enumerate(prompts)])
    print(
        f"[make_draft] {len(samples)} rollouts, {stats.num_tokens} tokens at {stats.tokens_per_s:.0f} "
        "tokens/s",
        file=sys.stderr,
        flush=True,
    )
    return [(int(s.request_id), prompts[int(s.request_id)], list(s.output_ids)) for s in samples]


STAMP = "make_draft.json"  # in a ModelOpt export: what made it (modelopt_stamp)


def modelopt_stamp(args, seqs: list[list[int]]) -> dict:
    """What a ModelOpt export of this run depends on: the target, the settings of the ModelOpt stage and a
    digest of
    the training sequences."""
    import hashlib

    digest = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()
    keys = ("steps", "batch_size", "lr", "ttt_steps", "draft_vocab_size", "seed")
    return {
        "target": os.path.abspath(args.target),
        **{k: getattr(args, k) for k in keys},
        "sequences": digest,
    }


def reusable_export(export_dir: str, stamp: dict) -> bool:
    """True where ``export_dir`` holds a finished ModelOpt export (written atomically) made with ``stamp``."""
    try:
        with open(os.path.join(export_dir, STAMP)) as f:
            return json.load(f) == stamp and os.path.isfile(os.path.join(export_dir, "config.json"))
    except (OSError, ValueError):
        return False


def train_other_kind(args, rollouts, held) -> int:
    """``--draft-kind mtp`` or ``model``: trained on ``rollouts``, measured on ``held`` (a JSON line)."""
    if args.draft_kind == "mtp":
        from megatron_spec.draft.refine import train_mtp
        from megatron_spec.parallel import init_parallel

        init_parallel(tp_size=1, seed=args.seed)
        res = train_mtp(args.target, rollouts, held, steps=args.steps, out_dir=args.out,
                        num_layers=args.mtp_num_layers, lr=args.lr, rows_per_step=args.refine_rows_per_step,
                        seed=args.seed, eval_every=max(args.steps // 4, 1))
        keys = [k for k in res["after"] if k.startswith("draft/eval_")]
    else:
        from megatron_spec.draft.distill import distill_draft_model

        res = distill_draft_model(args.target, args.out, rollouts, held, num_layers=args.draft_layers,
                                  steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
        keys = ["accept_t1", "top1"]
    rnd = lambda x: round(x, 4) if isinstance(x, float) else x
    print(
        json.dumps(
            {
                "out": args.out,
                "draft_kind": args.draft_kind,
                "steps": args.steps,
                "held_out_before": {k: rnd(res["before"][k]) for k in keys},
                "held_out_after": {k: rnd(res["after"][k]) for k in keys},
                **(
                    {"train_after": {k: rnd(res["train_after"][k]) for k in keys}}
                    if "train_after" in res
                    else {}
                ),
                "curve": [[a, rnd(b)] for a, b in res["curve"]],
                "seconds": {k: round(v, 1) for k, v in res.items() if k.endswith("_seconds")},
            }
        ),
        flush=True,
    )
    return 0


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
    ap.add_argument(
        "--dtype", default="auto", help="the engine's dtype for the rollouts (auto, float32, bfloat16)"
    )
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
    ap.add_argument(
        "--refine-steps",
        type=int,
        default=0,
        help="then this many steps from cached target states (megatron_spec.draft.refine); 0 = none",
    )
    ap.add_argument("--refine-lr", type=float, default=2e-3)
    ap.add_argument("--refine-rows-per-step", type=int, default=2048)
    ap.add_argument(
        "--refine-tv-weight",
        type=float,
        default=5.0,
        help="weight of the total-variation term 1 - sum min(p, q) beside the refinement's cross-entropy: "
        "trains for acceptance (docs/draft_training.md, 'Training for acceptance'); 0 = off",
    )
    ap.add_argument(
        "--rollouts",
        default=None,
        help="JSONL of the rollouts: read if it exists (no generation), else written after generating",
    )
    ap.add_argument(
        "--draft-kind",
        default="eagle3",
        choices=("eagle3", "mtp", "model"),
        help="eagle3: ModelOpt (then --refine-steps); mtp: megatron-core MTP depths trained from cached "
        "target states (--steps, --mtp-num-layers); model: the target's first --draft-layers "
        "layers distilled on its log-probs (--steps)",
    )
    ap.add_argument("--init", default=None,
                    help="eagle3: refine this export (--refine-steps) instead of training one with ModelOpt")
    ap.add_argument("--mtp-num-layers", type=int, default=1)
    ap.add_argument("--draft-layers", type=int, default=4, help="--draft-kind model: layers kept")
    args = ap.parse_args(argv)
    if args.refine_steps < 0:
        ap.error(f"--refine-steps must be >= 0, got {args.refine_steps}")
    if not args.refine_tv_weight >= 0:
        ap.error(f"--refine-tv-weight must be >= 0, got {args.refine_tv_weight}")
    if args.init and not (args.draft_kind == "eagle3" and args.refine_steps):
        ap.error("--init refines an EAGLE-3 export: it needs --draft-kind eagle3 and --refine-steps")

    import torch

    torch.manual_seed(args.seed)
    from megatron_spec.draft.refine import load_rollouts, save_rollouts

    if args.rollouts and os.path.isfile(args.rollouts):
        indexed = load_rollouts(args.rollouts)
        print(f"[make_draft] {len(indexed)} rollouts read from {args.rollouts}", file=sys.stderr, flush=True)
    else:
        indexed = generate_rollouts(args)
        if args.rollouts:
            save_rollouts(args.rollouts, indexed)
    context = max(len(p) + len(r) for _, p, r in indexed)
    rollouts = [(p, r) for _, p, r in indexed]
    # --refine-steps (and the MTP / draft-model kinds): the rollouts of every 16th prompt are held out
    # of all training to measure acceptance
    hold = bool(args.refine_steps) or args.draft_kind != "eagle3"
    held_out = [hold and i % 16 == 15 for i, _, _ in indexed]
    held = [r for r, h in zip(rollouts, held_out) if h and r[1]]
    rollouts = [r for r, h in zip(rollouts, held_out) if not h]
    if hold and not held:
        ap.error(
            f"the rollouts of every 16th prompt are held out: {len(set(i for i, _, _ in indexed))} prompts "
            f"give none"
        )
    if args.draft_kind != "eagle3":
        return train_other_kind(args, [r for r in rollouts if r[1]], held)
    seqs = [p + r for p, r in rollouts]
    # with a refinement to follow, the ModelOpt export goes beside --out (kept: the unrefined draft), so that
    # --out holds a draft only once it is the finished one (a caller that finds it there does not make it
    # again)
    export_dir = f"{os.path.normpath(args.out)}.modelopt" if args.refine_steps else args.out
    stamp = modelopt_stamp(args, seqs)
    if args.init:
        summary, export_dir = {"out": args.out, "init": args.init}, args.init
    elif args.refine_steps and reusable_export(export_dir, stamp):
        # a run stopped during the refinement: its ModelOpt stage (minutes) is not repeated
        print(
            f"[make_draft] the ModelOpt export in {export_dir} was made with these settings and rollouts: "
            "refining it",
            file=sys.stderr,
            flush=True,
        )
        summary = {"out": args.out, "modelopt_export": export_dir, "steps": args.steps, "reused": True}
    else:
        from megatron_spec.draft.modelopt_train import train_and_export_eagle3

        res = train_and_export_eagle3(
            args.target,
            export_dir,
            seqs,
            steps=args.steps,
            batch_size=args.batch_size,
            max_len=min(context, max(map(len, seqs))),
            ttt_steps=args.ttt_steps,
            lr=args.lr,
            draft_vocab_size=args.draft_vocab_size,
            seed=args.seed,
            export_rope_scaling={},
            progress=True,
        )
        summary = {"out": args.out, "modelopt_export": export_dir, "steps": args.steps,
                   "final_loss": res.losses[-1] if res.losses else None,
                   "final_top1": [round(a, 3) for a in res.accuracies[-1]] if res.accuracies else None,
                   "seconds": round(res.seconds, 1)}
        with open(os.path.join(export_dir, STAMP), "w") as f:
            json.dump(stamp, f)
    if args.refine_steps:
        from megatron_spec.draft.refine import refine_eagle3
        from megatron_spec.parallel import init_parallel

        init_parallel(tp_size=1, seed=args.seed)
        ref = refine_eagle3(
            args.target,
            export_dir,
            [r for r in rollouts if r[1]],
            held,
            out_dir=args.out,
            steps=args.refine_steps,
            lr=args.refine_lr,
            rows_per_step=args.refine_rows_per_step,
            ttt_steps=args.ttt_steps,
            tv_weight=args.refine_tv_weight,
            seed=args.seed,
            eval_every=max(args.refine_steps // 8, 1),
        )
        summary.update({"refine_steps": args.refine_steps, "refine_tv_weight": args.refine_tv_weight,
                        "held_out_tau_before": round(ref["before"]["draft/eval_tau"], 3),
                        "held_out_tau_after": round(ref["after"]["draft/eval_tau"], 3),
                        "held_out_accept_after": [round(ref["after"][f"draft/eval_accept{s}"], 3)
                                                  for s in range(args.ttt_steps)],
                        "held_out_tau_curve": [(s, round(t, 3)) for s, t in ref["curve"]],
                        "train_tau_after": round(ref["train_after"]["draft/eval_tau"], 3),
                        "refine_seconds": round(ref["capture_seconds"] + ref["train_seconds"], 1)})
        gap = ref["train_after"]["draft/eval_tau"] - ref["after"]["draft/eval_tau"]
        if gap > 0.1:
            print(
                f"[make_draft] the draft makes {gap:.2f} more tokens per verify step on its training "
                "rollouts than on "
                "held-out ones: it has memorised them; more rollouts (--num-prompts, --samples-per-prompt) "
                "would "
                f"raise its held-out acceptance more than more steps",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
