"""MTP heads on disk: ``config.json`` + ``model.safetensors`` under HF names (``model.layers.{L+k}.*``).

Written by ``MtpTrainer.export`` (:func:`save_mtp`), read by the native engine for
``draft_kind="mtp"`` with a ``draft_path`` (:func:`load_mtp_head`) and by ``build_draft_trainer``
to start online training from an export. Strict: names, shapes and the target they belong to
are checked. Knows no Megatron.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from megatron_spec.draft.mtp_head import ARCHITECTURE, MtpHead
from megatron_spec.models.hf_config import DecoderConfig


def save_mtp(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], target_cfg: DecoderConfig, num_layers: int
) -> None:
    """Write MTP heads as ``config.json`` + ``model.safetensors`` (HF names, atomically)."""
    from megatron_spec.models.checkpoint import save_hf_checkpoint

    with torch.device("meta"):  # shapes only: no weights allocated (this runs after every draft update)
        expected = MtpHead(target_cfg, num_layers).export_shapes()
    names = set(tensors)
    if names != set(expected):
        raise ValueError(
            f"MTP export names differ from the head's: missing {sorted(set(expected) - names)[:3]}, "
            f"unexpected {sorted(names - set(expected))[:3]}"
        )
    dtype = next(iter(tensors.values())).dtype
    config = {
        "architectures": [ARCHITECTURE],
        "mtp_num_layers": num_layers,
        "num_nextn_predict_layers": num_layers,
        "target_num_hidden_layers": target_cfg.num_layers,
        "hidden_size": target_cfg.hidden_size,
        "vocab_size": target_cfg.vocab_size,
        "target_architecture": target_cfg.architecture,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    save_hf_checkpoint(path, dict(tensors), config, extra_files=())


def read_mtp_config(path: str | os.PathLike, target_cfg: DecoderConfig) -> int:
    """Number of MTP layers of an export, checked against the target."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in MTP directory {os.fspath(path)}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(
            f"{cfg_path}: architectures {cfg.get('architectures')} is not an MTP export ({ARCHITECTURE})"
        )
    for key, want in (
        ("target_num_hidden_layers", target_cfg.num_layers),
        ("hidden_size", target_cfg.hidden_size),
        ("vocab_size", target_cfg.vocab_size),
    ):
        if cfg.get(key) != want:
            raise ValueError(f"MTP export {key} {cfg.get(key)} != target {want} in {cfg_path}")
    return int(cfg["mtp_num_layers"])


def load_mtp_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from megatron_spec.models.checkpoint import HFCheckpoint

    ck = HFCheckpoint(path)
    return {n: ck.get(n) for n in ck.names()}


def load_mtp_head(
    path: str | os.PathLike,
    target_cfg: DecoderConfig,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    device: torch.device | str = "cpu",
) -> MtpHead:
    """The native :class:`MtpHead` of an MTP export on ``device`` (strict: every name must load)."""
    n = read_mtp_config(path, target_cfg)
    if num_layers is not None and num_layers != n:
        raise ValueError(f"MTP export at {os.fspath(path)} has {n} layers, the engine expects {num_layers}")
    head = MtpHead(target_cfg, n).to(device=device, dtype=dtype)
    head.load_weights(load_mtp_tensors(path).items())
    return head.eval()


__all__ = ["load_mtp_head", "load_mtp_tensors", "read_mtp_config", "save_mtp"]
