"""The native engine's scheduler: continuous batching with optional speculative decoding.

One :meth:`EngineCore.generate` call runs a list of requests to completion:

* **Admission.** Waiting prompts join whenever enough slots are free. Their prompts are prefilled
  together (padded batch; a beginning they share runs once: ``prefix_share.py``), then each prompt's
  cache is copied into the slots of its ``n`` samples, whose first tokens are sampled from the shared
  prefill logits. A prompt with more samples than the batch has slots starts as many as are free; its
  prefill waits in a parking slot beyond the batch's for the others, which start from it as slots free
  up (``admission.py``). While other rows are running, the prefill rides along with their next step:
  one target forward over both (``CausalLM.forward_segments``) reads the weights once for the step and
  the prompts.
* **Steps.** Every step advances all running rows at once: a plain step decodes one token;
  a speculative step asks the drafter for k tokens per row, runs the target once over the
  k+1 positions, and verifies with ``megatron_spec.speculative.verify_chain`` (accept with
  min(1, p/q), residual on rejection, bonus token when all pass). Rejected positions are
  rolled back by resetting cache lengths.
* **Draft length.** With ``adaptive`` the k of each speculative step is chosen in
  ``0..num_draft_tokens`` by ``adaptive.DraftLengthController`` from acceptance per position
  (per request and per batch) and the step and draft times this engine measured; k = 0 is a
  plain step that still feeds the drafter (its state stays in sync). With a ``history`` drafter
  beside the main one, each row of each step drafts from the source the controller expects
  to emit more tokens: history rows are verified with a point-mass q, the others with the
  drafter's q, in two ``verify_chain`` calls over the same target forward; or the step is a
  *tree*: every row drafts from the main drafter and the rows with a history proposal also
  carry it as a second branch of the same verify (``spec_step.tree_segment``, ``verify_tree``; the
  winning branch's cache entries are moved into place). The speculative step is its own module
  (``spec_worker.SpeculativeWorker``); this one keeps the batch, the slots and the caches.
* **Retirement.** A row finishes at a stop token or ``max_new_tokens``; its slot is refilled by
  moving the last running row into it, so the batch stays in slots ``0..B-1``.

The target cache always holds every token of a row but its last one (which is the input of
the next step). Log-probs reported per token are the target's under the processed
distribution it was sampled from (greedy rows: the unscaled policy), taken from the same
forward that verified it.

This module runs in the engine process (see ``server.py``); it knows nothing of IPC.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence

import torch

from megatron_spec.rollout.native.adaptive import DraftLengthController
from megatron_spec.rollout.native.admission import ParkedPrompt, plan_admission
from megatron_spec.rollout.native.drafters import Drafter
from megatron_spec.rollout.native.history_drafter import HistoryDrafter
from megatron_spec.rollout.native.model import CausalLM, Segment
from megatron_spec.rollout.native.prefix_share import admit
from megatron_spec.rollout.native.rows import Admission, Row, sampling_of
from megatron_spec.rollout.native.spec_worker import SpeculativeWorker
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput
from megatron_spec.speculative import SamplingTensors, process_logits
from megatron_spec.speculative.verify import sample_from_logprobs

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve (too long for the context, bad parameters)."""


class EngineCore:
    """Target model + drafter + caches; generates batches of requests."""

    def __init__(self, model: CausalLM, drafter: Drafter | None, *, num_draft_tokens: int = 3,
                 max_batch_size: int = 32, context_length: int = 2048, seed: int = 0,
                 prefill_token_budget: int = 8192, eos_token_ids: Sequence[int] = (), adaptive: bool = False,
                 history: HistoryDrafter | None = None, history_max_draft_tokens: int | None = None,
                 history_tree: str = "auto", share_prefix: bool = True):
        if drafter is not None and num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 with a drafter, got {num_draft_tokens}")
        if history is not None and (drafter is None or not adaptive):
            raise ValueError("a history drafter beside the main one needs a main drafter and adaptive k "
                             "(the per-row choice of source is the adaptive controller's)")
        self.model = model
        self.drafter = drafter
        self.history = history
        """A second draft source (``HistoryDrafter``) chosen per row and step; None: the drafter only."""
        self.k = num_draft_tokens if drafter is not None else 0
        """k, or k_max with ``adaptive`` (of the main drafter)."""
        self.k_history = 0 if history is None else (history_max_draft_tokens or self.k)
        """The longest history proposal beside the main drafter (drafted in steps where the main drafter
        does not run: a proposal from the history costs no forward, so it may be longer)."""
        self.k_all = max(self.k, self.k_history)
        """The most drafts one row can have accepted in a step (a chain of k, a history proposal)."""
        self.k_tree = self.k_history if history is not None and history_tree != "off" else 0
        """The longest history branch beside the main drafter's k in a tree step (0: no tree steps)."""
        self.controller = None
        if adaptive and drafter is not None:
            k_min = 0 if drafter.supports_skip else 1
            self.controller = DraftLengthController(
                self.k_all, k_min=k_min, k_main=self.k, k_tree=self.k_tree, tree=history_tree
            )
        self.share_prefix = share_prefix
        """Prompts admitted together run a beginning they share once (``prefix_share.py``) where it pays."""
        self.max_batch_size = max_batch_size
        self.context_length = context_length
        self.prefill_token_budget = prefill_token_budget
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.device = model.device
        """Where the model, the caches and every tensor of a step live (the model's device)."""
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        """Draws every uniform of sampling and verification, on the engine's device."""
        self.cache = None
        self.park_slot = max_batch_size
        """The cache slot beyond the batch's holding a parked prompt's prefill (``admission.py``)."""
        self._parked: ParkedPrompt | None = None
        self.spec_enabled = drafter is not None
        """The acceptance-collapse watchdog may turn speculation off (see ``sync``/``rl``)."""
        self.spec = SpeculativeWorker(self) if drafter is not None else None
        """The speculative step (``spec_worker.py``): propose, verify, commit, account."""
        self.weight_version: str | None = None
        self.draft_weight_version: str | None = None
        """The versions of the weights loaded (:meth:`set_weight_versions`), stamped on every sample."""

    def set_weight_versions(self, target: str | None, draft: str | None) -> None:
        """What the server loaded last: every sample finished from now on carries these versions."""
        self.weight_version, self.draft_weight_version = target, draft

    # ------------------------------------------------------------------ memory
    def allocate(self) -> None:
        # spare positions: a verify step writes up to k+1 entries past a row's length (1+k+m: a tree)
        max_len = self.context_length + max(self.k_all, self.k + self.k_tree) + 1
        slots = self.max_batch_size + 1  # the batch's and the parking slot
        self.cache = self.model.new_cache(slots, max_len)
        if self.drafter is not None:
            self.drafter.allocate(slots, max_len)
        if self.history is not None:
            self.history.allocate(slots, max_len)

    def release(self) -> None:
        self.cache = None
        if self.drafter is not None:
            self.drafter.release()

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    # ------------------------------------------------------------------ api
    def validate(self, req: GenerateRequest) -> None:
        need = len(req.input_ids) + req.sampling.max_new_tokens
        if need > self.context_length:
            raise RequestError(
                f"request {req.request_id}: prompt of {len(req.input_ids)} tokens + max_new_tokens "
                f"{req.sampling.max_new_tokens} exceeds the engine context of {self.context_length}"
            )
        vocab = self.model.cfg.vocab_size
        bad = [t for t in req.input_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"request {req.request_id}: token id {bad[0]} outside the vocabulary [0, {vocab})"
            )

    def generate(self, requests: Sequence[GenerateRequest],
                 on_sample_done: Callable[[SampleOutput], None] | None = None, seed: int | None = None
                 ) -> tuple[list[SampleOutput], GenerateStats]:
        """Run ``requests`` to completion; returns samples (request order, then sample index).

        ``seed`` re-seeds the sampling generator first, so a call's samples depend only on
        its requests and seed (what makes a resumed RL run reproduce its rollouts).
        """
        steps = self.generate_steps(requests, on_sample_done, seed)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    @torch.inference_mode()
    def generate_steps(self, requests: Sequence[GenerateRequest],
                       on_sample_done: Callable[[SampleOutput], None] | None = None, seed: int | None = None
                       ) -> Generator[None, None, tuple[list[SampleOutput], GenerateStats]]:
        """:meth:`generate` one scheduler step at a time: yields after every step (a prefill on its own
        counts as one) and returns ``generate``'s result. What lets a benchmark run two engines' calls
        step by step in turn, so that both meet the same moments of a drifting machine; the steps are
        ``generate``'s own (the same draws, the same tokens). ``stats.wall_s`` spans the whole call,
        time spent between the steps included."""
        for r in requests:
            self.validate(r)
        if seed is not None:
            self.generator.manual_seed(seed)
        if self.cache is None:
            self.allocate()
        t0 = time.perf_counter()
        stats = GenerateStats(num_draft_tokens=self.k_all if self.spec_enabled else 0)
        for d in (self.drafter, self.history):
            if d is not None:
                d.begin_call()
        waiting = deque(requests)
        rows: list[Row] = []
        done: list[SampleOutput] = []
        sampling = None
        self._parked = None
        while waiting or rows or self._parked is not None:
            if self._unpark(rows):  # a first token may end a sample: retired before any step
                self._retire(rows, on_sample_done, done)
                sampling = None  # the batch changed
                continue
            if not rows:  # nothing running: the prompts are prefilled on their own
                adm = self._take(waiting, rows)
                if adm is not None:
                    self.start(adm, rows, *self.model.forward_segments([adm.segment], self.cache,
                                                                         aux_layers=self._aux_layers())[0])
                self._retire(rows, on_sample_done, done)
                sampling = None
                yield
                continue
            if sampling is None:
                sampling = sampling_of(rows, self.device)
            adm = self._take(waiting, rows)  # prefilled in this step's forward, joins after it
            if self.spec_enabled and self.spec is not None:
                self.spec.step(rows, sampling, stats, adm)
            else:
                self._plain_step(rows, sampling, stats, adm)
            if self._retire(rows, on_sample_done, done) or adm is not None:
                sampling = None  # the batch changed
            yield
        stats.wall_s = time.perf_counter() - t0
        order = {r.request_id: i for i, r in enumerate(requests)}
        done.sort(key=lambda s: (order[s.request_id], s.sample_index))
        stats.num_tokens = sum(len(s.output_ids) for s in done)
        stats.num_verify_steps = sum(s.num_verify_steps for s in done)
        return done, stats

    # ------------------------------------------------------------------ internals
    def sync(self) -> None:
        """Wait for the device's queued kernels (a GPU runs them after the host returns); before a
        timing the adaptive controller learns from. Nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stop_ids(self, req: GenerateRequest) -> frozenset[int]:
        ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            ids |= self.eos_token_ids
        return frozenset(ids)

    def token_logprobs(self, logits: torch.Tensor, lp: torch.Tensor, tokens: torch.Tensor,
                        greedy: torch.Tensor) -> torch.Tensor:
        """Reported log-probs ``[B, T]``: processed for sampled rows, unscaled for greedy rows."""
        out = lp.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        if bool(greedy.any()):
            raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out = torch.where(greedy.view(-1, *([1] * (out.dim() - 1))), raw, out)
        return out

    def _aux_layers(self) -> tuple[int, ...]:
        return self.drafter.aux_layers if self.drafter is not None else ()

    def _take(self, waiting: deque, rows: list[Row]) -> Admission | None:
        """Take the waiting requests for the free slots (``admission.plan_admission``): one with more
        samples than the batch has slots may start some of them, the others parked."""
        batch, counts = plan_admission(waiting, self.max_batch_size - len(rows), self.prefill_token_budget,
                                       may_split=self._parked is None, slots=self.max_batch_size)
        return (admit(self.model, self.cache, batch, len(rows), counts, self._aux_layers(), self.share_prefix)
                if batch else None)

    def forward(self, seg: Segment, adm: Admission | None, aux_layers: Sequence[int]):
        """The step's forward, with ``adm``'s prefill riding along; returns the step's (logits,
        aux) and the prefill's (None without ``adm``)."""
        if adm is None:
            return self.model.forward_segments([seg], self.cache, aux_layers=aux_layers)[0], None
        aux = self._aux_layers()  # the drafter's prefill reads them
        return tuple(self.model.forward_segments([seg, adm.segment], self.cache, aux_layers=aux))

    def start(self, adm: Admission, rows: list[Row], logits: torch.Tensor, aux: torch.Tensor | None) -> None:
        """After ``adm``'s prefill forward (``logits [P, 1, V]`` at each prompt's last position,
        ``aux [P, T, A]``): fill the draft's cache, spread each prompt to the slots of its
        samples, sample their first tokens and append them to ``rows``."""
        batch, base, lens, n, counts = (adm.batch, adm.segment.slot_offset, adm.segment.kv_lens, adm.lens,
                                         adm.counts)
        p = len(batch)
        self.cache.lens[base:base + p] = lens  # the sampled first token is the next step's input
        aux = adm.whole_aux(aux)
        if self.drafter is not None:
            self.drafter.prefill(base, [r.input_ids for r in batch], aux)
        last_aux = [aux[i, n[i] - 1] if aux is not None else None for i in range(p)]  # [A] per prompt
        # spread each prompt to the slots of its samples (backwards: targets lie at or after sources)
        starts = [base + sum(counts[:i]) for i in range(p)]
        for i in reversed(range(p)):
            dsts = list(range(starts[i], starts[i] + counts[i]))
            if starts[i] != base + i:
                self.cache.move(base + i, starts[i])
                if self.drafter is not None:
                    self.drafter.move(base + i, starts[i])
            if counts[i] < batch[i].n:  # the other samples start from the parked prefill later
                self._copy_prompt(starts[i], [self.park_slot], n[i])
                self._parked = ParkedPrompt(batch[i], counts[i], logits[i, 0].clone(),
                                            None if last_aux[i] is None else last_aux[i].clone(), n[i])
            self._copy_prompt(starts[i], dsts, n[i])
        # first tokens, one per sample, from each prompt's last-position logits
        reps = torch.tensor(counts, device=self.device)
        first_logits = logits[:, 0].repeat_interleave(reps, dim=0, output_size=sum(counts))  # [N, V]
        new_rows = [Row(r, s, list(r.input_ids), self._stop_ids(r)) for r, c in zip(batch, counts)
                    for s in range(c)]
        self._begin(rows, new_rows, first_logits, [a for a, c in zip(last_aux, counts) for _ in range(c)])

    def _copy_prompt(self, src: int, dsts: list[int], length: int) -> None:
        """Slot ``src``'s prompt (``length`` positions; the drafter's prompt state) into ``dsts``."""
        self.cache.copy_prefix(src, dsts, length)
        if self.drafter is not None:
            self.drafter.copy_prefix(src, dsts)

    def _unpark(self, rows: list[Row]) -> bool:
        """Start as many of the parked prompt's other samples as slots are free (no prefill: its cache is
        copied from the parking slot); returns whether any started."""
        parked, free = self._parked, self.max_batch_size - len(rows)
        if parked is None or free <= 0:
            return False
        count = min(free, parked.remaining)
        self._copy_prompt(self.park_slot, list(range(len(rows), len(rows) + count)), parked.length)
        req = parked.req
        new_rows = [Row(req, parked.next_sample + s, list(req.input_ids), self._stop_ids(req))
                    for s in range(count)]
        self._begin(rows, new_rows, parked.logits.expand(count, -1), [parked.last_aux] * count)
        parked.next_sample += count
        if not parked.remaining:
            self._parked = None
        return True

    def _begin(self, rows: list[Row], new_rows: list[Row], first_logits: torch.Tensor,
               last_aux: list[torch.Tensor | None]) -> None:
        """Samples whose prompts are in slots ``len(rows)..``: each one's first token drawn from its prompt's
        last-position logits (``first_logits [N, V]``), the drafters told (``last_aux``: each one's ``[A]``);
        appended to ``rows``."""
        base = len(rows)
        sampling = sampling_of(new_rows, self.device)
        lp = process_logits(first_logits, sampling)
        tok = sample_from_logprobs(lp, sampling.greedy, generator=self.generator)
        tok_lp = self.token_logprobs(first_logits, lp, tok, sampling.greedy)
        for j, (row, t_, l_) in enumerate(zip(new_rows, tok.tolist(), tok_lp.tolist())):
            if self.drafter is not None:
                self.drafter.start(base + j, row.req.input_ids, t_, last_aux[j])
                if self.history is not None:
                    self.history.start(base + j, row.req.input_ids, t_, None)
            row.emit(t_, l_)
        rows.extend(new_rows)

    def _retire(self, rows: list[Row], on_done, done: list[SampleOutput]) -> bool:
        finished = [i for i, r in enumerate(rows) if r.finish is not None]
        if not finished:
            return False
        for i in reversed(finished):
            r = rows[i]
            out = SampleOutput(r.req.request_id, r.sample_index, r.out, r.logprobs, r.finish, r.verify_steps,
                               r.accepted, weight_version=self.weight_version,
                               draft_weight_version=self.draft_weight_version,
                               draft_lengths=r.draft_lengths, draft_sources=r.sources)
            for d in (self.drafter, self.history):
                if d is not None:
                    d.finish(i, r.req.input_ids, r.out)
            done.append(out)
            if on_done is not None:
                on_done(out)
            last = len(rows) - 1
            if i != last:
                self.cache.move(last, i)
                if self.drafter is not None:
                    self.drafter.move(last, i)
                if self.history is not None:
                    self.history.move(last, i)
                rows[i] = rows[last]
            rows.pop()
        return True

    def _plain_step(self, rows: list[Row], sampling: SamplingTensors, stats: GenerateStats,
                    adm: Admission | None = None) -> None:
        _, _, pre = self.decode(rows, sampling, adm, ())
        if adm is not None:
            self.start(adm, rows, *pre)

    def decode(self, rows: list[Row], sampling: SamplingTensors, adm: Admission | None,
               aux_layers: Sequence[int]) -> tuple[list[int], torch.Tensor | None, tuple | None]:
        """One token per row (``adm``'s prefill riding along), emitted to the rows; returns the tokens, the
        target's ``aux_layers`` states at the rows' last tokens (``[B, 1, A]``, or None) and the prefill's
        (logits, aux). A speculative step at k = 0 is this step, its drafter fed the states."""
        b = len(rows)
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        pos = self.cache.lens[:b].unsqueeze(1).clone()  # [B, 1]
        (logits, aux), pre = self.forward(Segment(ids, pos, pos.squeeze(1) + 1), adm, aux_layers)
        lp = process_logits(logits[:, 0], sampling)
        tok = sample_from_logprobs(lp, sampling.greedy, generator=self.generator)
        tok_lp = self.token_logprobs(logits[:, 0], lp, tok, sampling.greedy)
        self.cache.lens[:b] += 1
        tokens = tok.tolist()
        for r, t_, l_ in zip(rows, tokens, tok_lp.tolist()):
            r.verify_steps += 1
            r.emit(t_, l_)
        return tokens, aux, pre
