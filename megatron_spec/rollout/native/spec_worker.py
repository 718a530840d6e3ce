"""The native engine's speculative step: **propose -> verify -> commit -> account**, over the rows the
scheduler (``engine.EngineCore``) keeps, as SGLang's speculative worker runs beside its scheduler.

* propose: the step's plan (fixed k, or the adaptive controller's: k, and whether every row drafts from
  its better source, only the rows with a history proposal, or a two-branch tree) and the drafts;
* verify: one target forward over each row's last token and drafts (the admitted prompts' prefill riding
  along), then rejection sampling: chain rows against the drafter's q or a point mass (history), tree
  rows by ``verify_tree``;
* commit: the kept path's K/V into place, the cache lengths, the drafter's state, the emitted tokens;
* account: per-row draft lengths, sources and acceptance, the step's statistics, and what the adaptive
  controller learns from them.

What passes between the parts (:class:`~megatron_spec.rollout.native.spec_step.Proposal`,
:class:`~megatron_spec.rollout.native.spec_step.Verified`) and the parts that hold no state live in
``spec_step.py``. The worker holds no state of its own: the caches, the drafters, the controller and the
generator are the scheduler's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from megatron_spec.rollout.native.adaptive import (
    AcceptObservation,
    DraftLengthController,
    StepOutcome,
    StepPlan,
)
from megatron_spec.rollout.native.cost_model import DraftOption, expected_tokens, tree_expected_tokens
from megatron_spec.rollout.native.measures import AcceptanceStats, paying_prefix
from megatron_spec.rollout.native.rows import Admission, Row, pad_rows
from megatron_spec.rollout.native.spec_step import (
    Proposal,
    RowPlan,
    Verified,
    chain_segment,
    tree_segment,
    verify_split,
)
from megatron_spec.rollout.types import GenerateStats
from megatron_spec.speculative import SamplingTensors, process_logits
from megatron_spec.speculative.verify import verify_tree

if TYPE_CHECKING:
    from megatron_spec.rollout.native.engine import EngineCore


class SpeculativeWorker:
    """The speculative step of an :class:`~megatron_spec.rollout.native.engine.EngineCore` with a drafter."""

    def __init__(self, core: EngineCore):
        self.core = core

    def step(self, rows: list[Row], sampling: SamplingTensors, stats: GenerateStats,
             adm: Admission | None = None) -> None:
        """Propose -> verify -> commit -> account; ``adm``'s prefill rides along."""
        core = self.core
        t0 = time.perf_counter()
        prop = self._propose(rows, sampling)
        if prop.k == 0:  # no row drafts: a plain step, its states fed to the drafter
            self._decode(rows, prop, sampling, stats, t0, adm)
            return
        ver = self._verify(rows, sampling, prop, adm)
        emitted, accepted, kept = self._commit(rows, prop, ver)
        self._account(rows, prop, ver, emitted, accepted, stats, t0, prefill=adm is not None, kept=kept)
        if adm is not None:
            core.start(adm, rows, *ver.prefill)

    def _propose(self, rows: list[Row], sampling: SamplingTensors) -> Proposal:
        """The step's plan and drafts: the history's proposals, the plan (fixed k, or the adaptive
        controller's), the main drafter's proposal (k = 0 where no row drafts from it: that only
        keeps its state in sync), history drafts put in the rows that use them."""
        core = self.core
        t0 = time.perf_counter()
        b, dev = len(rows), core.device
        tokens = [r.tokens for r in rows]
        hist = hist_full = srcs = support = None
        held = core.controller is not None and core.controller.holds(b)  # plain decoding held: no proposals
        if core.history is not None and not held:
            # per row: the drafts (live index or finished responses), whence, and a live proposal's support
            props = core.history.propose_rows(tokens, core.k_history)
            hist = hist_full = [p.tokens for p in props]
            srcs, support = [p.source for p in props], [p.support for p in props]
        t_draft = time.perf_counter() - t0
        if core.controller is None:
            plan, use_hist, options = StepPlan(core.k), [False] * b, [None] * b
        elif held:  # nothing priced (``exploration.Hold``)
            plan, use_hist, options = core.controller.keep_held(b), [False] * b, [None] * b
        else:
            plan, use_hist, options = plan_step(
                core.controller, core.drafter.kind, [r.acc for r in rows], hist, srcs, support
            )
            if hist is not None:  # what the rows draft: the paying prefix of a supported live proposal
                hist_full, hist = hist, [h[:o[1].limit] if len(o) > 1 else [] for h, o in zip(hist, options)]
        k = plan.k
        t1 = time.perf_counter()
        main_ran = k > 0 and plan.mode != "history" and (not all(use_hist) or not core.drafter.supports_skip)
        if main_ran:
            drafts, q = core.drafter.propose(tokens, k, sampling, core.generator)  # [B, k], [B, k, Vd]
            drafts = drafts.to(dev)  # point-mass drafters (n-gram, history) propose on the host
        else:
            core.drafter.propose(tokens, 0, sampling, core.generator)
            drafts, q = torch.full((b, k), -1, dtype=torch.long, device=dev), None
        core.sync()  # the proposal's kernels are done: its time is what the controller learns
        t_main = time.perf_counter() - t1
        if any(use_hist):  # history drafts into the rows verified against a point mass
            hd = pad_rows([hist[i][:k] if u else [] for i, u in enumerate(use_hist)], k, -1, dev)
            drafts = torch.where(torch.tensor(use_hist, device=dev).view(-1, 1), hd, drafts)
        branch = None
        if plan.mode == "tree":  # the second branch: each row's history proposal
            branch = pad_rows([h[:plan.m] for h in hist], plan.m, -1, dev)
        per_row = [
            RowPlan(
                use_hist[i],
                options[i],
                hist[i] if hist is not None else None,
                hist_full[i] if hist_full is not None else None,
                support[i] if support else None,
            )
            for i in range(b)
        ]
        return Proposal(plan, per_row, drafts, q, branch, main_ran, t_draft + t_main, t_main)

    def _decode(self, rows: list[Row], prop: Proposal, sampling: SamplingTensors, stats: GenerateStats,
                t0: float, adm: Admission | None) -> None:
        """A step at k = 0 (every row's plan): one token per row by the engine's plain step
        (``EngineCore.decode``: the same draws, the same tokens), the target's states at them to the drafter,
        and the step's accounting without the verify's per-row work (nothing was drafted, so nothing was
        accepted); a history proposal a row did not use still teaches its source."""
        core = self.core
        tokens, aux, pre = core.decode(rows, sampling, adm, core.drafter.aux_layers)
        b = len(rows)
        emitted = [[t] for t in tokens]
        core.drafter.commit(emitted, [0] * b, aux)
        kind = core.drafter.kind
        stats.add_step_k(0, b)
        observed: list[AcceptObservation] = []
        for i, (r, rp, em) in enumerate(zip(rows, prop.rows, emitted)):
            r.draft_lengths.append(0)
            r.sources.append(kind)
            if rp.hist_full and core.controller is not None:
                observed.append(unused_history_observation(r.acc, core.k_all, rp.hist_full, em,
                                                           self._source_label(i, "history"), rp.support))
        self._observe(prop, b, t0, kept=b, prefill=adm is not None, accepts=observed)
        if adm is not None:
            core.start(adm, rows, *pre)

    def _verify(self, rows: list[Row], sampling: SamplingTensors, prop: Proposal,
                adm: Admission | None) -> Verified:
        """One target forward over each row's last token and drafts (a chain, or the two-branch tree),
        then rejection sampling: chain rows against the drafter's q or a point mass (history), tree
        rows by ``verify_tree``; the reported log-probs of the emitted tokens."""
        core = self.core
        b, dev, k, m = len(rows), core.device, prop.k, prop.m
        last = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
        base = core.cache.lens[:b].clone()
        drafts = prop.drafts
        if prop.tree:
            seg = tree_segment(
                torch.cat([last, drafts.clamp(min=0), prop.branch.clamp(min=0)], dim=1), base, k, m
            )
        else:
            seg = chain_segment(last, drafts, base)
        (logits, aux), pre = core.forward(seg, adm, core.drafter.aux_layers)
        lp = process_logits(logits, sampling)  # [B, k+1(+m), V]
        # d2t maps q's vocabulary; drafts are target ids
        d2t = core.drafter.d2t if prop.q is not None else None
        if prop.tree:
            res = verify_tree(lp[:, :k + 1], drafts, prop.q, lp[:, k + 1:], prop.branch, d2t=d2t,
                              greedy=sampling.greedy, generator=core.generator)
            path = res.positions  # [B, k+m+1] the tree position that verified each emitted token
            own = res.first_accepted.tolist()
            if aux is not None:
                aux = aux.gather(1, path.unsqueeze(-1).expand(-1, -1, aux.shape[-1]))
        else:
            res = verify_split(lp, drafts, prop.q, d2t, sampling.greedy, prop.point, core.generator)
            path = None
            # the main drafter's own drafts were accepted only on its rows
            own = [0 if rp.use_hist else a for a, rp in zip(res.num_accepted.tolist(), prop.rows)]
        tok_lp = res.logprobs
        if bool(sampling.greedy.any()):
            if path is not None:
                idx = path.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
                logits, lp = logits.gather(1, idx), lp.gather(1, idx)
            tok_lp = core.token_logprobs(logits, lp, res.tokens, sampling.greedy)
        return Verified(res, tok_lp, aux, own, base, seg, pre)

    def _commit(
        self, rows: list[Row], prop: Proposal, ver: Verified
    ) -> tuple[list[list[int]], list[int], int]:
        """The kept path into the caches (a tree's winning history branch moves into the first's
        place), the drafter's state, and the emitted tokens to their rows. Returns what each row
        emitted, how many drafts it accepted, and how many tokens the rows kept (a row that reached a
        stop token or its length keeps none past it)."""
        core = self.core
        b, res = len(rows), ver.result
        if prop.tree:
            base_h, second_len = ver.base.tolist(), res.second_len.tolist()
            # the history branch won: its K/V take the first's place
            for i in res.second.nonzero()[:, 0].tolist():
                core.cache.shift(i, base_h[i] + prop.k + 1, base_h[i] + 1, second_len[i])
        emitted = res.emitted()
        accepted = res.num_accepted.tolist()
        core.cache.lens[:b] = ver.base + res.num_accepted + 1  # last token + accepted drafts are cached
        # (a ModelDrafter keeps the entries of its accepted drafts)
        core.drafter.commit(emitted, ver.own, ver.aux)
        kept = 0
        for r, em, l_ in zip(rows, emitted, ver.token_logprobs.tolist()):
            r.verify_steps += 1
            for j, t_ in enumerate(em):
                kept += 1
                if r.emit(t_, l_[j]):
                    break
        return emitted, accepted, kept

    def _source_label(self, i: int, src: str) -> str:
        """``src`` as the statistics name it: a history proposal says whether the live group index
        (``"live"``) or the finished responses (``"history"``) drafted it."""
        core = self.core
        if src != "history":
            return src
        d = core.history if core.history is not None else core.drafter
        sources = d.sources
        return (sources[i] if sources and i < len(sources) else None) or src

    def _account(self, rows: list[Row], prop: Proposal, ver: Verified, emitted: list[list[int]],
                 accepted: list[int], stats: GenerateStats, t0: float, *, prefill: bool, kept: int) -> None:
        """Per row: draft length, source and acceptance into the request's and the step's statistics;
        then one :class:`~megatron_spec.rollout.native.adaptive.StepOutcome` for the adaptive controller
        (acceptance per source, a history proposal a row did not use, the tree's predicted vs realized
        tokens, the step's and the draft's time, the tokens kept)."""
        core = self.core
        k, m = prop.k, prop.m
        second = ver.result.second.tolist() if prop.tree else None
        observed: list[AcceptObservation] = []
        predicted = realized = 0.0
        drafts = prop.drafts.tolist()
        for i, (r, em, a, rp, dr) in enumerate(zip(rows, emitted, accepted, prop.rows, drafts)):
            two, u = prop.second_branch(i), rp.use_hist
            proposed = sum(1 for t_ in dr if t_ >= 0) + (min(m, len(rp.hist)) if two else 0)
            src = "tree" if two else ("history" if u else core.drafter.kind)
            label = self._source_label(i, src)  # history: the live group index or finished responses
            r.draft_lengths.append(proposed)
            r.sources.append(label)
            stats.add_step_k(proposed)
            # a row that sat out a history-only step drafted nothing (k >= 1 here: k = 0 steps are _decode's)
            if not (prop.hist_only and not u):
                r.accepted.append(a)
                stats.add_spec_step(a, core.k_all, source=label)
                csrc = label if u and core.history is not None else src  # the two history indexes apart
                observed.extend(self._own_observation(i, r, prop, ver, csrc, proposed, a))
            if two:
                stats.tree_second += int(second[i])
                opts = rp.options
                predicted += tree_expected_tokens(opts[0].alpha, k, opts[1].alpha, opts[1].limit, m) - 1.0
                realized += a
            full = rp.hist_full
            if full and not u and core.controller is not None:  # learned also where only a prefix paid
                proposal = rp.hist[:m] if two else full
                observed.append(unused_history_observation(r.acc, core.k_all, proposal, em,
                                                           self._source_label(i, "history"), rp.support))
        pack = ver.segment.pack
        self._observe(prop, len(rows), t0, kept=kept, prefill=prefill, accepts=observed,
                      packed_tokens=None if pack is None else int(pack.sum()),
                      tree=(predicted, realized) if prop.tree else None)

    def _observe(self, prop: Proposal, rows: int, t0: float, *, kept: int, prefill: bool,
                 accepts: list[AcceptObservation], packed_tokens: int | None = None,
                 tree: tuple[float, float] | None = None) -> None:
        """The step's :class:`~megatron_spec.rollout.native.adaptive.StepOutcome` to the adaptive controller
        (none without one): its time since ``t0``, the verify's (all but the proposal) and the main
        drafter's proposal's."""
        if self.core.controller is None:
            return
        seconds = time.perf_counter() - t0
        self.core.controller.observe(StepOutcome(
            rows=rows, k=prop.k, m=prop.m, seconds=seconds, verify_s=seconds - prop.t_draft,
            # the draft table is the main drafter's: a step where it did not run teaches it nothing
            draft_s=prop.t_main if prop.main_ran else 0.0, kept=kept, prefill=prefill,
            packed_tokens=packed_tokens, accepts=accepts, tree=tree))

    def _own_observation(self, i: int, r: Row, prop: Proposal, ver: Verified, source: str, proposed: int,
                         accepted: int) -> list[AcceptObservation]:
        """What row ``i``'s verified drafts teach ``source``, the one it drafted from; in a tree step the
        main drafter, from the first branch (verified as a chain: its own acceptance, unbiased)."""
        core = self.core
        if core.controller is None or (not prop.tree and proposed <= 0):
            return []
        if prop.tree:
            main = core.drafter.kind
            return [AcceptObservation(main, r.acc.setdefault(main, AcceptanceStats(core.k_all)), prop.k,
                                      ver.own[i])]
        rp = prop.rows[i]
        support = rp.support if rp.use_hist and rp.support else None
        row = r.acc.setdefault(source, AcceptanceStats(core.k_all))
        return [AcceptObservation(source, row, proposed, accepted, support)]


def plan_step(
    controller: DraftLengthController,
    main: str,
    accs: list[dict[str, AcceptanceStats]],
    hist: list[list[int]] | None,
    hist_sources: list[str | None] | None = None,
    hist_support: list[list[tuple[int, int]] | None] | None = None,
) -> tuple[StepPlan, list[bool], list[list[DraftOption]]]:
    """The step's plan (:meth:`DraftLengthController.choose_step`: k, and whether every row drafts,
    only the rows with a history proposal, or a tree), per row whether it drafts from the history
    (in an ``all`` step: the source expected to emit more tokens at that k; ties go to the main
    drafter ``main``), and the rows' options the choice was made from. ``accs``: each row's
    request's acceptance per source; ``hist_sources``: per row, which index made its proposal
    (``live`` or ``history``, each judged on its own acceptance; default ``history``);
    ``hist_support``: per row, a live proposal's support per token (its acceptance is then what its
    tokens' support classes were worth, ``SupportStats.alpha``, and only its :func:`paying_prefix` at the
    batch's :meth:`~DraftLengthController.token_threshold` is an option: ``options[b][1].limit``, what the
    engine drafts)."""
    options = []
    bases: dict[str, list[float]] = {}  # the batch's rates per source, once per step
    cut = hist_support and any(hist_support) and not controller.force_history_rows  # (the hook: whole ones)
    threshold = controller.token_threshold(len(accs)) if cut else None

    def alpha(src: str, row: AcceptanceStats | None) -> list[float]:
        if src not in bases:
            bases[src] = controller.batch_alpha(src)
        return controller.row_alpha(src, row, bases[src])

    for i, acc in enumerate(accs):
        opts = [DraftOption(alpha(main, acc.get(main)))]
        if hist is not None and hist[i]:
            src = (hist_sources[i] if hist_sources else None) or "history"
            a, n = alpha(src, acc.get(src)), len(hist[i])
            support = hist_support[i] if hist_support else None
            if support:
                a = controller.support.alpha(a, support, controller.support_weight)
                if threshold is not None:
                    n = paying_prefix(a, threshold, n)
            if n:
                opts.append(DraftOption(a, n))
        options.append(opts)
    plan = controller.choose_step(options)
    if plan.mode == "history":
        return plan, [len(o) > 1 for o in options], options
    if plan.mode == "tree":
        return plan, [False] * len(options), options
    if controller.force_history_rows and any(len(o) > 1 for o in options):  # the test hook
        plan = plan._replace(k=max(plan.k, 1))
        return plan, [len(o) > 1 for o in options], options
    k = plan.k
    use = [len(o) > 1 and expected_tokens(o[1].alpha, k, o[1].limit) > expected_tokens(o[0].alpha, k)
           for o in options]
    return plan, use, options


def unused_history_observation(acc: dict[str, AcceptanceStats], k_all: int, proposal: list[int],
                               emitted: list[int], source: str = "history",
                               support: list[tuple[int, int]] | None = None) -> AcceptObservation:
    """Acceptance of a history proposal a row did not use, from what the row emitted: a point-mass
    draft x is accepted with probability p(x), the probability that the target's own token is x,
    so "proposal token j equals emitted token j" (given the earlier ones did) has the distribution
    of acceptance at position j. Positions past the emitted tokens are not observed. Without this,
    the history would only be judged on the rows where the main drafter looked weak (a biased
    sample) and, once judged badly there, never chosen again. ``support``: a live proposal's, per token
    (what its support classes are worth is learned the same way)."""
    n = min(len(proposal), len(emitted))
    m = 0
    while m < n and proposal[m] == emitted[m]:
        m += 1
    return AcceptObservation(source, acc.setdefault(source, AcceptanceStats(k_all)), n, m, support)
