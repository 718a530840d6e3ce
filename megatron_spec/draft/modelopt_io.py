"""Read and write EAGLE-3 drafts in the format ``modelopt.torch.export.export_speculative_decoding`` writes.

An export directory holds ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, sizes,
``draft_vocab_size``, ``rope_theta``/``rope_scaling``, ``eagle_config``) and ``model.safetensors``
with ``fc.weight``, ``layers.0.*`` (``midlayer.*`` in older exports), ``norm.weight``,
``lm_head.weight`` and, for a reduced draft vocabulary only, ``d2t`` (docs/design.md, "ModelOpt
EAGLE-3 export"). There is no embedding: the draft uses the target's. SGLang's
``LlamaForCausalLMEagle3.load_weights`` reads the same names (it renames ``midlayer`` to
``layers.0`` and keeps ``d2t + arange`` as its hot-token ids).

Loading is strict where SGLang is lenient: a missing, unexpected or misshapen tensor, an invalid
``d2t`` or a draft that does not fit the target is a ``ValueError`` naming it.

This module knows files and names; the math is in :mod:`megatron_spec.draft.eagle3`, training
with ModelOpt in :mod:`megatron_spec.draft.modelopt_train`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from megatron_spec.draft.eagle3 import Eagle3Config, Eagle3Head, canonical_name, check_d2t
from megatron_spec.models.checkpoint import HFCheckpoint, save_hf_checkpoint
from megatron_spec.models.hf_config import DecoderConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_eagle3_config(path: str | os.PathLike, target_cfg: DecoderConfig | None = None,
                       **overrides: Any) -> Eagle3Config:
    """Parse ``<path>/config.json``; with ``target_cfg`` also validate it against the target.

    ``overrides`` replace parsed fields (e.g. ``rope_scaling=None`` to run a ModelOpt export with
    the plain RoPE it was trained with, ``double_hidden_norm=True`` for ModelOpt's HF trainer math).
    """
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in EAGLE-3 draft directory {os.fspath(path)}")
    with open(cfg_path) as f:
        raw = json.load(f)
    cfg = Eagle3Config.from_hf_dict(raw, source=cfg_path,
                                    target_num_layers=target_cfg.num_layers if target_cfg else None)
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(Eagle3Config)}
        if unknown:
            raise TypeError(f"unknown Eagle3Config override(s) {sorted(unknown)}")
        cfg = dataclasses.replace(cfg, **overrides)
    if target_cfg is not None:
        cfg.validate_against(target_cfg, source=cfg_path)
    return cfg


def load_eagle3(
    path: str | os.PathLike,
    target_cfg: DecoderConfig,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    **overrides: Any,
) -> Eagle3Head:
    """Build an :class:`Eagle3Head` from a ModelOpt export directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (sharded files work too).
        target_cfg: the target model; the draft must match its hidden size and vocabulary, and
            its feature layer ids must exist in it.
        dtype: parameter dtype (``d2t`` stays int64).
        max_positions: RoPE table length (default: the config's ``max_position_embeddings``).
        overrides: :class:`Eagle3Config` fields to replace (see :func:`read_eagle3_config`).

    Returns:
        The head in eval mode, on ``device``.

    Raises:
        ValueError: naming the config field or tensor that is wrong.
    """
    cfg = read_eagle3_config(path, target_cfg, **overrides)
    ckpt = HFCheckpoint(path)
    try:
        names = sorted(ckpt.names())
        canon: dict[str, str] = {}
        for name in names:
            c = canonical_name(name)
            if c in canon:
                raise ValueError(f"tensor {c} appears twice in {ckpt.path} (as {canon[c]} and {name})")
            canon[c] = name
        head = Eagle3Head(cfg, max_positions=max_positions)
        expected = head.export_shapes()
        tensors = []
        for c, name in canon.items():
            if c == "t2d":  # optional boolean target->draft mask some exporters add; must agree with d2t
                continue
            if c not in expected:
                hint = (
                    " (d2t without a reduced vocabulary: draft_vocab_size == vocab_size)"
                    if c == "d2t"
                    else ""
                )
                raise ValueError(f"unexpected tensor {name} in EAGLE-3 draft {ckpt.path}{hint}")
            shape = ckpt.shape(name)
            if shape != expected[c]:
                raise ValueError(f"tensor {name} in {ckpt.path} has shape {shape}, expected {expected[c]}")
            tensors.append((name, ckpt.get(name)))
        missing = sorted(set(expected) - set(canon))
        if missing:
            raise ValueError(f"missing tensor {missing[0]} in EAGLE-3 draft {ckpt.path}"
                             + (f" (all missing: {missing})" if len(missing) > 1 else ""))
        head = head.to(dtype)
        head.load_weights(tensors)
        if "t2d" in canon:
            _check_t2d(ckpt.get(canon["t2d"]), head, source=f"tensor {canon['t2d']} in {ckpt.path}")
    finally:
        ckpt.close()
    return head.to(device).eval()


def _check_t2d(t2d: torch.Tensor, head: Eagle3Head, *, source: str) -> None:
    cfg = head.cfg
    if tuple(t2d.shape) != (cfg.vocab_size,):
        raise ValueError(f"{source} has shape {tuple(t2d.shape)}, expected ({cfg.vocab_size},)")
    expected = torch.zeros(cfg.vocab_size, dtype=torch.bool, device="cpu")  # checked on the host
    expected[head.target_ids.cpu()] = True
    if not torch.equal(t2d.bool().cpu(), expected):
        raise ValueError(f"{source} does not mark exactly the target ids of d2t")


def save_eagle3(head: Eagle3Head, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in ModelOpt's export layout (atomically).

    Tensor names are ``layers.0.*`` (as ModelOpt 0.47 writes them); ``d2t`` only for a reduced
    vocabulary. ``dtype`` casts floating tensors (default: as they are).
    """
    if head.cfg.reduced_vocab:
        check_d2t(head.d2t, head.cfg.vocab_size, head.cfg.draft_vocab_size, source="head d2t")
    tensors = {}
    for name, t in head.named_export_tensors():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.cpu().contiguous()
    cfg = head.cfg
    float_dtype = tensors["fc.weight"].dtype
    if cfg.torch_dtype != _DTYPE_NAMES.get(float_dtype, cfg.torch_dtype):
        cfg = dataclasses.replace(cfg, torch_dtype=_DTYPE_NAMES[float_dtype])
    save_hf_checkpoint(path, tensors, cfg.to_hf_dict(), extra_files=())


def startup_draft_tensors(kind: str, path: str | os.PathLike, target_cfg: DecoderConfig, *,
                          dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]] | None:
    """The draft weights an engine loads at start-up, as a weight update names them: an EAGLE-3
    head (``--spec-draft-kind eagle3``, without ``d2t``: engines read it once, at start) or a
    draft model's HF checkpoint (``model``). None for drafts without weights of their own
    (n-gram, history, MTP heads, plain decoding). Pushed again after a memory release."""
    if kind == "eagle3":
        head = load_eagle3(path, target_cfg, dtype=dtype)
        return [(n, t.detach()) for n, t in head.named_export_tensors() if n != "d2t"]
    if kind == "model":
        ck = HFCheckpoint(path)
        return [(n, ck.get(n) if dtype is None else ck.get(n).to(dtype)) for n in ck.weight_names()]
    return None
