"""Drafters for the native engine: what proposes the k tokens the target verifies.

Every drafter implements :class:`Drafter`. The engine keeps the running batch in slots
``0..B-1`` and tells the drafter about slot moves, prompt prefills, and what each verify
step emitted; the drafter keeps whatever state it needs per slot (its own KV cache, the
target hidden states it has not consumed yet).

* :class:`NgramDrafter`: prompt lookup (no model, no distribution: q is a point mass).
* :class:`ModelDrafter`: a small causal LM of a supported family with the same tokenizer.
* :class:`Eagle3Drafter`: the EAGLE-3 head fusing the target's auxiliary hidden states
  (``megatron_spec.draft.eagle3``).
* :class:`~megatron_spec.rollout.native.mtp_drafter.MtpDrafter` (its own module): MTP heads
  (``megatron_spec.draft.mtp_head``).

Exactness never depends on the drafter: whatever is proposed, verification keeps the
target's distribution. Drafters only decide how often drafts are accepted and what they cost.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from megatron_spec.rollout.native.rows import pad_rows
from megatron_spec.rollout.native.thread_chooser import ThreadChooser
from megatron_spec.speculative import SamplingTensors, process_logits
from megatron_spec.speculative.verify import sample_from_logprobs


def draw(logits: torch.Tensor, sampling: SamplingTensors, generator: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of ``logits [B, V]`` and the distribution it was drawn from
    (``[B, V]``). An all-greedy batch takes the argmax and returns no distribution: greedy rows
    are verified by comparing tokens (the argmax is the token the one-hot processed distribution
    would give), so the log-softmax, the draw and ``exp`` would be host work for nothing."""
    if getattr(sampling, "_kind", "mixed") == "greedy":
        return logits.argmax(dim=-1), None
    lp = process_logits(logits, sampling)
    return sample_from_logprobs(lp, sampling.greedy, generator=generator), lp.exp()


def stack_probs(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``[B, k, V]`` draft distributions, or None when the drafts were argmaxes (all-greedy)."""
    return None if any(p is None for p in probs) else torch.stack(probs, 1)


class Drafter(abc.ABC):
    """Interface between the engine's scheduler and a draft source."""

    kind: str = "none"
    aux_layers: tuple[int, ...] = ()
    """Target decoder layers whose outputs the drafter consumes (EAGLE-3)."""
    d2t: torch.Tensor | None = None
    """Draft-to-target id offsets of a reduced draft vocabulary (draft probs are over it)."""
    supports_skip: bool = True
    """``propose(k=0)`` is allowed (a step drafting nothing; the drafter only keeps its state)."""
    sources: Sequence[str | None] = ()
    """Per slot: which index drafted its last proposal (``"live"``, ``"history"``, None: none); empty for a
    drafter with one source (the history drafter fills it)."""

    def begin_call(self) -> None:
        """A new ``generate`` call starts (history drafters age their index)."""

    def finish(self, slot: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """The sample in ``slot`` (of ``prompt``) finished with ``output`` (before its slot is reused)."""

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

    def start(
        self, slot: int, prompt: Sequence[int], first_token: int, last_aux: torch.Tensor | None
    ) -> None:
        """A sample in ``slot`` begins: ``first_token`` was sampled from the prefill of ``prompt``;
        ``last_aux [A]`` is the target's aux state at the prompt's last position."""

    @abc.abstractmethod
    def propose(self, tokens: Sequence[Sequence[int]], k: int, sampling: SamplingTensors,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ``k`` tokens for the rows in slots ``0..B-1``.

        Args:
            tokens: each row's full token list (prompt + generated so far).
            k: drafts per row; 0 (adaptive draft length) drafts nothing and returns ``[B, 0]``,
                the drafter only brings its state up to date for the next ``commit``.
        Returns:
            draft token ids ``[B, k]`` (target vocabulary; -1 ends a row's chain early) and the
            draft distributions they were sampled from ``[B, k, Vd]`` (None: point masses, or
            argmaxes of an all-greedy batch, which verification compares token by token).
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
        conts = []
        for seq in tokens:
            cont: list[int] = []
            for n in range(self.max_n, self.min_n - 1, -1):
                cont = self._lookup(seq, n, k)
                if cont:
                    break
            conts.append(cont)
        return pad_rows(conts, k, -1, "cpu"), None  # on the host: the engine moves it once


class _CachedDraftModel(Drafter):
    """Shared bookkeeping for drafters with their own KV cache: ``lens[slot]`` valid entries and
    ``pending[slot]``, the (token, aux) pairs not yet run through the draft."""

    def __init__(self) -> None:
        self.cache = None
        self.pending_tokens: list[list[int]] = []
        self.pending_aux: list[list[torch.Tensor] | None] = []  # per slot, ``[n, A]`` chunks in order
        self._skipped = False  # the last propose had k = 0: commit appends to the pending pairs
        self.threads = ThreadChooser()

    def _new_cache(self, num_slots: int, max_len: int):
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def allocate(self, num_slots, max_len):
        self.cache = self._new_cache(num_slots, max_len)
        self.threads.enabled = self.cache.device.type == "cpu"
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

    def _prompt_rows(self, slot_offset: int, prompts: Sequence[Sequence[int]], shift: int):
        """The first ``len - 1`` prompt tokens (from ``shift``) as a padded batch for the draft's
        prefill into slots ``slot_offset + i``; sets those slots' cache lengths. None if empty.

        Returns (ids ``[P, M]``, positions ``[P, M]``, kv_lens ``[P]``, logits_index ``[P, 1]``).
        """
        p, dev = len(prompts), self.device
        n = [len(x) - 1 for x in prompts]
        lens = torch.tensor(n, device=dev)
        self.cache.lens[slot_offset:slot_offset + p] = lens
        m = max(n)
        if m == 0:
            return None
        ids = pad_rows([list(x[shift:shift + n[i]]) for i, x in enumerate(prompts)], m, 0, dev)
        # rows shorter than m write padding past their length: masked out, overwritten later
        return (ids, torch.arange(m, device=dev).expand(p, m), lens.clamp(min=1),
                torch.zeros(p, 1, dtype=torch.long, device=dev))

    def _pad_pending(
        self, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Pending tokens/aux of slots ``0..B-1`` padded to ``[B, M]``; also their lengths ``[B]``."""
        dev = self.device
        n = [len(self.pending_tokens[b]) for b in range(batch)]
        if min(n) < 1:
            raise RuntimeError("draft has no pending token for a running row (engine bookkeeping bug)")
        m = max(n)
        ids, lens = pad_rows(self.pending_tokens[:batch], m, 0, dev), torch.tensor(n, device=dev)
        aux = None
        if self.pending_aux[0] is not None:
            first = self.pending_aux[0][0]
            aux = first.new_zeros(batch, m, first.shape[-1])
            for b in range(batch):
                at = 0
                for part in self.pending_aux[b]:
                    aux[b, at:at + part.shape[0]] = part
                    at += part.shape[0]
        # a row with fewer pending pairs than the longest writes padding past its own: those entries
        # are never read, but must stay inside the cache (the longest may be many steps' worth, after
        # steps where this drafter sat out, while a short row is near the end of the context)
        positions = (self.cache.lens[:batch].unsqueeze(1) + torch.arange(m, device=dev)).clamp(
            max=self.cache.max_len - 1
        )
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
        rows = self._prompt_rows(slot_offset, prompts, shift=0)
        if rows is not None:
            ids, positions, kv_lens, first = rows
            self.model(ids, positions, self.cache, kv_lens, logits_index=first, slot_offset=slot_offset)

    def start(self, slot, prompt, first_token, last_aux):
        # the prompt's last token and the sampled first token are not in the draft cache yet
        self.pending_tokens[slot] = [int(prompt[-1]), first_token]

    def propose(self, tokens, k, sampling, generator):
        b = len(tokens)
        self._skipped = k == 0
        if k == 0:
            return torch.empty(b, 0, dtype=torch.long, device=self.device), None
        with self.threads.run(b):
            return self._propose(b, k, sampling, generator)

    def _propose(self, b, k, sampling, generator):
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
            last, q = draw(logits[:, -1], sampling, generator)  # [B], [B, V]
            drafts.append(last)
            probs.append(q)
        self._fed = k - 1
        return torch.stack(drafts, 1), stack_probs(probs)

    def commit(self, emitted, num_accepted, verify_aux):
        if self._skipped:  # nothing was run: the emitted tokens join the pending ones
            for b, em in enumerate(emitted):
                self.pending_tokens[b] = self.pending_tokens[b] + list(em)
            return
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

    @property
    def d2t(self) -> torch.Tensor | None:
        return self.head.d2t  # the head's buffer, wherever the head was moved

    def _new_cache(self, num_slots, max_len):
        return self.head.new_cache(num_slots, max_len)

    def _run(self, ids, aux_or_hidden, positions, kv_lens, logits_index, slot_offset=0, fused=False):
        emb = self.embed(ids)
        hidden = aux_or_hidden if fused else self.head.fuse(aux_or_hidden)
        return self.head(emb, hidden, positions, self.cache, kv_lens, logits_index=logits_index,
                         slot_offset=slot_offset)

    def prefill(self, slot_offset, prompts, aux):
        rows = self._prompt_rows(slot_offset, prompts, shift=1)  # token i+1 pairs with hidden i
        if rows is not None:
            ids, positions, kv_lens, first = rows
            self._run(ids, aux[:, :ids.shape[1]], positions, kv_lens, first, slot_offset=slot_offset)

    def start(self, slot, prompt, first_token, last_aux):
        self.pending_tokens[slot] = [first_token]
        self.pending_aux[slot] = [last_aux.reshape(1, -1)]

    def propose(self, tokens, k, sampling, generator):
        b = len(tokens)
        self._skipped = k == 0
        if k == 0:
            return torch.empty(b, 0, dtype=torch.long, device=self.device), None
        ids, lens, positions, aux = self._pad_pending(b)
        base = self.cache.lens[:b].clone()
        # draft extend: every pending pair enters the cache, only the last one's output is needed
        logits, h = self._run(ids, aux, positions, base + lens, (lens - 1).unsqueeze(1))  # h: [B, 1, H]
        self.cache.lens[:b] = base + lens  # pairs with target hidden states are permanent
        drafts, probs = [], []
        last_target = None  # step j > 0 feeds the token step j - 1 drew (in target ids)
        for j in range(k):
            if j > 0:
                pos = (self.cache.lens[:b] + (j - 1)).unsqueeze(1)
                logits, h = self._run(last_target.unsqueeze(1), h, pos, pos.squeeze(1) + 1, None, fused=True)
            d, q = draw(logits[:, -1], sampling, generator)  # [B], [B, Vd]
            last_target = d + self.d2t[d] if self.d2t is not None else d
            drafts.append(last_target)
            probs.append(q)
        return torch.stack(drafts, 1), stack_probs(probs)

    def commit(self, emitted, num_accepted, verify_aux):
        for b, em in enumerate(emitted):
            n = len(em)
            if self._skipped:  # nothing was run: the new (token, aux) pairs join the pending ones
                self.pending_tokens[b] = self.pending_tokens[b] + list(em)
                # (kept as chunks, joined when the draft runs: a row sitting out many steps would otherwise
                # copy all its pending states again at every step)
                self.pending_aux[b] = self.pending_aux[b] + [verify_aux[b, :n]]
            else:
                self.pending_tokens[b] = list(em)
                self.pending_aux[b] = [verify_aux[b, :n]]
