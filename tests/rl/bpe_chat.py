"""A real byte-level BPE tokenizer with a Llama-3-style chat template, built here, and a tiny
instruct-like checkpoint around it (nothing is downloaded).

The tokenizer is trained by the ``tokenizers`` library on a small corpus, adds
``<|begin_of_text|>`` as BOS through its post-processor (as Llama's does) and has the chat
special tokens. The checkpoint's ``config.json`` names ``<|end_of_text|>`` as EOS and only its
``generation_config.json`` names ``<|eot_id|>`` as well: Llama-3-Instruct's layout.
"""

from __future__ import annotations

import json
import os

BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
SPECIALS = [PAD, BOS, EOS, EOT, "<|start_header_id|>", "<|end_header_id|>"]

# Llama-3-Instruct's template, shortened (no tools, no date): BOS, then one header per turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% "
    "endif %}"
)

CORPUS = [
    "What is 3 + 5? The answer is 8.", "Calculate the greatest common divisor of 12 and 18.",
    "Solve 2*x + 4 = 10 for x.", "Work out 541.3 + -0.221.", "Let me think step by step.",
    "The final answer is #### 72", "so the answer is \\boxed{7}", "user assistant system",
] * 20


def bpe_tokenizer(vocab_size: int = 320):
    """A trained byte-level BPE ``PreTrainedTokenizerFast`` with BOS added and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_chat_checkpoint(path: str, *, eot_bias: float = 0.0, seed: int = 0) -> str:
    """A tiny qwen3 checkpoint with :func:`bpe_tokenizer`; ``generation_config.json`` adds
    ``<|eot_id|>`` to the EOS ids. ``eot_bias`` > 0 rewires the output layer so the model
    emits ``<|eot_id|>`` with high probability at every position (an instruct model's turn
    end, made likely so a test sees generation stop there)."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_spec.models.tiny import make_hf_checkpoint

    tok = bpe_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOS, EOS, EOT, PAD)}
    make_hf_checkpoint(
        path,
        family="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        vocab_size=len(tok),
        seed=seed,
        extra_config={"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
    )
    for name in os.listdir(path):  # replace the character tokenizer make_hf_checkpoint wrote
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(os.path.join(path, name))
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]}, f)
    if eot_bias:
        # Residual-stream dimension 0 is a large constant (every embedding row), the final norm
        # keeps only that dimension, and only <|eot_id|>'s output row reads it: the logit of
        # <|eot_id|> is about eot_bias * sqrt(hidden), every other logit 0.
        st_path = os.path.join(path, "model.safetensors")
        state = load_file(st_path)
        state["model.embed_tokens.weight"][:, 0] = 100.0
        norm = torch.zeros_like(state["model.norm.weight"])
        norm[0] = 1.0
        state["model.norm.weight"] = norm
        head = torch.zeros_like(state["lm_head.weight"])
        head[ids[EOT], 0] = eot_bias
        state["lm_head.weight"] = head
        save_file(state, st_path, metadata={"format": "pt"})
    return path
