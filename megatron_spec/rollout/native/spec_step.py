"""What one speculative step of the native engine passes between its four parts, and the parts that
hold no engine state (the verify forward's layout, splitting and merging verification).

``SpeculativeWorker.step`` (``spec_worker.py``) is **propose -> verify -> commit -> account**:

* propose: the step's plan (k, and whether every row drafts from its better source, only the rows
  with a history proposal, or a two-branch tree) and the drafts: a :class:`Proposal`;
* verify: one target forward over the last token and the drafts (:func:`chain_segment` or
  :func:`tree_segment`, the admitted prompts' prefill riding along), then rejection sampling:
  a :class:`Verified`;
* commit: the kept path's K/V into place, the cache lengths, the drafter's own state, the tokens
  emitted to their rows;
* account: per-row draft lengths, sources and acceptance, the step's statistics, and what the
  adaptive controller learns from them.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_spec.rollout.native.adaptive import StepPlan
from megatron_spec.rollout.native.cost_model import DraftOption
from megatron_spec.rollout.native.model import Segment
from megatron_spec.speculative.verify import VerifyResult, verify_chain


@dataclasses.dataclass
class RowPlan:
    """One row's part of a speculative step's plan."""

    use_hist: bool = False
    """The row's drafts come from the history (verified against a point mass)."""
    options: list[DraftOption] | None = None
    """The (acceptance, proposal length) options the adaptive plan was chosen from (None: fixed k)."""
    hist: list[int] | None = None
    """What the row may draft of the history drafter's proposal (None without one)."""
    hist_full: list[int] | None = None
    """The history drafter's whole proposal, where ``hist`` holds what the row may draft of it (a
    supported live proposal's paying prefix: ``spec_worker.plan_step``); what unused proposals teach."""
    support: list[tuple[int, int]] | None = None
    """A live proposal's sibling support per token (``LiveIndex.propose_with_support``), or None."""


@dataclasses.dataclass
class Proposal:
    """The drafts of one speculative step."""

    plan: StepPlan
    rows: list[RowPlan]
    """Per row, its part of the plan."""
    drafts: torch.Tensor
    """``[B, k]`` target ids, -1 where a row drafts fewer than k."""
    q: torch.Tensor | None
    """``[B, k, Vd]`` the main drafter's distributions (None: point masses only)."""
    branch: torch.Tensor | None
    """``[B, m]`` the tree's second branch (history), -1 padded; None outside a tree step."""
    main_ran: bool
    """The main drafter proposed for some row (its time is what the controller learns)."""
    t_draft: float
    t_main: float
    point: torch.Tensor = dataclasses.field(init=False)
    """``[B]`` bool, on the drafts' device: the rows verified against a point mass (``RowPlan.use_hist``)."""

    def __post_init__(self) -> None:
        self.point = torch.tensor([r.use_hist for r in self.rows], device=self.drafts.device)

    @property
    def k(self) -> int:
        return self.plan.k

    @property
    def tree(self) -> bool:
        return self.plan.mode == "tree"

    @property
    def hist_only(self) -> bool:
        return self.plan.mode == "history"

    @property
    def m(self) -> int:
        return self.plan.m if self.tree else 0

    def second_branch(self, i: int) -> bool:
        """Row ``i`` carried a second (history) branch in a tree step."""
        return self.tree and bool(self.rows[i].hist)


@dataclasses.dataclass
class Verified:
    """What the verify forward and rejection sampling decided."""

    result: VerifyResult
    """Chain or tree result: ``tokens``, ``num_accepted``, ``logprobs`` along the kept path."""
    token_logprobs: torch.Tensor
    """``[B, T]`` the reported log-prob of each emitted token (unscaled for greedy rows)."""
    aux: torch.Tensor | None
    """The target's auxiliary states along the kept path (what the drafter consumes)."""
    own: list[int]
    """Per row: the main drafter's own drafts accepted (what it and its controller learn from)."""
    base: torch.Tensor
    """``[B]`` the cache lengths before the step."""
    segment: Segment
    prefill: tuple | None
    """The admitted prompts' (logits, aux) from the same forward, or None."""


def chain_segment(last: torch.Tensor, drafts: torch.Tensor, base: torch.Tensor) -> Segment:
    """The verify forward of a chain: ``last [B, 1]`` then ``drafts [B, k]`` (-1: none) at cache
    positions ``base ..``. Rows drafting fewer than k (a history-only step's other rows, shorter
    proposals) run packed."""
    b, k = drafts.shape
    dev = drafts.device
    inputs = torch.cat([last, drafts.clamp(min=0)], dim=1)
    valid = drafts >= 0
    pack = (
        None
        if bool(valid.all())
        else torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), valid], dim=1)
    )
    return Segment(inputs, base.unsqueeze(1) + torch.arange(k + 1, device=dev), base + k + 1, pack=pack)


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
    return Segment(
        inputs,
        base.unsqueeze(1) + rope,
        base + t,
        cache_positions=base.unsqueeze(1) + torch.arange(t, device=dev),
        visible=visible.expand(b, t, t),
    )


def merge_rows(parts: list[VerifyResult], idx: list[torch.Tensor], b: int, width: int) -> VerifyResult:
    """Scatter per-group verify results back to rows ``idx`` of a ``[B, width]`` result."""
    dev = parts[0].tokens.device
    tokens = torch.full((b, width), -1, dtype=torch.long, device=dev)
    logprobs = torch.zeros(b, width, device=dev)
    num = torch.zeros(b, dtype=torch.long, device=dev)
    for res, ix in zip(parts, idx):
        tokens[ix], logprobs[ix], num[ix] = res.tokens, res.logprobs, res.num_accepted
    return VerifyResult(tokens=tokens, num_accepted=num, logprobs=logprobs)


def verify_split(lp: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, d2t: torch.Tensor | None,
                 greedy: torch.Tensor, point: torch.Tensor, generator: torch.Generator) -> VerifyResult:
    """``verify_chain``, split in two groups when some rows' drafts are point masses (``point [B]``:
    history) and the others carry the drafter's q: each group is verified exactly by its own rule."""
    if q is None or not bool(point.any()):
        return verify_chain(
            lp, drafts, None if bool(point.all()) else q, d2t=d2t, greedy=greedy, generator=generator
        )
    own = (~point).nonzero()[:, 0]
    pm = point.nonzero()[:, 0]
    a = verify_chain(lp[own], drafts[own], q[own], d2t=d2t, greedy=greedy[own], generator=generator)
    c = verify_chain(lp[pm], drafts[pm], None, greedy=greedy[pm], generator=generator)
    return merge_rows([a, c], [own, pm], lp.shape[0], lp.shape[1])
