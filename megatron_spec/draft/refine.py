"""Offline refinement of an EAGLE-3 draft from cached target states: many draft steps per target forward.

ModelOpt's trainer (``megatron_spec.draft.modelopt_train``) runs the whole target forward in every
optimizer step to get the features the draft reads. Those features do not change while the target
is frozen, so after a ModelOpt export this module:

1. runs the target (a megatron-core GPTModel) *once* over the training rollouts inside
   ``Capture.record``, the capture hooks of online training, which keep per response token the
   EAGLE-3 features, the token embeddings and the target's top-k next-token log-probs on the draft
   vocabulary (the prompt rows as attended-to context: the engine's draft sees its prefill);
2. trains the exported head on that cache with :class:`~megatron_spec.draft.trainer.Eagle3Trainer`,
   the same training-time-test unroll and soft cross-entropy as online training, for as many steps
   as asked (each reads ``rows_per_step`` cached rows: no target forward);
3. evaluates the expected acceptance (``1 - TV`` per unrolled step and the chain's tokens per
   verify step, at the rollouts' temperature) on held-out rollouts before and after, and on as many
   rows of its training rollouts, and exports the head in ModelOpt's layout. Those two are captured
   with the whole draft-vocabulary teacher, so the figures are exact: against the top-k teacher of
   the training cache ``acceptance_rows`` is an upper bound (0.02-0.03 tokens per verify step above
   the exact value on the real model, docs/draft_training.md).

On a 2-core CPU with SmolLM2-135M (30 layers) the capture of 512 rollouts costs 322 s once (about 90
ModelOpt steps), then a refinement step of 2048 rows 2.3 s where a ModelOpt step of 8 sequences costs
~3.5 s (docs/draft_training.md, "Offline refinement"). It does not know the rollout engine or GRPO.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rollout = tuple[Sequence[int], Sequence[int]]
"""``(prompt ids, response ids)``: the response tokens are the rows the draft is scored on."""


def capture_rollouts(model: torch.nn.Module, capture: Any, rollouts: Sequence[Rollout], *,
                     batch_size: int = 8, pad_id: int = 0, progress: Callable[[int], None] | None = None):
    """One no-grad forward of ``model`` per ``batch_size`` rollouts inside ``capture.record``; the
    captured rows of all of them as one :class:`~megatron_spec.capture.cache.DraftCache`.
    ``progress(n)`` is called with the number of rollouts done after each batch."""
    if not rollouts:
        raise ValueError("capture_rollouts: no rollouts")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(rollouts), batch_size):
            chunk = rollouts[i : i + batch_size]
            seqs = [torch.tensor([*p, *r], dtype=torch.long) for p, r in chunk]
            ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id).to(device)
            width = ids.shape[1]
            pos = torch.arange(width, device=device).expand_as(ids)
            start = torch.tensor([len(p) for p, _ in chunk], device=device).unsqueeze(1)
            end = torch.tensor([len(q) for q in seqs], device=device).unsqueeze(1)
            response = (pos >= start) & (pos < end)  # causal: the right padding changes nothing before it
            with torch.no_grad(), capture.record(model, response):
                model(ids, pos, attention_mask=None)
            if progress is not None:
                progress(min(i + batch_size, len(rollouts)))
    finally:
        model.train(was_training)
    cache = capture.take()  # every batch's rows, concatenated
    if cache is None:
        raise ValueError("capture_rollouts: no response token was captured (empty responses?)")
    return cache


def refine_eagle3(
    target_dir: str | os.PathLike,
    draft_dir: str | os.PathLike,
    rollouts: Sequence[Rollout],
    held_out: Sequence[Rollout],
    *,
    steps: int,
    out_dir: str | os.PathLike | None = None,
    lr: float = 2e-3,
    rows_per_step: int = 2048,
    ttt_steps: int = 3,
    teacher_topk: int = 32,
    warmup_steps: int = 20,
    tv_weight: float = 0.0,
    capture_batch_size: int = 8,
    eval_every: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the ModelOpt EAGLE-3 export in ``draft_dir`` on ``rollouts`` of the target in
    ``target_dir`` for ``steps`` steps from cached target states (see the module docstring) and
    export it to ``out_dir`` (default: ``draft_dir``, replaced atomically).

    Cosine schedule from ``lr`` (after ``warmup_steps``) to a tenth of it; ``rows_per_step`` cached
    rows (whole segments drawn at random) per step; ``tv_weight``, the total-variation term beside the
    cross-entropy (``DraftTrainerConfig.tv_weight``). Needs megatron-core's parallel state
    (``megatron_spec.parallel.init_parallel``; a world of one is enough).

    Returns ``before`` and ``after`` (:meth:`Eagle3Trainer.evaluate` on ``held_out``: expected acceptance per
    unrolled step and ``draft/eval_tau``), ``train_after`` (the same on as many rows of the training rollouts:
    :func:`training_sample_segments`, captured exactly), ``curve`` (``(step, eval_tau)`` every ``eval_every``
    steps), ``rows`` / ``held_out_rows`` and the seconds of capture and training.
    """
    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights

    if steps < 1:
        raise ValueError(f"refine_eagle3: steps must be >= 1, got {steps}")
    if not held_out:
        raise ValueError("refine_eagle3: held_out is empty: the refinement could not be checked")
    ckpt = HFCheckpoint(os.fspath(target_dir))
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg)
    load_hf_weights(model, ckpt)
    trainer = Eagle3Trainer.from_modelopt(
        draft_dir,
        cfg,
        DraftTrainerConfig(
            lr=lr,
            ttt_steps=ttt_steps,
            max_rows_per_step=rows_per_step,
            warmup_steps=warmup_steps,
            lr_schedule="cosine",
            total_steps=steps,
            seed=seed,
            tv_weight=tv_weight,
        ),
    )
    capture = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=teacher_topk, storage_dtype="bfloat16",
                                                         max_bytes=1 << 40))
    exact = Capture.for_trainer(
        trainer, CaptureConfig(teacher_topk=None, storage_dtype="bfloat16", max_bytes=1 << 40)
    )
    caches = _capture_both(model, capture, rollouts, held_out, capture_batch_size, progress, exact=exact)
    del model  # the head reads the cache from here on
    res = _fit(
        trainer,
        *caches,
        steps=steps,
        score="draft/eval_tau",
        eval_every=eval_every,
        progress=progress,
        desc="eagle3 draft",
    )
    trainer.export(os.fspath(out_dir or draft_dir))
    return res


def _capture_both(model, capture, rollouts: Sequence[Rollout], held_out: Sequence[Rollout], batch_size: int,
                  progress: bool, exact=None):
    """The target's cached states over ``rollouts`` and ``held_out`` (one forward each), a sample of the
    training rollouts with as many rows as ``held_out`` (:func:`training_sample_segments`), and the seconds.
    ``exact``: the capture of the held-out answers and of the sample (a whole-vocabulary teacher: exact
    acceptance; the sample is then captured again, a forward over ~as many answers as are held out);
    None: ``capture`` for both, the sample taken from the training cache."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=len(rollouts) + len(held_out), desc="target states (one forward)", unit="seq",
               disable=not progress)
    train_cache = capture_rollouts(model, capture, rollouts, batch_size=batch_size,
                                   progress=lambda n: bar.update(n - bar.n))
    eval_cache = capture_rollouts(model, exact or capture, held_out, batch_size=batch_size,
                                  progress=lambda n: bar.update(len(rollouts) + n - bar.n))
    bar.close()
    picked = training_sample_segments(train_cache, eval_cache.num_rows)
    if exact is None:
        sample = train_cache.select_segments(picked)
    else:  # segment i is rollouts[i]: capture_rollouts makes one per rollout, in order
        sample = capture_rollouts(model, exact, [rollouts[i] for i in picked], batch_size=batch_size)
    return train_cache, eval_cache, sample, time.perf_counter() - t0


def _fit(
    trainer,
    train_cache,
    eval_cache,
    sample,
    capture_s: float,
    *,
    steps: int,
    score: str,
    eval_every: int,
    progress: bool,
    desc: str,
) -> dict[str, Any]:
    """Train ``trainer`` ``steps`` steps on ``train_cache``; evaluate on ``eval_cache`` before, every
    ``eval_every`` steps (metric ``score``) and after, and on ``sample`` (training rows) after."""
    from tqdm.auto import tqdm

    before = trainer.evaluate(eval_cache)
    curve = [(0, before[score])]
    t1 = time.perf_counter()
    bar = tqdm(range(steps), desc=f"{desc} (cached target states)", unit="step", disable=not progress)
    for s in bar:
        metrics = trainer.train_step(train_cache)
        bar.set_postfix(loss=f"{metrics['draft/loss']:.3f}")
        if eval_every and (s + 1) % eval_every == 0 and s + 1 < steps:
            curve.append((s + 1, trainer.evaluate(eval_cache)[score]))
    train_s = time.perf_counter() - t1
    after = trainer.evaluate(eval_cache)
    curve.append((steps, after[score]))
    seen = trainer.evaluate(sample)
    return {
        "before": before,
        "after": after,
        "train_after": seen,
        "curve": curve,
        "rows": train_cache.num_scored,
        "held_out_rows": eval_cache.num_scored,
        "capture_seconds": capture_s,
        "train_seconds": train_s,
    }


def training_sample_segments(cache, rows: int) -> list[int]:
    """Segments of ``cache`` spread evenly over it, about ``rows`` rows in all (at least one segment): the
    draft scored on answers it trained on, beside the held-out score. A draft that does much better on these
    has memorised its training answers (too few rollouts for its steps)."""
    every = max(1, round(cache.num_rows / max(rows, 1)))
    return list(range(0, cache.num_segments, every))


def init_mtp_from_last_layer(trainer: Any, policy: torch.nn.Module) -> None:
    """Start every MTP depth's transformer layer and final norm from the policy's last decoder layer
    and final norm (``eh_proj``, ``enorm``, ``hnorm`` keep megatron-core's initialisation): a depth
    then begins as one more layer of the target instead of a random one."""
    from megatron_spec.models.gpt import unwrap

    gpt = unwrap(policy)
    last = dict(gpt.decoder.layers[-1].named_parameters())
    final = dict(gpt.decoder.final_layernorm.named_parameters())
    with torch.no_grad():
        for layer in trainer.draft.block.layers:
            for name, p in layer.transformer_layer.named_parameters():
                p.copy_(last[name])
            for name, p in layer.final_layernorm.named_parameters():
                p.copy_(final[name])


def train_mtp(
    target_dir: str | os.PathLike,
    rollouts: Sequence[Rollout],
    held_out: Sequence[Rollout],
    *,
    steps: int,
    out_dir: str | os.PathLike,
    num_layers: int = 1,
    lr: float = 1e-3,
    rows_per_step: int = 2048,
    teacher_topk: int = 32,
    warmup_steps: int = 20,
    init_from_last_layer: bool = True,
    capture_batch_size: int = 8,
    eval_every: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``num_layers`` MTP depths (:class:`~megatron_spec.draft.mtp.MtpTrainer`, the online
    trainer's code) for the target in ``target_dir`` from its cached states over ``rollouts``, and
    export them to ``out_dir`` (what the native engine's ``--spec-draft-kind mtp`` loads).

    The same capture and schedule as :func:`refine_eagle3`; the held-out metrics are the trainer's
    (``draft/eval_ce{k}``, ``draft/eval_top1_{k}``: how often depth k's argmax is the target's).
    ``init_from_last_layer``: see :func:`init_mtp_from_last_layer`. Needs megatron-core's parallel
    state (a world of one is enough)."""
    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.draft.mtp import MtpTrainer
    from megatron_spec.draft.trainer import DraftTrainerConfig
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights

    if steps < 1:
        raise ValueError(f"train_mtp: steps must be >= 1, got {steps}")
    if not held_out:
        raise ValueError("train_mtp: held_out is empty: the training could not be checked")
    ckpt = HFCheckpoint(os.fspath(target_dir))
    model = build_gpt_model(ckpt.decoder_config)
    load_hf_weights(model, ckpt)
    trainer = MtpTrainer(model, num_layers, DraftTrainerConfig(
        lr=lr, max_rows_per_step=rows_per_step, warmup_steps=warmup_steps, lr_schedule="cosine",
        total_steps=steps, seed=seed))
    if init_from_last_layer:
        init_mtp_from_last_layer(trainer, model)
    capture = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=teacher_topk, storage_dtype="bfloat16",
                                                         max_bytes=1 << 40))
    caches = _capture_both(model, capture, rollouts, held_out, capture_batch_size, progress)
    res = _fit(
        trainer,
        *caches,
        steps=steps,
        score="draft/eval_top1_0",
        eval_every=eval_every,
        progress=progress,
        desc="mtp draft",
    )  # the depths read the policy's output weight: the model stays
    trainer.export(os.fspath(out_dir))
    return res


def save_rollouts(
    path: str | os.PathLike, rollouts: Sequence[tuple[int, Sequence[int], Sequence[int]]]
) -> None:
    """Write ``(prompt index, prompt ids, response ids)`` rollouts as JSONL (atomically)."""
    import json

    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        for i, p, r in rollouts:
            f.write(json.dumps({"prompt_index": int(i), "prompt_ids": list(p), "output_ids": list(r)}) + "\n")
    os.replace(tmp, path)


def load_rollouts(path: str | os.PathLike) -> list[tuple[int, list[int], list[int]]]:
    """The rollouts :func:`save_rollouts` wrote."""
    import json

    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append((int(row["prompt_index"]), list(row["prompt_ids"]), list(row["output_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a rollout line ({e})") from e
    if not out:
        raise ValueError(f"{path}: no rollouts")
    return out
