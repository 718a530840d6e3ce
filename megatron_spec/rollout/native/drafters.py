"""Drafters for the native engine: what proposes the k tokens the target verifies.

Every drafter implements :class:`Drafter`. The engine keeps the running batch in slots
``0..B-1`` and tells the drafter about slot moves, prompt prefills, and what each verify
step emitted; the drafter keeps whatever state it needs per slot (its own KV cache, the
target hidden states it has not consumed yet).

* :class:`NgramDrafter`: prompt lookup (no model, no distribution: q is a point mass).
* :class:`ModelDrafter`: a small causal LM of a supported family with the same tokenizer.
* :class:`Eagle3Drafter`: the EAGLE-3 head fusing the target's auxiliary hidden states
  (``megatron_spec.draft.eagle3``).
* MTP heads plug in through the same interface (``megatron_spec.draft.mtp``).

Exactness never depends on the drafter: whatever is proposed, verification keeps the
target's distribution. Drafters only decide how often drafts are accepted and what they cost.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from megatron_spec.spec import SamplingTensors, process_logits
from megatron_spec.spec.verify import sample_from_logprobs


class Drafter(abc.ABC):
    """Interface between the engine's scheduler and a draft source."""

    kind: str = "none"
    aux_layers: tuple[int, ...] = ()
    """Target decoder layers whose outputs the drafter consumes (EAGLE-3)."""
    d2t: torch.Tensor | None = None
    """Draft-to-target id offsets of a reduced draft vocabulary (draft probs are over it)."""

    def allocate(self, num_slots: int, max_len: int) -> None:
        """Allocate per-slot state for ``num_slots`` sequences of up to ``max_len`` tokens."""

    def release(self) -> None:
        """Free caches (engine memory release)."""

    def move(self, src: int, dst: int) -> None:
        """Slot ``src`` now lives in ``dst`` (batch compaction)."""

    def prefill(self, slot_offset: int, prompts: Sequence[Sequence[int]], aux: torch.Tensor | None) -> None:
        """Prompts were prefilled into slots ``slot_offset + i``; ``aux [P, T, A]`` their aux states."""

    def copy_prefix(self, src: int, dsts: Sequence[int]) -> None:
        """Samples of one prompt share its prefill: copy slot ``src``'s prompt state into ``dsts``."""

    def start(self, slot: int, prompt: Sequence[int], first_token: int, last_aux: torch.Tensor | None) -> None:
        """A sample in ``slot`` begins: ``first_token`` was sampled from the prefill of ``prompt``;
        ``last_aux [A]`` is the target's aux state at the prompt's last position."""

    @abc.abstractmethod
    def propose(self, tokens: Sequence[Sequence[int]], k: int, sampling: SamplingTensors,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ``k`` tokens for the rows in slots ``0..B-1``.

        Args:
            tokens: each row's full token list (prompt + generated so far).
        Returns:
            draft token ids ``[B, k]`` (target vocabulary; -1 ends a row's chain early) and the
            draft distributions they were sampled from ``[B, k, Vd]`` (None: point masses).
        """

    def commit(self, emitted: Sequence[Sequence[int]], num_accepted: Sequence[int],
               verify_aux: torch.Tensor | None) -> None:
        """After verification: row b emitted ``emitted[b]`` (accepted drafts + one new token);
        ``verify_aux [B, k+1, A]`` are the target's aux states at the verified positions."""


class NgramDrafter(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n from ``max_n`` down to ``min_n``) and propose the tokens that followed it."""

    kind = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    @staticmethod
    def _lookup(seq: Sequence[int], n: int, k: int) -> list[int]:
        if len(seq) <= n:
            return []
        pattern = list(seq[-n:])
        # latest match first: recent context predicts the continuation best
        for start in range(len(seq) - n - 1, -1, -1):
            if list(seq[start:start + n]) == pattern:
                return list(seq[start + n:start + n + k])
        return []

    def propose(self, tokens, k, sampling, generator):
        out = torch.full((len(tokens), k), -1, dtype=torch.long)
        for b, seq in enumerate(tokens):
            for n in range(self.max_n, self.min_n - 1, -1):
                cont = self._lookup(seq, n, k)
                if cont:
                    out[b, :len(cont)] = torch.tensor(cont)
                    break
        return out, None


class _CachedDraftModel(Drafter):
    """Shared bookkeeping for drafters with their own KV cache: ``lens[slot]`` valid entries and
    ``pending[slot]``, the (token, aux) pairs not yet run through the draft."""

    def __init__(self) -> None:
        self.cache = None
        self.pending_tokens: list[list[int]] = []
        self.pending_aux: list[torch.Tensor | None] = []

    def _new_cache(self, num_slots: int, max_len: int):
        raise NotImplementedError

    def allocate(self, num_slots, max_len):
        self.cache = self._new_cache(num_slots, max_len)
        self.pending_tokens = [[] for _ in range(num_slots)]
        self.pending_aux = [None] * num_slots

    def release(self):
        self.cache = None

    def move(self, src, dst):
        self.cache.move(src, dst)
        self.pending_tokens[dst] = self.pending_tokens[src]
        self.pending_aux[dst] = self.pending_aux[src]

    def copy_prefix(self, src, dsts):
        self.cache.copy_prefix(src, list(dsts), int(self.cache.lens[src]))

    def _pad_pending(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Pending tokens/aux of slots ``0..B-1`` padded to ``[B, M]``; also their lengths ``[B]``."""
        lens = torch.tensor([len(self.pending_tokens[b]) for b in range(batch)])
        if int(lens.min()) < 1:
            raise RuntimeError("draft has no pending token for a running row (engine bookkeeping bug)")
        m = int(lens.max())
        ids = torch.zeros(batch, m, dtype=torch.long)
        for b in range(batch):
            ids[b, :lens[b]] = torch.tensor(self.pending_tokens[b])
        aux = None
        if self.pending_aux[0] is not None:
            a = self.pending_aux[0].shape[-1]
            aux = self.pending_aux[0].new_zeros(batch, m, a)
            for b in range(batch):
                aux[b, :lens[b]] = self.pending_aux[b]
        positions = self.cache.lens[:batch].unsqueeze(1) + torch.arange(m)  # [B, M]
        return ids, lens, positions, aux


class ModelDrafter(_CachedDraftModel):
    """A small causal LM of a supported family as the draft (same tokenizer as the target)."""

    kind = "model"

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self._fed = 0  # provisional entries written during the last propose

    def _new_cache(self, num_slots, max_len):
        return self.model.new_cache(num_slots, max_len)

    def prefill(self, slot_offset, prompts, aux):
        # The draft sees all prompt tokens but the last; the last one is pending with the first
        # sampled token, so every sample of the prompt runs its own continuation.
        p = len(prompts)
        lens = torch.tensor([len(x) - 1 for x in prompts])
        self.cache.lens[slot_offset:slot_offset + p] = lens
        m = int(lens.max())
        if m == 0:
            return
        ids = torch.zeros(p, m, dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, :len(x) - 1] = torch.tensor(x[:-1])
        positions = torch.arange(m).expand(p, m)
        self.model(ids, positions, self.cache, lens.clamp(min=1), logits_index=torch.zeros(p, 1, dtype=torch.long),
                   slot_offset=slot_offset)

    def start(self, slot, prompt, first_token, last_aux):
        # the prompt's last token and the sampled first token are not in the draft cache yet
        self.pending_tokens[slot] = [int(prompt[-1]), first_token]

    def propose(self, tokens, k, sampling, generator):
        b = len(tokens)
        ids, lens, positions, _ = self._pad_pending(b)
        base = self.cache.lens[:b].clone()
        logits, _ = self.model(ids, positions, self.cache, base + lens, logits_index=(lens - 1).unsqueeze(1))
        self.cache.lens[:b] = base + lens
        drafts, probs = [], []
        last = None
        for j in range(k):
            if j > 0:
                pos = (self.cache.lens[:b] + (j - 1)).unsqueeze(1)
                logits, _ = self.model(last.unsqueeze(1), pos, self.cache, pos.squeeze(1) + 1)
            lp = process_logits(logits[:, -1], sampling)  # [B, V]
            last = sample_from_logprobs(lp, sampling.greedy, generator=generator)
            drafts.append(last)
            probs.append(lp.exp())
        self._fed = k - 1
        return torch.stack(drafts, 1), torch.stack(probs, 1)

    def commit(self, emitted, num_accepted, verify_aux):
        # Entries written for accepted drafts are exact (same tokens, same positions): keep them.
        for b, (em, a) in enumerate(zip(emitted, num_accepted)):
            keep = min(a, self._fed)
            self.cache.lens[b] += keep
            self.pending_tokens[b] = list(em[keep:])


class Eagle3Drafter(_CachedDraftModel):
    """EAGLE-3: the draft layer reads ``cat(embed(token), fc(aux hidden states))``.

    Pairs ``(target hidden at position i, token i+1)`` enter the draft's cache at position i.
    After each verify step the pairs of the accepted positions are recomputed with the
    target's hidden states (the entries written while drafting used the draft's own hidden
    states and are rolled back), as SGLang's draft-extend does.
    """

    kind = "eagle3"

    def __init__(self, head, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.head = head
        self.embed = embed
        self.aux_layers = tuple(head.cfg.aux_layer_ids)
        self.d2t = head.d2t

    def _new_cache(self, num_slots, max_len):
        return self.head.new_cache(num_slots, max_len)

    def _run(self, ids, aux_or_hidden, positions, kv_lens, logits_index, slot_offset=0, fused=False):
        emb = self.embed(ids)
        hidden = aux_or_hidden if fused else self.head.fuse(aux_or_hidden)
        return self.head(emb, hidden, positions, self.cache, kv_lens, logits_index=logits_index,
                         slot_offset=slot_offset)

    def prefill(self, slot_offset, prompts, aux):
        p = len(prompts)
        lens = torch.tensor([len(x) - 1 for x in prompts])
        self.cache.lens[slot_offset:slot_offset + p] = lens
        m = int(lens.max())
        if m == 0:
            return
        ids = torch.zeros(p, m, dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, :len(x) - 1] = torch.tensor(x[1:])  # token i+1 pairs with hidden i
        positions = torch.arange(m).expand(p, m)
        self._run(ids, aux[:, :m], positions, lens.clamp(min=1), torch.zeros(p, 1, dtype=torch.long),
                  slot_offset=slot_offset)

    def start(self, slot, prompt, first_token, last_aux):
        self.pending_tokens[slot] = [first_token]
        self.pending_aux[slot] = last_aux.reshape(1, -1)

    def propose(self, tokens, k, sampling, generator):
        b = len(tokens)
        ids, lens, positions, aux = self._pad_pending(b)
        base = self.cache.lens[:b].clone()
        logits, hidden = self._run(ids, aux, positions, base + lens, (lens - 1).unsqueeze(1))
        self.cache.lens[:b] = base + lens  # pairs with target hidden states are permanent
        drafts, probs = [], []
        h = hidden.gather(1, (lens - 1).view(b, 1, 1).expand(-1, 1, hidden.shape[-1]))  # [B, 1, H]
        for j in range(k):
            if j > 0:
                pos = (self.cache.lens[:b] + (j - 1)).unsqueeze(1)
                logits, h = self._run(last_target.unsqueeze(1), h, pos, pos.squeeze(1) + 1, None, fused=True)
            lp = process_logits(logits[:, -1], sampling)  # [B, Vd]
            d = sample_from_logprobs(lp, sampling.greedy, generator=generator)
            last_target = d + self.d2t[d] if self.d2t is not None else d
            drafts.append(last_target)
            probs.append(lp.exp())
        return torch.stack(drafts, 1), torch.stack(probs, 1)

    def commit(self, emitted, num_accepted, verify_aux):
        for b, em in enumerate(emitted):
            n = len(em)
            self.pending_tokens[b] = list(em)
            self.pending_aux[b] = verify_aux[b, :n]
