"""The ceiling a reduced draft vocabulary puts on speculative acceptance at T=1 (issue 28).

A draft with vocabulary ``Vd`` (``d2t``: ModelOpt's frequency calibration on the training data) can
only propose tokens of ``Vd``. Verified against the target's distribution ``p`` over the whole
vocabulary, the best any such draft can do at one position is ``q = p / c`` on ``Vd``, accepted
with probability ``c = sum_{v in Vd} p(v)`` (the target's mass on the draft vocabulary). This script
measures ``c`` on held-out answers for several ``Vd``, and the k-token chain ceiling
``1 + c_t + c_t c_{t+1} + ...`` (the expected tokens per verify step of a perfect draft of that
vocabulary along the sampled answers), next to the target's own uncertainty (mean top-1 probability,
entropy): what separates a learned draft's measured acceptance from what its vocabulary allows.

    python benchmarks/bench_draft_vocab.py --model smollm2 [--draft DRAFT]    # ~6 min (+4 with a draft) on 2
    cores

With ``--draft`` (a ModelOpt EAGLE-3 export of the target) it also measures what that draft reaches
against the ceiling, and checks that the engine agrees with the evaluation:

* the held-out evaluation (``Eagle3Trainer.evaluate`` on the target states captured over the same
  held-out answers): acceptance per position and tokens per verify step at k, against the target's
  own distribution and, as the evaluation computed it before ``teacher_log_mass``, against the teacher
  renormalised over the draft vocabulary;
* the engine at k=1, T=1 on other held-out questions, and the evaluation on the engine's own outputs:
  at each verify step the one draft is accepted with probability ``sum_{v in Vd} min(p, q)``, so the
  engine's acceptance frequency must equal the mean predicted probability over its steps (the
  difference in standard errors is printed).

The data are the drafts' own (``bench_rollout.py --model smollm2``): the target's T=1 answers to
mathematics_dataset's ``algebra__linear_1d`` train-easy questions in the chat template calibrate
``d2t`` (prompt and answer tokens, as ``make_draft.py`` does); the answers to held-out interpolate
questions are scored. The answers are kept in the work directory and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _real_model import ROOT, questions

sys.path.insert(0, ROOT)


def answers(target: str, prompts: dict[str, list[int]], samples: int, max_new_tokens: int, dtype: str,
            path: str) -> dict[str, list[list[int]]]:
    """``samples`` T=1 answers of the target to each prompt (by key), read from ``path`` if it holds them."""
    if os.path.isfile(path):
        with open(path) as f:
            kept = json.load(f)
        if set(kept) == set(prompts) and all(len(v) == samples for v in kept.values()):
            print(f"[vocab] answers read from {path}", file=sys.stderr)
            return kept
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    srv = EngineServer(EngineConfig(model_path=target, max_batch_size=64, seed=0, dtype=dtype,
                                    context_length=max(map(len, prompts.values())) + max_new_tokens))
    t0 = time.perf_counter()
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    out, stats = srv.generate([GenerateRequest(k, p, sp, n=samples) for k, p in prompts.items()])
    print(f"[vocab] {len(out)} answers, {stats.num_tokens} tokens in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    got: dict[str, list[list[int]]] = {k: [] for k in prompts}
    for s in out:
        got[s.request_id].append(list(s.output_ids))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(got, f)
    os.replace(tmp, path)
    return got


@torch.no_grad()
def target_probs(target: str, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """The target's T=1 distribution (fp32, transformers) at each answer position: ``[n, V]`` per answer."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = []
    for prompt, answer in pairs:
        logits = model(torch.tensor([prompt + answer])).logits[
            0, len(prompt) - 1 : len(prompt) + len(answer) - 1
        ]
        out.append(logits.float().softmax(-1))
    return out


def chain_ceiling(coverage: list[torch.Tensor], k: int) -> float:
    """Mean over the chains that fit in an answer of ``1 + sum_j prod_{s<=j} c_{r+s}``."""
    from megatron_spec.draft.losses import chain_acceptance_rows

    taus = [chain_acceptance_rows(c.expand(k, -1).unsqueeze(1)).flatten() for c in coverage if c.numel() >= k]
    return float(torch.cat(taus).mean())


def draft_checks(
    target: str,
    draft: str,
    held: list[tuple[list[int], list[int]]],
    engine_prompts: list[list[int]],
    samples: int,
    max_new_tokens: int,
    k: int,
    dtype: str,
) -> dict:
    """``--draft``: the evaluation on ``held`` and the engine-vs-evaluation check (module docstring)."""
    import math

    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.draft.refine import capture_rollouts
    from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    srv = EngineServer(
        EngineConfig(
            model_path=target,
            draft_kind="eagle3",
            draft_path=draft,
            num_draft_tokens=1,
            max_batch_size=16,
            seed=1,
            dtype=dtype,
            context_length=max(map(len, engine_prompts)) + max_new_tokens,
        )
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    outs, _ = srv.generate([GenerateRequest(str(i), p, sp, n=samples) for i, p in enumerate(engine_prompts)])
    del srv
    outs = [s for s in outs if len(s.output_ids) >= 2]

    init_parallel(tp_size=1, seed=0)
    try:
        ckpt = HFCheckpoint(target)
        model = build_gpt_model(ckpt.decoder_config)
        load_hf_weights(model, ckpt)
        trainer = Eagle3Trainer.from_modelopt(draft, ckpt.decoder_config, DraftTrainerConfig(ttt_steps=k))
        capture = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=None, storage_dtype="float32",
                                                             max_bytes=1 << 40))
        held_cache = capture_rollouts(model, capture, held)
        ev = trainer.evaluate(held_cache, k)
        held_cache.teacher_log_mass = None
        ev_renorm = trainer.evaluate(held_cache, k)
        cache = capture_rollouts(
            model, capture, [(engine_prompts[int(s.request_id)], s.output_ids) for s in outs]
        )
        alpha = trainer.acceptance(cache, 1)[0][0]
    finally:
        destroy_parallel()
    scored = cache.scored_mask()
    accepted, predicted = [], []
    for si, s in enumerate(outs):
        rows = [r for r in range(int(cache.cu_seqlens[si]), int(cache.cu_seqlens[si + 1])) if bool(scored[r])]
        for i, a in s.draft_starts():  # row j pairs response token j with the state before it, predicts j + 1
            accepted.append(a)
            predicted.append(float(alpha[rows[i - 1]]))
    n = len(accepted)
    se = math.sqrt(sum((x - p) ** 2 for x, p in zip(accepted, predicted))) / n
    return {f"draft_eval_tau_k{k}": round(ev["draft/eval_tau"], 3),
            f"draft_eval_accept_k{k}": [round(ev[f"draft/eval_accept{s}"], 3) for s in range(k)],
            f"draft_eval_tau_k{k}_renormalised": round(ev_renorm["draft/eval_tau"], 3),
            "engine_k1_steps": n, "engine_k1_accepted": round(sum(accepted) / n, 4),
            "engine_k1_predicted": round(sum(predicted) / n, 4), "engine_k1_se": round(se, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="megatron-spec fetch-model name, HF folder or Hub id")
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--train-prompts", type=int, default=256, help="train-easy questions calibrating d2t")
    ap.add_argument("--held-prompts", type=int, default=32, help="interpolate questions scored")
    ap.add_argument("--samples", type=int, default=2, help="T=1 answers per question")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--vocab-sizes", default="256,512,1024,2048,4096")
    ap.add_argument("--k", type=int, default=3, help="draft length of the chain ceiling")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype for the answers")
    ap.add_argument(
        "--draft", default=None, help="a ModelOpt EAGLE-3 export: its acceptance and the engine check"
    )
    ap.add_argument("--engine-prompts", type=int, default=32,
                    help="with --draft: interpolate questions (after the scored ones) for the engine check")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from megatron_spec.draft.modelopt_train import calibrate_d2t
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rl.prompting import encode_prompt

    target = resolve_model(args.model, log=lambda m: print(f"[setup] {m}", file=sys.stderr))
    tok = AutoTokenizer.from_pretrained(target)
    enc = lambda q: encode_prompt(tok, q, chat_template=True, template=None)
    prompts = {
        f"train{i}": enc(q)
        for i, q in enumerate(questions(args.work_dir, "train-easy")[: args.train_prompts])
    }
    prompts |= {
        f"held{i}": enc(q) for i, q in enumerate(questions(args.work_dir, "interpolate")[: args.held_prompts])
    }
    name = os.path.basename(os.path.normpath(target))
    os.makedirs(os.path.join(args.work_dir, name), exist_ok=True)
    path = os.path.join(args.work_dir, name,
                        f"vocab_answers_{args.train_prompts}_{args.held_prompts}_{args.samples}x{args.max_new_tokens}.json")
    got = answers(target, prompts, args.samples, args.max_new_tokens, args.dtype, path)
    train = [prompts[key] + a for key in prompts if key.startswith("train") for a in got[key]]
    held = [(prompts[key], a) for key in prompts if key.startswith("held") for a in got[key] if len(a) >= 2]
    probs = target_probs(target, held)
    allp = torch.cat(probs)
    entropy = float(-(allp * allp.clamp_min(1e-30).log()).sum(-1).mean())
    distinct = len({t for s in train for t in s})
    res: dict = {"model": name, "held_rows": int(allp.shape[0]), "distinct_train_tokens": distinct,
                 "target_top1_prob": round(float(allp.max(-1).values.mean()), 4),
                 "target_entropy_nats": round(entropy, 3)}
    print(
        f"held-out rows {allp.shape[0]}: the target's top-1 probability {res['target_top1_prob']:.3f} on "
        "average, "
        f"entropy {entropy:.2f} nats; {distinct} distinct tokens in the calibration data"
    )
    print(f"\n| draft vocabulary | mean mass on it | 10th percentile "
          f"| k={args.k} chain ceiling (tokens per verify) |")
    print("|---|---|---|---|")
    sizes = sorted({min(int(s), distinct) for s in args.vocab_sizes.split(",")})
    for vd in sizes:
        ids = torch.arange(vd) + calibrate_d2t(train, vd)
        cov = [p[:, ids].sum(-1) for p in probs]
        c = torch.cat(cov)
        tau = chain_ceiling(cov, args.k)
        res[f"coverage_{vd}"] = round(float(c.mean()), 4)
        res[f"chain_ceiling_k{args.k}_{vd}"] = round(tau, 3)
        print(f"| {vd} | {c.mean():.3f} | {c.quantile(0.1):.3f} | {tau:.2f} |", flush=True)
    if args.draft:
        inter = questions(args.work_dir, "interpolate")[
            args.held_prompts : args.held_prompts + args.engine_prompts
        ]
        d = draft_checks(
            target,
            args.draft,
            held,
            [enc(q) for q in inter],
            args.samples * 2,
            args.max_new_tokens,
            args.k,
            args.dtype,
        )
        res.update(d)
        k = args.k
        print(f"\nthe draft {args.draft} on the same held-out answers: tokens per verify step at k={k} "
              f"{d[f'draft_eval_tau_k{k}']:.3f} (per position {d[f'draft_eval_accept_k{k}']}; against the "
              f"renormalised teacher {d[f'draft_eval_tau_k{k}_renormalised']:.3f})")
        z = (d["engine_k1_accepted"] - d["engine_k1_predicted"]) / max(d["engine_k1_se"], 1e-12)
        print(
            f"engine, k=1, T=1, {d['engine_k1_steps']} verify steps: accepted {d['engine_k1_accepted']:.4f}, "
            "the "
            f"evaluation on its outputs predicts {d['engine_k1_predicted']:.4f} ({z:+.1f} standard errors)"
        )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
