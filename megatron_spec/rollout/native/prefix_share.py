"""Prompts admitted together that begin alike share the forward of their common beginning.

A chat template's system turn, a task's instructions, a few-shot preamble: the prompts of an RL batch
often begin with the same tokens. The engine prefills the prompts it admits together in one forward
(``EngineCore._take``); where they share a beginning, that beginning runs once, as a forward of one row
into the first prompt's slot, its keys and values are copied into the other prompts' slots
(``KVCache.copy_prefix``), and the admission's forward runs only what follows it in each prompt (SGLang's
radix cache and vLLM's prefix caching do this across requests; vLLM's CPU build shares whole blocks of
128 tokens only). A prompt's samples already share its prefill (``admission.py``); this is sharing
between prompts.

It pays where the tokens it saves outweigh the second forward: a prefill costs its tokens' arithmetic
(compute-bound: on 2 cores, ~1.5-2 ms a token for SmolLM2-135M in fp32) while a forward's fixed cost is
one read of the weights (a decode step: ~20-30 ms there). :data:`MIN_SAVED_TOKENS` is the bar: the tokens
saved, ``(P - 1) * shared``, must reach it.

Every prompt keeps its last token in the admission's forward (its logits draw the first tokens). The
drafter's prefill still reads whole prompts' aux states (``Admission.whole_aux``).

It knows nothing of sampling or drafting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from megatron_spec.layers.kv_cache import KVCache
from megatron_spec.rollout.native.model import CausalLM
from megatron_spec.rollout.native.rows import Admission
from megatron_spec.rollout.types import GenerateRequest

MIN_SAVED_TOKENS = 64
"""The fewest prompt tokens a shared forward must save (``(P - 1) * shared``) to be run."""


def shared_length(batch: Sequence[GenerateRequest], min_saved: int | None = None) -> int:
    """How many first tokens ``batch``'s prompts share and run once (0: none worth a forward of their own):
    their common beginning, short of the shortest prompt's last token."""
    if len(batch) < 2:
        return 0
    prompts = [list(r.input_ids) for r in batch]
    c = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
    bar = MIN_SAVED_TOKENS if min_saved is None else min_saved
    return c if c > 0 and (len(batch) - 1) * c >= bar else 0


def admit(model: CausalLM, cache: KVCache, batch: list[GenerateRequest], base: int, counts: list[int],
          aux_layers: Sequence[int], share: bool = True) -> Admission:
    """``batch``'s admission into slots ``base..`` (``Admission.of``); with ``share``, its prompts' shared
    beginning already run and copied into their slots where it pays (:func:`shared_length`)."""
    adm = Admission.of(batch, base, model.device, counts, shared_length(batch) if share else 0)
    prefill_shared(model, cache, adm, aux_layers)
    return adm


def prefill_shared(model: CausalLM, cache: KVCache, adm: Admission, aux_layers: Sequence[int]) -> None:
    """Run ``adm``'s shared tokens once into its first slot and copy them into the slots of its other
    prompts; keeps their aux states for the drafter (``adm.prefix_aux``)."""
    if not adm.shared:
        return
    _, adm.prefix_aux = model.forward_segments([adm.prefix_segment()], cache, aux_layers=aux_layers)[0]
    base = adm.segment.slot_offset
    cache.copy_prefix(base, list(range(base + 1, base + len(adm.batch))), adm.shared)
