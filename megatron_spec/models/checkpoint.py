"""HF checkpoint directories: read tensors lazily, write them back atomically.

A checkpoint is what users have on disk: ``config.json``, one or more ``*.safetensors``
files (sharded with ``model.safetensors.index.json``, or not), and tokenizer files. Reading
is lazy (``safetensors.safe_open``): a tensor-parallel rank reads only what it needs, one
tensor at a time. Writing goes to a temporary directory that is renamed into place, so a
crash never leaves a half-written checkpoint under the final name.

This module knows file layouts and names, not model architectures (see ``convert.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open

from megatron_spec.models.hf_config import DecoderConfig

# HF tensors that carry no weights and are ignored on load (said in a log line, not silently).
IGNORED_HF_NAMES = re.compile(r"rotary_emb\.")


def is_weight_name(name: str, tie_word_embeddings: bool) -> bool:
    """Whether the HF tensor ``name`` is a weight a model loads and an engine is sent: not a rotary
    buffer (:data:`IGNORED_HF_NAMES`), and not ``lm_head.weight`` when the embedding stands in for it."""
    return not (tie_word_embeddings and name == "lm_head.weight") and not IGNORED_HF_NAMES.search(name)

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has wrong shapes or is malformed."""


class HFCheckpoint:
    """Read-only, lazy view of an HF safetensors checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"HF checkpoint directory {self.path} does not exist")
        self.config_dict: dict[str, Any] = self._read_json("config.json")
        self._name_to_file = self._index_tensors()
        self._handles: dict[str, Any] = {}

    def _read_json(self, name: str) -> dict[str, Any]:
        p = os.path.join(self.path, name)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{name} missing in HF checkpoint {self.path}")
        with open(p) as f:
            return json.load(f)

    def _index_tensors(self) -> dict[str, str]:
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: no weight_map")
            for fname in set(weight_map.values()):
                if not os.path.isfile(os.path.join(self.path, fname)):
                    raise CheckpointError(f"{index_path} names shard {fname}, which does not exist")
            return dict(weight_map)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            bins = [f for f in os.listdir(self.path) if f.endswith(".bin")]
            hint = " (found PyTorch .bin files: convert them to safetensors first)" if bins else ""
            raise CheckpointError(f"no *.safetensors files in {self.path}{hint}")
        mapping: dict[str, str] = {}
        for fname in files:
            with safe_open(os.path.join(self.path, fname), framework="pt") as f:
                for name in f.keys():
                    if name in mapping:
                        raise CheckpointError(f"tensor {name} is in both {mapping[name]} and {fname}")
                    mapping[name] = fname
        return mapping

    @property
    def decoder_config(self) -> DecoderConfig:
        """The architecture of ``config.json``; its EOS ids joined by those of ``generation_config.json``,
        where instruct checkpoints list their end-of-turn token (Llama-3-Instruct's ``<|eot_id|>``)."""
        cfg = DecoderConfig.from_hf_dict(self.config_dict, source=os.path.join(self.path, "config.json"))
        gen_path = os.path.join(self.path, "generation_config.json")
        if not os.path.isfile(gen_path):
            return cfg
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        extra = [] if eos is None else [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        return cfg if merged == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_ids=merged)

    def names(self) -> set[str]:
        return set(self._name_to_file)

    def weight_names(self) -> list[str]:
        """The checkpoint's weights (:func:`is_weight_name`), sorted."""
        tied = self.decoder_config.tie_word_embeddings
        return sorted(n for n in self._name_to_file if is_weight_name(n, tied))

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.path, fname), framework="pt")
        return self._handles[fname]

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name``; a clear error if the checkpoint lacks it."""
        fname = self._name_to_file.get(name)
        if fname is None:
            raise CheckpointError(f"tensor {name} missing in HF checkpoint {self.path}")
        return self._handle(fname).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        fname = self._name_to_file.get(name)
        if fname is None:
            raise CheckpointError(f"tensor {name} missing in HF checkpoint {self.path}")
        return tuple(self._handle(fname).get_slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary folder beside ``path`` to write into; on success it replaces ``path`` (an existing
    folder goes only once the new one is complete), with the modes the umask gives a new folder (``tempfile``
    makes it private; a served model is read by other users); on an error it is removed."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=parent)
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        for d, _, files in os.walk(tmp):
            os.chmod(d, 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(d, f), 0o666 & ~mask)
        if os.path.isdir(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf_checkpoint(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    config_dict: Mapping[str, Any],
    *,
    max_shard_bytes: int | None = None,
    copy_files_from: str | os.PathLike | None = None,
    extra_files: Iterable[str] = TOKENIZER_FILES,
) -> None:
    """Write an HF safetensors checkpoint atomically.

    Args:
        path: final directory (replaced if it exists).
        tensors: HF name -> tensor (contiguous copies are made as needed).
        config_dict: the ``config.json`` contents.
        max_shard_bytes: shard into ``model-0000i-of-0000n.safetensors`` files plus an index
            when the total exceeds this; one ``model.safetensors`` otherwise.
        copy_files_from: a directory whose tokenizer/generation files are copied alongside.
    """
    from huggingface_hub import save_torch_state_dict

    with atomic_folder(path) as tmp:
        # huggingface_hub's writer: shards past max_shard_bytes with model.safetensors.index.json (the layout
        # transformers and the engines read), contiguous CPU copies, tensors sharing storage written once
        # a tensor that views part of a larger storage (an embedding cut from its padded vocabulary) is
        # copied:
        # huggingface_hub refuses to write one that does not cover its storage
        own = {n: t.detach().cpu() for n, t in tensors.items()}
        own = {n: t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
               for n, t in own.items()}
        save_torch_state_dict(own, tmp,
                              max_shard_size=max_shard_bytes if max_shard_bytes is not None else 1 << 60,
                              metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dict(config_dict), f, indent=2)
        if copy_files_from is not None:
            for fname in extra_files:
                src = os.path.join(os.fspath(copy_files_from), fname)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(tmp, fname))
