"""A draft model of the target's own family and tokenizer, distilled from its first layers.

The native engine's ``--spec-draft-kind model`` runs a small causal LM with the target's tokenizer
as the draft. For a pretrained target the cheapest such model is the target itself cut short: its
embedding, first ``num_layers`` decoder layers, final norm and (tied) head. Cut short it guesses
poorly (the later layers are what turn the first ones' states into a next-token distribution:
SmolLM2-135M's first 4 of 30 layers alone accept 1.04 tokens per verify step at k=3), so
:func:`distill_draft_model` trains the kept layers and the final norm on the target's own
next-token distributions over its own rollouts (the embedding and head stay the target's, frozen:
they are tied, and most of the parameters):

1. the target (transformers, no grad) runs once over the rollouts; per response token it keeps the
   ``teacher_topk`` largest log-probs and their ids (the cache: ``tokens x topk`` floats and ints);
2. the draft trains ``steps`` AdamW steps (cosine schedule after a warm-up) on batches of rollouts,
   with the soft cross-entropy ``-sum_i p_i log q_i`` over the teacher's top-k (the teacher's mass
   outside it, mostly tiny, carries no loss);
3. on held-out rollouts it reports, before and after, the expected acceptance of one drafted token
   at T=1 (``sum_v min(p_v, q_v)``, full vocabulary: the rejection sampler's acceptance
   probability) and the greedy agreement (the draft's argmax is the target's).

It knows no engine and no Megatron: HF checkpoints in and out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rollout = tuple[Sequence[int], Sequence[int]]


def _batches(rollouts: Sequence[Rollout], batch_size: int, pad_id: int):
    """``(ids [B, T], response mask [B, T] of the positions whose *next* token is a response token)``."""
    for i in range(0, len(rollouts), batch_size):
        chunk = rollouts[i : i + batch_size]
        seqs = [torch.tensor([*p, *r], dtype=torch.long) for p, r in chunk]
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        start = torch.tensor([len(p) for p, _ in chunk]).unsqueeze(1)
        end = torch.tensor([len(s) for s in seqs]).unsqueeze(1)
        # logits at position t predict token t+1: score t in [len(prompt) - 1, len(seq) - 2]
        yield ids, (pos >= start - 1) & (pos < end - 1)


@torch.no_grad()
def _teacher(target, rollouts: Sequence[Rollout], topk: int, batch_size: int, pad_id: int):
    """The target's top-k log-probs and ids at every scored position, per rollout (a list)."""
    out = []
    for ids, mask in _batches(rollouts, batch_size, pad_id):
        lp = torch.log_softmax(target(input_ids=ids).logits.float(), -1)
        vals, idx = lp.topk(topk, dim=-1)
        for b in range(ids.shape[0]):
            m = mask[b]
            out.append((vals[b, m].clone(), idx[b, m].clone()))
    return out


@torch.no_grad()
def evaluate_draft_model(draft, target, held_out: Sequence[Rollout], *, batch_size: int = 8,
                         pad_id: int = 0) -> dict[str, float]:
    """On ``held_out``: ``accept_t1`` (mean ``sum_v min(p_v, q_v)``: one drafted token's acceptance
    probability at T=1), ``top1`` (greedy agreement) and ``rows``."""
    acc = agree = rows = 0.0
    for ids, mask in _batches(held_out, batch_size, pad_id):
        p = torch.softmax(target(input_ids=ids).logits.float()[mask], -1)
        q = torch.softmax(draft(input_ids=ids).logits.float()[mask], -1)
        acc += float(torch.minimum(p, q).sum(-1).sum())
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        rows += int(mask.sum())
    return {"accept_t1": acc / rows, "top1": agree / rows, "rows": rows}


def truncate(model, num_layers: int):
    """``model`` (an HF causal LM) keeping only its first ``num_layers`` decoder layers, in place."""
    if not 1 <= num_layers <= len(model.model.layers):
        raise ValueError(f"num_layers must be in 1..{len(model.model.layers)}, got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model


def distill_draft_model(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    rollouts: Sequence[Rollout],
    held_out: Sequence[Rollout],
    *,
    num_layers: int = 4,
    steps: int = 200,
    lr: float = 5e-4,
    batch_size: int = 8,
    teacher_topk: int = 32,
    warmup_steps: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Distil the target in ``target_dir``, cut to its first ``num_layers`` layers, on its own
    ``rollouts`` (see the module docstring); save the draft model (HF checkpoint, the target's
    tokenizer and generation config) to ``out_dir`` atomically. Returns ``before`` / ``after``
    (:func:`evaluate_draft_model` on ``held_out``), ``curve`` (training loss every 10 steps) and the
    seconds of the teacher pass and of training."""
    import transformers

    if steps < 1:
        raise ValueError(f"distill_draft_model: steps must be >= 1, got {steps}")
    if not rollouts or not held_out:
        raise ValueError("distill_draft_model: needs training and held-out rollouts")
    target_dir = os.fspath(target_dir)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    draft = truncate(
        transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32), num_layers
    )
    for p in draft.model.embed_tokens.parameters():
        p.requires_grad_(False)
    for p in draft.lm_head.parameters():
        p.requires_grad_(False)  # tied to the embedding (or the target's own head): kept
    t0 = time.perf_counter()
    teacher = _teacher(target, rollouts, teacher_topk, batch_size, pad_id)
    teacher_s = time.perf_counter() - t0
    before = evaluate_draft_model(draft.eval(), target, held_out, batch_size=batch_size, pad_id=pad_id)
    run = _train(draft, rollouts, teacher, steps=steps, lr=lr, batch_size=batch_size,
                 warmup_steps=warmup_steps, seed=seed, pad_id=pad_id, progress=progress)
    after = evaluate_draft_model(draft.eval(), target, held_out, batch_size=batch_size, pad_id=pad_id)
    _save_atomically(draft, tok, target_dir, os.fspath(out_dir))
    return {
        "before": before,
        "after": after,
        "curve": run.curve,
        "teacher_seconds": teacher_s,
        "train_seconds": run.seconds,
        "rows": sum(int(t[0].shape[0]) for t in teacher),
    }


def _warmup_cosine(steps: int, warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier at step s: linear warm-up over ``warmup_steps``, then a cosine from 1 down to 0.1
    at ``steps``."""
    return lambda s: (
        min(1.0, (s + 1) / max(warmup_steps, 1))
        * (
            0.1
            + 0.9
            * 0.5
            * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup_steps) / max(1, steps - warmup_steps))))
        )
    )


@dataclasses.dataclass
class _Training:
    curve: list[tuple[int, float]]
    """``(step, loss)`` every 10 steps and at the last one."""
    seconds: float
    """Wall time of the optimizer steps."""


def _train(
    draft, rollouts: Sequence[Rollout], teacher: list[tuple[torch.Tensor, torch.Tensor]], *, steps: int,
    lr: float, batch_size: int, warmup_steps: int, seed: int, pad_id: int, progress: bool,
) -> _Training:
    """``steps`` AdamW steps of ``draft``'s trainable parameters on random batches of ``rollouts``
    against ``teacher`` (per rollout: top-k log-probs and ids ``[rows, k]``), soft cross-entropy."""
    from tqdm.auto import tqdm

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(steps, warmup_steps))
    g = torch.Generator().manual_seed(seed)
    draft.train()
    curve, t1 = [], time.perf_counter()
    bar = tqdm(range(steps), desc="draft model (distillation)", unit="step", disable=not progress)
    for s in bar:
        pick = torch.randperm(len(rollouts), generator=g)[:batch_size].tolist()
        (ids, mask), = _batches([rollouts[i] for i in pick], batch_size, pad_id)
        logq = torch.log_softmax(draft(input_ids=ids).logits.float()[mask], -1)  # [rows, V]
        t_lp = torch.cat([teacher[i][0] for i in pick])
        t_id = torch.cat([teacher[i][1] for i in pick])
        loss = -(t_lp.exp() * logq.gather(-1, t_id)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        bar.set_postfix(loss=f"{loss_value:.3f}")
        if s % 10 == 0 or s == steps - 1:
            curve.append((s, loss_value))
    return _Training(curve=curve, seconds=time.perf_counter() - t1)


def _save_atomically(draft, tok, target_dir: str, out_dir: str) -> None:
    """The draft, the tokenizer and the target's generation config into ``out_dir`` (replaced whole)."""
    tmp = out_dir + ".tmp"
    draft.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    gen = os.path.join(target_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f, open(os.path.join(tmp, "generation_config.json"), "w") as h:
            h.write(f.read())
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
