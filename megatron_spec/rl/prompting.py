"""From a prompt string to the engine's token ids, and from the engine's tokens to a response.

* :func:`encode_prompt`: the prompt as the checkpoint expects it. With a chat template
  (``--apply-chat-template``) the prompt becomes one user turn (after an optional system
  turn) rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``: the
  template writes every special token itself, BOS included, as Hugging Face's own chat
  pipeline does. Without one the prompt is tokenised with the tokenizer's special tokens, so
  BOS is there exactly where the tokenizer adds one (Llama's does, Qwen's does not).
* :func:`stop_token_ids`: the ids that end a response: ``eos_token_id`` of ``config.json``
  *and* of ``generation_config.json`` (an instruct checkpoint lists its end-of-turn token
  only there: Llama-3-Instruct's ``<|eot_id|>``) and the tokenizer's EOS. Both engines get
  them in every request's ``stop_token_ids``.
* :func:`truncate_at_stop_strings`: a response ends after the token that completes the first
  stop string (``--stop``). The engines stop on token ids only, so the trainer cuts the
  sampled tokens (and their log-probs) there: the kept prefix is exactly what the policy
  sampled, and where it ends is a function of that prefix.

Nothing here knows about models, engines or training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_spec.rollout.types import FINISH_STOP


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_prompt_template(template: str | None, prompt: str) -> str:
    """``--prompt-template``: ``template`` with ``{prompt}`` replaced by ``prompt`` (plain text
    replacement: the braces of a math prompt stay as they are); None leaves the prompt alone."""
    return prompt if template is None else template.replace("{prompt}", prompt)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], *, chat_template: bool,
                  system_prompt: str | None = None, template: str | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of ``prompt`` (see the module docstring for what the two modes add), after
    :func:`apply_prompt_template`; the one encoding of the trainer, ``generate`` and ``make_draft``.

    A prompt that is a list of chat messages (``{"role", "content"}``: verl's, slime's and OpenRLHF's
    datasets) is always rendered with the chat template; ``template`` then formats its last user turn and
    ``system_prompt`` goes first unless it has a system turn. ``template_kwargs``: the chat template's own
    variables (``--apply-chat-template-kwargs``, e.g. Qwen3's ``enable_thinking``)."""
    if isinstance(prompt, str) and not chat_template:
        return list(tokenizer(apply_prompt_template(template, prompt), add_special_tokens=True)["input_ids"])
    if not has_chat_template(tokenizer):
        why = "--apply-chat-template" if isinstance(prompt, str) else "a prompt of chat messages"
        raise ValueError(
            f"{why}: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no chat_template "
            f"(tokenizer_config.json or chat_template.jinja)"
        )
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": apply_prompt_template(template, prompt)}]
    else:
        messages = [dict(m) for m in prompt]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if template is not None and users:
            messages[users[-1]]["content"] = apply_prompt_template(template, messages[users[-1]]["content"])
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_template_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--apply-chat-template-kwargs``: a JSON object (a YAML ``--config`` may give a mapping)."""
    from megatron_spec.config_values import json_object

    return json_object("--apply-chat-template-kwargs", value)


def _eos_of(path: str) -> list[int]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def stop_token_ids(checkpoint_dir: str, tokenizer: Any = None) -> tuple[int, ...]:
    """EOS ids of ``config.json``, ``generation_config.json`` and the tokenizer, sorted, unique."""
    ids = set(_eos_of(os.path.join(checkpoint_dir, "config.json")))
    ids |= set(_eos_of(os.path.join(checkpoint_dir, "generation_config.json")))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def stop_string_end(tokenizer: Any, output_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """Tokens to keep so the response ends at its first stop string: the shortest prefix whose
    text contains one (None when the response has none). Decoding a prefix gives a prefix of
    the text, so the shortest such prefix is found by bisection (log n decodes, not n)."""
    if not stops or not output_ids:
        return None

    def hit(n: int) -> bool:
        text = tokenizer.decode(list(output_ids[:n]), skip_special_tokens=True)
        return any(s in text for s in stops)

    if not hit(len(output_ids)):
        return None
    lo, hi = 1, len(output_ids)  # hit(hi) holds; find the least n with hit(n)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def truncate_at_stop_strings(samples: Sequence[Any], tokenizer: Any, stops: Sequence[str]) -> int:
    """Cut every sample (``SampleOutput``: ``output_ids``, ``logprobs``, ``finish_reason``) after
    the token that completes its first stop string; returns how many were cut."""
    cut = 0
    for s in samples:
        n = stop_string_end(tokenizer, s.output_ids, stops)
        if n is None:
            continue
        if n < len(s.output_ids):
            cut += 1
        s.output_ids, s.logprobs = list(s.output_ids[:n]), list(s.logprobs[:n])
        s.finish_reason = FINISH_STOP
    return cut
