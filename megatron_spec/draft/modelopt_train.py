"""Train an EAGLE-3 draft with NVIDIA ModelOpt and export it, on CPU or GPU.

The recipe is ModelOpt's own (``examples/speculative_decoding``), driven from Python:

1. load the target with ``transformers`` (frozen: ``eagle_freeze_base_model``);
2. ``modelopt.torch.speculative.convert(model, [("eagle", cfg)])`` with the EAGLE-3 architecture
   (``eagle3_default_config`` merged with sizes taken from the target), ``eagle_decoder_type="llama"``,
   ``eagle_use_torch_compile=False`` (CPU), ``eagle_ttt_steps`` training-time-test steps;
3. for a reduced draft vocabulary, ``d2t`` from ModelOpt's ``calibrate_frequent_vocab`` (the most
   frequent tokens of the training data; ``d2t[i] = token_i - i``);
4. train the draft with the model's own loss (soft cross-entropy against the target's
   distribution on the draft vocabulary, summed over TTT steps with ModelOpt's decay);
5. ``modelopt.torch.export.export_speculative_decoding`` -> ``config.json`` + ``model.safetensors``.

One deliberate deviation, on by default (``freeze_input_layernorm``): ModelOpt 0.47's HF trainer
computes ``hidden_norm(input_layernorm(h))`` while SGLang/vLLM serve ``hidden_norm(h)`` (see
:mod:`megatron_spec.draft.eagle3`). Keeping ``layers.0.input_layernorm.weight`` at ones makes the
two identical up to RMSNorm's eps, and costs nothing: on the embedding half a per-channel scale
before the q/k/v projections is absorbed by those projections.

ModelOpt injects a YaRN ``rope_scaling`` (factor 32 over 2048 positions) into the exported config
although it trains with plain RoPE; ``export_rope_scaling={}`` exports the RoPE it trained with.

This module knows the ModelOpt API; it does not know engines or the online trainer.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass
class Eagle3TrainResult:
    """What :func:`train_and_export_eagle3` did."""

    path: str
    """The export directory (``config.json`` + ``model.safetensors``)."""
    losses: list[float]
    """ModelOpt's EAGLE loss per optimiser step."""
    accuracies: list[list[float]]
    """Per step, the draft's top-1 agreement with the target at each TTT step."""
    aux_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    seconds: float
    model: Any = None
    """The converted ModelOpt model (eval mode) when ``keep_model=True``."""


class _TokenIdsAsChat:
    """Lets ``calibrate_frequent_vocab`` (which expects a chat tokenizer) count pre-tokenised data."""

    def apply_chat_template(self, conversations: Sequence[Sequence[int]], **_: Any) -> list[int]:
        return [int(t) for seq in conversations for t in seq]


def calibrate_d2t(token_sequences: Sequence[Sequence[int]], draft_vocab_size: int) -> torch.Tensor:
    """ModelOpt's draft-vocabulary calibration on token ids: ``[Vd]`` int64 ``d2t``.

    Raises:
        ValueError: fewer distinct tokens in the data than ``draft_vocab_size``.
    """
    from modelopt.torch.speculative.utils import calibrate_frequent_vocab

    distinct = len({int(t) for seq in token_sequences for t in seq})
    if distinct < draft_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} needs at least that many distinct tokens in "
                         f"token_sequences; they have {distinct}")
    return calibrate_frequent_vocab(_TokenIdsAsChat(), list(token_sequences), draft_vocab_size)


def eagle3_modelopt_config(
    target_config: Any,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    ttt_steps: int = 3,
    export_rope_scaling: dict[str, Any] | None = None,
    draft_arch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``EagleConfig`` dict for ``mtsp.convert(model, [("eagle", cfg)])`` (ModelOpt 0.47).

    Draft sizes default to the target's (heads, kv heads, head_dim, intermediate size, eps, theta);
    ``draft_arch`` overrides any ``eagle_architecture_config`` key.
    """
    theta = getattr(target_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    heads = target_config.num_attention_heads
    arch: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        "intermediate_size": target_config.intermediate_size,
        "rms_norm_eps": target_config.rms_norm_eps,
        "rope_theta": float(theta),
        "rope_scaling": {"rope_type": "default", "rope_theta": float(theta)},
        "torch_dtype": "float32",
    }
    if draft_vocab_size is not None:
        arch["draft_vocab_size"] = int(draft_vocab_size)
    if aux_layer_ids is not None:
        arch["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in aux_layer_ids]
    arch.update(draft_arch or {})
    cfg: dict[str, Any] = {
        "eagle_architecture_config": arch,
        "eagle_decoder_type": "llama",
        "eagle_use_torch_compile": False,
        "eagle_ttt_steps": int(ttt_steps),
    }
    if export_rope_scaling is not None:
        cfg["eagle_export_rope_scaling"] = dict(export_rope_scaling)
    return cfg


def _batches(seqs: list[list[int]], batch_size: int, seq_len: int, pad_id: int, generator: torch.Generator):
    """Random fixed-length batches: a random window of each sampled sequence, right-padded.

    The length is fixed because ModelOpt caches its TTT attention masks per step, not per length.
    """
    while True:
        idx = torch.randint(len(seqs), (batch_size,), generator=generator).tolist()
        ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
        mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
        for row, i in enumerate(idx):
            seq = seqs[i]
            start = 0
            if len(seq) > seq_len:
                start = int(torch.randint(len(seq) - seq_len + 1, (1,), generator=generator))
            window = seq[start:start + seq_len]
            ids[row, :len(window)] = torch.tensor(window)
            mask[row, :len(window)] = 1
        yield ids, mask


def train_and_export_eagle3(
    target_hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    token_sequences: Sequence[Sequence[int]],
    *,
    steps: int = 200,
    batch_size: int = 8,
    max_len: int = 256,
    draft_vocab_size: int | None = None,
    ttt_steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    aux_layer_ids: Sequence[int] | None = None,
    export_rope_scaling: dict[str, Any] | None = None,
    freeze_input_layernorm: bool = True,
    grad_clip: float | None = 1.0,
    draft_arch: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    keep_model: bool = False,
) -> Eagle3TrainResult:
    """Train an EAGLE-3 draft for an HF target with ModelOpt and export it to ``out_dir``.

    Args:
        target_hf_dir: HF checkpoint of the target (Llama/Qwen2/Qwen3 family).
        out_dir: export directory (replaced atomically).
        token_sequences: training token ids (e.g. prompts + target completions); windows of
            ``max_len`` tokens are sampled from them, ``batch_size`` per step.
        steps: optimiser steps (AdamW, constant ``lr``, gradient clipping ``grad_clip``).
        draft_vocab_size: reduced draft vocabulary (calibrated from ``token_sequences``); None = full.
        ttt_steps: ModelOpt's training-time-test unroll (``eagle_ttt_steps``).
        aux_layer_ids: target layers fused by ``fc``; None = ModelOpt's default.
        export_rope_scaling: ``rope_scaling`` written into the export; None = ModelOpt's default
            (YaRN x32), ``{}`` = none (the plain RoPE the draft is trained with).
        freeze_input_layernorm: keep ``layers.0.input_layernorm`` at ones (see module docstring).
        draft_arch: overrides of ModelOpt's ``eagle_architecture_config``.
        keep_model: return the trained ModelOpt model in the result.

    Returns:
        :class:`Eagle3TrainResult`.
    """
    import modelopt.torch.speculative as mtsp

    t0 = time.perf_counter()
    seqs = _training_sequences(token_sequences, steps, ttt_steps)
    seq_len = min(max_len, max(len(s) for s in seqs))

    torch.manual_seed(seed)  # the draft's initialisation
    model = _load_target(target_hf_dir, device)
    draft_vocab_size = _reduced_vocab_size(draft_vocab_size, model.config.vocab_size)
    d2t = calibrate_d2t(seqs, draft_vocab_size) if draft_vocab_size is not None else None
    cfg = eagle3_modelopt_config(
        model.config,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        ttt_steps=ttt_steps,
        export_rope_scaling=export_rope_scaling,
        draft_arch=draft_arch,
    )
    model = mtsp.convert(model, [("eagle", cfg)])
    eagle = model.eagle_module
    if d2t is not None:
        eagle.d2t.copy_(d2t.to(eagle.d2t.device))
    if freeze_input_layernorm:
        eagle.layers[0].input_layernorm.weight.requires_grad_(False)
    history = _train(model, seqs, seq_len, steps=steps, batch_size=batch_size, lr=lr, grad_clip=grad_clip,
                     seed=seed, device=device, progress=progress)
    out_dir = _export_atomically(model, out_dir)
    return Eagle3TrainResult(
        path=out_dir, losses=history.losses, accuracies=history.accuracies,
        aux_layer_ids=tuple(int(i) for i in model.eagle_config.eagle_aux_hidden_state_layer_ids),
        draft_vocab_size=int(model.eagle_config.draft_vocab_size), seconds=time.perf_counter() - t0,
        model=model if keep_model else None)


def _training_sequences(
    token_sequences: Sequence[Sequence[int]], steps: int, ttt_steps: int
) -> list[list[int]]:
    """The sequences long enough for ``ttt_steps`` (as int lists); raises for bad ``steps`` or none left."""
    seqs = [[int(t) for t in s] for s in token_sequences]
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    min_len = ttt_steps + 2  # the last TTT step compares positions 1 + ttt_steps .. T-1
    seqs = [s for s in seqs if len(s) >= min_len]
    if not seqs:
        raise ValueError(
            f"token_sequences has no sequence of at least {min_len} tokens (ttt_steps={ttt_steps})"
        )
    return seqs


def _load_target(target_hf_dir: str | os.PathLike, device: str | torch.device) -> Any:
    """The HF target in float32 on ``device``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(target_hf_dir), dtype=torch.float32)
    model.to(device)
    return model


def _reduced_vocab_size(draft_vocab_size: int | None, vocab: int) -> int | None:
    """``draft_vocab_size`` checked against the target's ``vocab``; None when it is the full vocabulary."""
    if draft_vocab_size is not None and not 0 < draft_vocab_size <= vocab:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the target's vocab_size)"
        )
    if draft_vocab_size == vocab:
        draft_vocab_size = None
    return draft_vocab_size


@dataclasses.dataclass
class _History:
    losses: list[float]
    """ModelOpt's EAGLE loss per optimiser step."""
    accuracies: list[list[float]]
    """Per step, the top-1 agreement at each TTT step."""


def _train(
    model: Any, seqs: list[list[int]], seq_len: int, *, steps: int, batch_size: int, lr: float,
    grad_clip: float | None, seed: int, device: str | torch.device, progress: bool,
) -> _History:
    """``steps`` AdamW steps on the converted model's own EAGLE loss; leaves it in eval mode."""
    from tqdm.auto import tqdm

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = _batches(seqs, batch_size, seq_len, pad_id, torch.Generator().manual_seed(seed))
    history = _History(losses=[], accuracies=[])
    model.train()
    bar = tqdm(range(steps), desc="eagle3 draft (ModelOpt)", unit="step", disable=not progress)
    for _ in bar:
        ids, mask = next(batches)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        history.losses.append(float(out.loss.detach()))
        history.accuracies.append([float(a) for a in out.train_acc[0]])
        bar.set_postfix(loss=f"{history.losses[-1]:.3f}", acc0=f"{history.accuracies[-1][0]:.2f}")
    model.eval()
    return history


def _export_atomically(model: Any, out_dir: str | os.PathLike) -> str:
    """``export_speculative_decoding`` into a temporary directory beside ``out_dir``, then swapped in."""
    from modelopt.torch.export import export_speculative_decoding

    out_dir = os.fspath(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    try:
        export_speculative_decoding(model, export_dir=tmp)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_spec.draft.modelopt_train --target DIR --data FILE.jsonl --out DIR [...]``

    ``--data``: one JSON object a line with ``input_ids`` (a list of ints).
    """
    import argparse
    import json

    ap = argparse.ArgumentParser(description="train an EAGLE-3 draft with ModelOpt and export it")
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--draft-vocab-size", type=int, default=None)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-export-rope-scaling", action="store_true",
                    help="export the plain RoPE the draft is trained with instead of ModelOpt's YaRN")
    a = ap.parse_args(argv)
    with open(a.data) as f:
        seqs = [json.loads(line)["input_ids"] for line in f if line.strip()]
    res = train_and_export_eagle3(
        a.target,
        a.out,
        seqs,
        steps=a.steps,
        batch_size=a.batch_size,
        max_len=a.max_len,
        draft_vocab_size=a.draft_vocab_size,
        ttt_steps=a.ttt_steps,
        lr=a.lr,
        seed=a.seed,
        export_rope_scaling={} if a.no_export_rope_scaling else None,
    )
    print(json.dumps({"path": res.path, "final_loss": res.losses[-1] if res.losses else None,
                      "final_acc": res.accuracies[-1] if res.accuracies else None, "seconds": res.seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
