"""Small, real HF checkpoints made on the spot (for tests, benchmarks and the CPU demo).

The weights come from ``transformers``' own model classes (their initialisation, their
``save_pretrained``), the tokenizer is a character-level ``tokenizers`` tokenizer saved as a
``PreTrainedTokenizerFast``: the directory is exactly what a user's checkpoint looks like
(config.json, safetensors, sharded with an index if asked, tokenizer files). Nothing is
downloaded.

It does not train anything: see ``launch/`` for the demo's SFT.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The synthetic tasks (megatron_spec.rl.synthetic_tasks) need digits, operators and a few letters.
DEFAULT_CHARS = "0123456789+-*/=()<>.,:;?! \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ#"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

_FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def char_tokenizer(chars: str = DEFAULT_CHARS):
    """A character-level fast tokenizer: ids 0..3 are <pad>, <s>, </s>, <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars):
        raise ValueError("tokenizer characters must be unique")
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def make_hf_checkpoint(
    path: str | os.PathLike,
    *,
    family: str = "qwen3",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    init_std: float = 0.02,
    nontrivial_norms: bool = True,
    chars: str = DEFAULT_CHARS,
    extra_config: dict[str, Any] | None = None,
) -> str:
    """Create an HF checkpoint of the given family with random weights; returns ``path``.

    ``vocab_size`` defaults to the tokenizer's size; a larger value pads the embedding (as
    real checkpoints do). ``max_shard_size`` (e.g. ``"50KB"``) produces a sharded checkpoint
    with ``model.safetensors.index.json``. ``nontrivial_norms`` draws norm weights around 1
    and biases around 0 (HF initialises them to exactly 1 and 0, which hides layout bugs).
    """
    import transformers

    if family not in _FAMILY_CLASSES:
        raise ValueError(f"family {family!r} not supported; expected one of {sorted(_FAMILY_CLASSES)}")
    tokenizer = char_tokenizer(chars)
    vocab = vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config_cls, model_cls = (getattr(transformers, n) for n in _FAMILY_CLASSES[family])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_theta=rope_theta,
    )
    if head_dim is not None or family == "qwen3":
        kwargs["head_dim"] = head_dim or hidden_size // num_attention_heads
    kwargs.update(extra_config or {})
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config)
    if nontrivial_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.1 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.normal_(0.0, init_std)
    model = model.to(dtype)
    model.eval()
    path = os.fspath(path)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_spec.models.tiny --out DIR [--family F] [--hidden-size H] ...``"""
    import argparse

    ap = argparse.ArgumentParser(description="write a small HF checkpoint with random weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="qwen3", choices=sorted(_FAMILY_CLASSES))
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--intermediate-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default=None)
    a = ap.parse_args(argv)
    make_hf_checkpoint(
        a.out,
        family=a.family,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_layers=a.num_layers,
        num_attention_heads=a.num_attention_heads,
        num_kv_heads=a.num_kv_heads,
        seed=a.seed,
        max_shard_size=a.max_shard_size,
    )
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
