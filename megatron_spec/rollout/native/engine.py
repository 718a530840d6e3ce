"""The native engine's scheduler: continuous batching with optional speculative decoding.

One :meth:`EngineCore.generate` call runs a list of requests to completion:

* **Admission.** Waiting prompts join whenever enough slots are free. Their prompts are
  prefilled together (padded batch), then each prompt's cache is copied into the slots of its
  ``n`` samples, whose first tokens are sampled from the shared prefill logits. While other
  rows are running, the prefill rides along with their next step: one target forward over
  both (``CausalLM.forward_segments``) reads the weights once for the step and the prompts.
* **Steps.** Every step advances all running rows at once: a plain step decodes one token;
  a speculative step asks the drafter for k tokens per row, runs the target once over the
  k+1 positions, and verifies with ``megatron_spec.spec.verify_chain`` (accept with
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
  carry it as a second branch of the same verify (``tree_segment``, ``verify_tree``; the
  winning branch's cache entries are moved into place).
* **Retirement.** A row finishes at a stop token or ``max_new_tokens``; its slot is refilled by
  moving the last running row into it, so the batch stays in slots ``0..B-1``.

The target cache always holds every token of a row but its last one (which is the input of
the next step). Log-probs reported per token are the target's under the processed
distribution it was sampled from (greedy rows: the unscaled policy), taken from the same
forward that verified it.

This module runs in the engine process (see ``server.py``); it knows nothing of IPC.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from megatron_spec.rollout.native.adaptive import (
    AcceptanceStats,
    DraftLengthController,
    StepPlan,
    expected_tokens,
    tree_expected_tokens,
)
from megatron_spec.rollout.native.drafters import Drafter
from megatron_spec.rollout.native.model import CausalLM, Segment
from megatron_spec.rollout.native.rows import pad_rows
from megatron_spec.rollout.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    GenerateStats,
    SampleOutput,
)
from megatron_spec.spec import SamplingTensors, process_logits
from megatron_spec.spec.verify import sample_from_logprobs, verify_chain, verify_tree

logger = logging.getLogger(__name__)


def tree_segment(inputs: torch.Tensor, base: torch.Tensor, k: int, m: int) -> Segment:
    """The verify forward of a two-branch tree: ``inputs [B, 1+k+m]`` = the last token, the first
    branch x_1..x_k, the second y_1..y_m, of rows whose caches hold ``base [B]`` tokens. x_i and y_i
    both sit at RoPE position ``base + i``; their K/V are written one after the other to cache
    positions ``base..base+k+m``; x_i sees the prefix, the last token and x_1..x_i, y_i the prefix,
    the last token and y_1..y_i."""
    b, t = inputs.shape
    dev = inputs.device
    rope = torch.cat([torch.arange(k + 1, device=dev), torch.arange(1, m + 1, device=dev)])
    visible = torch.zeros(t, t, dtype=torch.bool, device=dev)
    visible[:k + 1, :k + 1] = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril()
    visible[k + 1:, 0] = True
    visible[k + 1:, k + 1:] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
    return Segment(inputs, base.unsqueeze(1) + rope, base + t,
                   cache_positions=base.unsqueeze(1) + torch.arange(t, device=dev), visible=visible.expand(b, t, t))


class RequestError(ValueError):
    """A request the engine cannot serve (too long for the context, bad parameters)."""


@dataclasses.dataclass
class _Row:
    req: GenerateRequest
    sample_index: int
    tokens: list[int]
    stop_ids: frozenset[int]
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    draft_lengths: list[int] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)
    verify_steps: int = 1  # the prefill produced the first token
    finish: str | None = None
    acc: dict[str, AcceptanceStats] = dataclasses.field(default_factory=dict)
    """This request's acceptance per position, per draft source (adaptive k)."""

    def emit(self, token: int, logprob: float) -> bool:
        """Append one token; returns True when the row is finished."""
        self.tokens.append(token)
        self.out.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish = FINISH_STOP
        elif len(self.out) >= self.req.sampling.max_new_tokens:
            self.finish = FINISH_LENGTH
        return self.finish is not None


@dataclasses.dataclass
class _Admission:
    """Requests taken from the queue and their prefill (into slots ``segment.slot_offset..``,
    prompt lengths ``segment.kv_lens``; see ``_take``)."""

    batch: list[GenerateRequest]
    segment: Segment
    lens: list[int]
    """Prompt lengths (on the host: read per prompt while spreading the prefill)."""


class EngineCore:
    """Target model + drafter + caches; generates batches of requests."""

    def __init__(self, model: CausalLM, drafter: Drafter | None, *, num_draft_tokens: int = 3,
                 max_batch_size: int = 32, context_length: int = 2048, seed: int = 0,
                 prefill_token_budget: int = 8192, eos_token_ids: Sequence[int] = (), adaptive: bool = False,
                 history: Drafter | None = None, history_max_draft_tokens: int | None = None,
                 history_tree: str = "auto"):
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
            self.controller = DraftLengthController(self.k_all, k_min=k_min, k_main=self.k, k_tree=self.k_tree,
                                                    tree=history_tree)
        self.max_batch_size = max_batch_size
        self.context_length = context_length
        self.prefill_token_budget = prefill_token_budget
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.device = model.device
        """Where the model, the caches and every tensor of a step live (the model's device)."""
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        """Draws every uniform of sampling and verification, on the engine's device."""
        self.cache = None
        self.spec_enabled = drafter is not None
        """The acceptance-collapse watchdog may turn speculation off (see ``sync``/``rl``)."""

    # ------------------------------------------------------------------ memory
    def allocate(self) -> None:
        # spare positions: a verify step writes up to k+1 entries past a row's length (1+k+m: a tree)
        max_len = self.context_length + max(self.k_all, self.k + self.k_tree) + 1
        self.cache = self.model.new_cache(self.max_batch_size, max_len)
        if self.drafter is not None:
            self.drafter.allocate(self.max_batch_size, max_len)
        if self.history is not None:
            self.history.allocate(self.max_batch_size, max_len)

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
            raise RequestError(f"request {req.request_id}: prompt of {len(req.input_ids)} tokens + max_new_tokens "
                               f"{req.sampling.max_new_tokens} exceeds the engine context of {self.context_length}")
        if req.n > self.max_batch_size:
            raise RequestError(f"request {req.request_id}: n={req.n} exceeds max_batch_size {self.max_batch_size}")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in req.input_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {req.request_id}: token id {bad[0]} outside the vocabulary [0, {vocab})")

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerateRequest],
                 on_sample_done: Callable[[SampleOutput], None] | None = None, seed: int | None = None
                 ) -> tuple[list[SampleOutput], GenerateStats]:
        """Run ``requests`` to completion; returns samples (request order, then sample index).

        ``seed`` re-seeds the sampling generator first, so a call's samples depend only on
        its requests and seed (what makes a resumed RL run reproduce its rollouts).
        """
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
        rows: list[_Row] = []
        done: list[SampleOutput] = []
        sampling = None
        while waiting or rows:
            if not rows:  # nothing running: the prompts are prefilled on their own
                adm = self._take(waiting, rows)
                if adm is not None:
                    self._start(adm, rows, *self.model.forward_segments([adm.segment], self.cache,
                                                                         aux_layers=self._aux_layers())[0])
                self._retire(rows, on_sample_done, done)
                sampling = None
                continue
            if sampling is None:
                sampling = self._sampling(rows)
            adm = self._take(waiting, rows)  # prefilled in this step's forward, joins after it
            if self.spec_enabled and self.drafter is not None:
                self._spec_step(rows, sampling, stats, adm)
            else:
                self._plain_step(rows, sampling, stats, adm)
            if self._retire(rows, on_sample_done, done) or adm is not None:
                sampling = None  # the batch changed
        stats.wall_s = time.perf_counter() - t0
        order = {r.request_id: i for i, r in enumerate(requests)}
        done.sort(key=lambda s: (order[s.request_id], s.sample_index))
        stats.num_tokens = sum(len(s.output_ids) for s in done)
        stats.num_verify_steps = sum(s.num_verify_steps for s in done)
        return done, stats

    # ------------------------------------------------------------------ internals
    def _sampling(self, rows: Sequence[_Row]) -> SamplingTensors:
        if not rows:
            return SamplingTensors.from_values(1.0, 0, 1.0, 0.0, batch_size=0, device=self.device)
        sp = [r.req.sampling for r in rows]
        return SamplingTensors.from_values([s.temperature for s in sp], [s.top_k for s in sp],
                                           [s.top_p for s in sp], [s.min_p for s in sp], device=self.device)

    def _sync(self) -> None:
        """Wait for the device's queued kernels (a GPU runs them after the host returns); before a
        timing the adaptive controller learns from. Nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stop_ids(self, req: GenerateRequest) -> frozenset[int]:
        ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            ids |= self.eos_token_ids
        return frozenset(ids)

    def _token_logprobs(self, logits: torch.Tensor, lp: torch.Tensor, tokens: torch.Tensor,
                        greedy: torch.Tensor) -> torch.Tensor:
        """Reported log-probs ``[B, T]``: processed for sampled rows, unscaled for greedy rows."""
        out = lp.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        if bool(greedy.any()):
            raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out = torch.where(greedy.view(-1, *([1] * (out.dim() - 1))), raw, out)
        return out

    def _aux_layers(self) -> tuple[int, ...]:
        return self.drafter.aux_layers if self.drafter is not None else ()

    def _take(self, waiting: deque, rows: list[_Row]) -> _Admission | None:
        """Take the waiting requests that fit the free slots (and the prefill token budget)."""
        free = self.max_batch_size - len(rows)
        batch: list[GenerateRequest] = []
        tokens = 0
        while waiting and waiting[0].n <= free - sum(r.n for r in batch):
            nxt = waiting[0]
            if batch and tokens + len(nxt.input_ids) > self.prefill_token_budget:
                break
            batch.append(waiting.popleft())
            tokens += len(nxt.input_ids)
        if not batch:
            return None
        base, p, dev = len(rows), len(batch), self.device
        n = [len(r.input_ids) for r in batch]
        t = max(n)
        ids = pad_rows([r.input_ids for r in batch], t, 0, dev)
        lens = torch.tensor(n, device=dev)
        seg = Segment(ids, torch.arange(t, device=dev).expand(p, t), lens, base, (lens - 1).unsqueeze(1))
        return _Admission(batch, seg, n)

    def _forward(self, seg: Segment, adm: _Admission | None, aux_layers: Sequence[int]):
        """The step's forward, with ``adm``'s prefill riding along; returns the step's (logits,
        aux) and the prefill's (None without ``adm``)."""
        if adm is None:
            return self.model.forward_segments([seg], self.cache, aux_layers=aux_layers)[0], None
        step, pre = self.model.forward_segments([seg, adm.segment], self.cache,
                                                aux_layers=self._aux_layers())  # the drafter's prefill reads them
        return step, pre

    def _start(self, adm: _Admission, rows: list[_Row], logits: torch.Tensor, aux: torch.Tensor | None) -> None:
        """After ``adm``'s prefill forward (``logits [P, 1, V]`` at each prompt's last position,
        ``aux [P, T, A]``): fill the draft's cache, spread each prompt to the slots of its
        samples, sample their first tokens and append them to ``rows``."""
        batch, base, lens, n = adm.batch, adm.segment.slot_offset, adm.segment.kv_lens, adm.lens
        p = len(batch)
        self.cache.lens[base:base + p] = lens  # the sampled first token is the next step's input
        if self.drafter is not None:
            self.drafter.prefill(base, [r.input_ids for r in batch], aux)
        # spread each prompt to the slots of its samples (backwards: targets lie at or after sources)
        starts = [base + sum(r.n for r in batch[:i]) for i in range(p)]
        for i in reversed(range(p)):
            dsts = list(range(starts[i], starts[i] + batch[i].n))
            if starts[i] != base + i:
                self.cache.move(base + i, starts[i])
                if self.drafter is not None:
                    self.drafter.move(base + i, starts[i])
            self.cache.copy_prefix(starts[i], dsts, n[i])
            if self.drafter is not None:
                self.drafter.copy_prefix(starts[i], dsts)
        # first tokens, one per sample, from each prompt's last-position logits
        reps = torch.tensor([r.n for r in batch], device=self.device)
        first_logits = logits[:, 0].repeat_interleave(reps, dim=0, output_size=sum(r.n for r in batch))  # [N, V]
        new_rows = [_Row(r, s, list(r.input_ids), self._stop_ids(r)) for r in batch for s in range(r.n)]
        sampling = self._sampling(new_rows)
        lp = process_logits(first_logits, sampling)
        tok = sample_from_logprobs(lp, sampling.greedy, generator=self.generator)
        tok_lp = self._token_logprobs(first_logits, lp, tok, sampling.greedy)
        prompt_of_row = [i for i, r in enumerate(batch) for _ in range(r.n)]
        for j, (row, t_, l_) in enumerate(zip(new_rows, tok.tolist(), tok_lp.tolist())):
            slot = base + j
            if self.drafter is not None:
                prompt_idx = prompt_of_row[j]
                last_aux = aux[prompt_idx, n[prompt_idx] - 1] if aux is not None else None
                self.drafter.start(slot, row.req.input_ids, t_, last_aux)
                if self.history is not None:
                    self.history.start(slot, row.req.input_ids, t_, None)
            row.emit(t_, l_)
        rows.extend(new_rows)

    def _retire(self, rows: list[_Row], on_done, done: list[SampleOutput]) -> bool:
        finished = [i for i, r in enumerate(rows) if r.finish is not None]
        if not finished:
            return False
        for i in reversed(finished):
            r = rows[i]
            out = SampleOutput(r.req.request_id, r.sample_index, r.out, r.logprobs, r.finish, r.verify_steps,
                               r.accepted, weight_version=getattr(self, "weight_version", None),
                               draft_weight_version=getattr(self, "draft_weight_version", None),
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

    def _plain_step(self, rows: list[_Row], sampling: SamplingTensors, stats: GenerateStats,
                    adm: _Admission | None = None) -> None:
        b = len(rows)
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        pos = self.cache.lens[:b].unsqueeze(1).clone()  # [B, 1]
        (logits, _), pre = self._forward(Segment(ids, pos, pos.squeeze(1) + 1), adm, ())
        lp = process_logits(logits[:, 0], sampling)
        tok = sample_from_logprobs(lp, sampling.greedy, generator=self.generator)
        tok_lp = self._token_logprobs(logits[:, 0], lp, tok, sampling.greedy)
        self.cache.lens[:b] += 1
        for r, t_, l_ in zip(rows, tok.tolist(), tok_lp.tolist()):
            r.verify_steps += 1
            r.emit(t_, l_)
        if adm is not None:
            self._start(adm, rows, *pre)

    def _spec_step(self, rows: list[_Row], sampling: SamplingTensors, stats: GenerateStats,
                   adm: _Admission | None = None) -> None:
        t0 = time.perf_counter()
        b, dev = len(rows), self.device
        tokens = [r.tokens for r in rows]
        main = self.drafter.kind
        hist = self.history.propose_lists(tokens, self.k_history) if self.history is not None else None
        t_draft = time.perf_counter() - t0
        if self.controller is None:
            plan, use_hist, options = StepPlan(self.k), [False] * b, None
        else:
            plan, use_hist, options = self._choose(rows, hist)
        k, hist_only, tree = plan.k, plan.mode == "history", plan.mode == "tree"
        t1 = time.perf_counter()
        main_ran = k > 0 and not hist_only and (not all(use_hist) or not self.drafter.supports_skip)
        if main_ran:
            drafts, q = self.drafter.propose(tokens, k, sampling, self.generator)  # [B, k], [B, k, Vd]
            drafts = drafts.to(dev)  # point-mass drafters (n-gram, history) propose on the host
        else:  # no row drafts from the main drafter: a k = 0 proposal only keeps its state in sync
            self.drafter.propose(tokens, 0, sampling, self.generator)
            drafts, q = torch.full((b, k), -1, dtype=torch.long, device=dev), None
        self._sync()  # the proposal's kernels are done: its time is what the controller learns
        t_main = time.perf_counter() - t1
        t_draft += t_main
        point = torch.tensor(use_hist, device=dev)  # [B] rows verified against a point mass (history drafts)
        if any(use_hist):
            hd = pad_rows([hist[i][:k] if u else [] for i, u in enumerate(use_hist)], k, -1, dev)
            drafts = torch.where(point.view(-1, 1), hd, drafts)
        last = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
        base = self.cache.lens[:b].clone()
        m = plan.m if tree else 0
        if tree:
            branch = pad_rows([h[:m] for h in hist], m, -1, dev)  # the second branch (history)
            seg = tree_segment(torch.cat([last, drafts.clamp(min=0), branch.clamp(min=0)], dim=1), base, k, m)
        else:
            inputs = torch.cat([last, drafts.clamp(min=0)], dim=1)
            # rows drafting fewer than k (a history-only step's other rows, shorter proposals) run packed
            valid = drafts >= 0
            pack = None if bool(valid.all()) else torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), valid],
                                                            dim=1)
            seg = Segment(inputs, base.unsqueeze(1) + torch.arange(k + 1, device=dev), base + k + 1, pack=pack)
        (logits, aux), pre = self._forward(seg, adm, self.drafter.aux_layers)
        lp = process_logits(logits, sampling)  # [B, k+1(+m), V]
        d2t = self.drafter.d2t if q is not None else None  # d2t maps q's vocabulary; drafts are target ids
        if tree:
            res = verify_tree(lp[:, :k + 1], drafts, q, lp[:, k + 1:], branch, d2t=d2t, greedy=sampling.greedy,
                              generator=self.generator)
            path = res.positions  # [B, k+m+1] the tree position that verified each emitted token
            own = res.first_accepted.tolist()
            base_h, second_len = base.tolist(), res.second_len.tolist()
            for i in res.second.nonzero()[:, 0].tolist():  # the history branch won: its K/V take the first's place
                self.cache.shift(i, base_h[i] + k + 1, base_h[i] + 1, second_len[i])
            if aux is not None:
                aux = aux.gather(1, path.unsqueeze(-1).expand(-1, -1, aux.shape[-1]))
        else:
            res = self._verify(lp, drafts, q, d2t, sampling.greedy, point)
            path = None
        tok_lp = res.logprobs
        if bool(sampling.greedy.any()):
            if path is not None:
                idx = path.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
                logits, lp = logits.gather(1, idx), lp.gather(1, idx)
            tok_lp = self._token_logprobs(logits, lp, res.tokens, sampling.greedy)
        emitted = res.emitted()
        accepted = res.num_accepted.tolist()
        if not tree:  # the main drafter's own drafts were accepted only on its rows
            own = [0 if u else a for a, u in zip(accepted, use_hist)]
        self.cache.lens[:b] = base + res.num_accepted + 1  # last token + accepted drafts are cached
        self.drafter.commit(emitted, own, aux)  # (a ModelDrafter keeps the entries of its accepted drafts)
        lps = tok_lp.tolist()
        second = res.second.tolist() if tree else None
        predicted = realized = 0.0
        for i, (r, em, a, l_, u, dr) in enumerate(zip(rows, emitted, accepted, lps, use_hist, drafts.tolist())):
            r.verify_steps += 1
            proposed = sum(1 for t_ in dr if t_ >= 0)
            two = tree and bool(hist[i])  # this row carried a second branch
            src = "tree" if two else ("history" if u else main)
            if two:
                proposed += min(m, len(hist[i]))
            r.draft_lengths.append(proposed)
            r.sources.append(src)
            stats.add_step_k(proposed)
            if k > 0 and not (hist_only and not u):  # a row that sat out a history-only step drafted nothing
                r.accepted.append(a)
                stats.add_spec_step(a, self.k_all, source=src)
                if self.controller is not None:
                    if tree:  # the first branch is verified as a chain: its own acceptance, unbiased
                        self.controller.record_accept(main, r.acc.setdefault(main, AcceptanceStats(self.k_all)),
                                                      k, own[i])
                    elif proposed > 0:
                        self.controller.record_accept(src, r.acc.setdefault(src, AcceptanceStats(self.k_all)),
                                                      proposed, a)
            if two:
                stats.tree_second += int(second[i])
                opts = options[i]
                predicted += tree_expected_tokens(opts[0][0], k, opts[1][0], opts[1][1], m) - 1.0
                realized += a
            if hist is not None and hist[i] and not u:
                self._record_unused_history(r, hist[i][:m] if two else hist[i], em)
            for j, t_ in enumerate(em):
                if r.emit(t_, l_[j]):
                    break
        if self.controller is not None:
            if tree:
                self.controller.record_tree(predicted, realized)
            # the draft table is the main drafter's: a step where it did not run teaches it nothing
            self.controller.record_step(b, k, time.perf_counter() - t0 - t_draft, t_main if main_ran else 0.0,
                                        prefill=adm is not None, m=m,
                                        tokens=None if seg.pack is None else int(seg.pack.sum()))
        if adm is not None:
            self._start(adm, rows, *pre)

    def _record_unused_history(self, row: _Row, proposal: list[int], emitted: list[int]) -> None:
        """Acceptance of a history proposal the row did not use, from what the row emitted: a point-mass
        draft x is accepted with probability p(x), the probability that the target's own token is x,
        so "proposal token j equals emitted token j" (given the earlier ones did) has the distribution
        of acceptance at position j. Positions past the emitted tokens are not observed. Without this,
        the history would only be judged on the rows where the main drafter looked weak (a biased
        sample) and, once judged badly there, never chosen again."""
        n = min(len(proposal), len(emitted))
        m = 0
        while m < n and proposal[m] == emitted[m]:
            m += 1
        self.controller.record_accept("history", row.acc.setdefault("history", AcceptanceStats(self.k_all)), n, m)

    def _choose(self, rows: list[_Row], hist: list[list[int]] | None) -> tuple[StepPlan, list[bool], list]:
        """The step's plan (``DraftLengthController.choose_step``: k, and whether every row drafts, only
        the rows with a history proposal, or a tree), per row whether it drafts from the history (in an
        ``all`` step: the source expected to emit more tokens at that k; ties go to the main drafter),
        and the rows' options the choice was made from."""
        main = self.drafter.kind
        options = []
        for i, r in enumerate(rows):
            opts = [(self.controller.row_alpha(main, r.acc.get(main)), None)]
            if hist is not None and hist[i]:
                opts.append((self.controller.row_alpha("history", r.acc.get("history")), len(hist[i])))
            options.append(opts)
        plan = self.controller.choose_step(options)
        if plan.mode == "history":
            return plan, [len(o) > 1 for o in options], options
        if plan.mode == "tree":
            return plan, [False] * len(options), options
        k = plan.k
        use = [len(o) > 1 and expected_tokens(o[1][0], k, o[1][1]) > expected_tokens(o[0][0], k) for o in options]
        return plan, use, options

    @staticmethod
    def _merge_rows(parts, idx, b: int, width: int):
        """Scatter per-group verify results back to rows ``idx`` of a ``[B, width]`` result."""
        from megatron_spec.spec.verify import VerifyResult

        dev = parts[0].tokens.device
        tokens = torch.full((b, width), -1, dtype=torch.long, device=dev)
        logprobs = torch.zeros(b, width, device=dev)
        num = torch.zeros(b, dtype=torch.long, device=dev)
        for res, ix in zip(parts, idx):
            tokens[ix], logprobs[ix], num[ix] = res.tokens, res.logprobs, res.num_accepted
        return VerifyResult(tokens=tokens, num_accepted=num, logprobs=logprobs)

    def _verify(self, lp, drafts, q, d2t, greedy, point: torch.Tensor):
        """``verify_chain``, split in two groups when some rows' drafts are point masses (history)
        and the others carry the drafter's q: each group is verified exactly by its own rule."""
        if q is None or not bool(point.any()):
            return verify_chain(lp, drafts, None if bool(point.all()) else q, d2t=d2t, greedy=greedy,
                                generator=self.generator)
        own = (~point).nonzero()[:, 0]
        pm = point.nonzero()[:, 0]
        a = verify_chain(lp[own], drafts[own], q[own], d2t=d2t, greedy=greedy[own], generator=self.generator)
        c = verify_chain(lp[pm], drafts[pm], None, greedy=greedy[pm], generator=self.generator)
        return self._merge_rows([a, c], [own, pm], lp.shape[0], lp.shape[1])
