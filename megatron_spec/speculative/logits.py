"""Logits processing: the one definition of the distribution a rollout samples from.

``process_logits`` turns raw logits into the float32 log-probabilities of the processed
distribution, per row: token mask -> temperature -> top-k -> top-p -> min-p, each step acting on the
renormalised result of the previous one (the order of Hugging Face's logits warpers and of SGLang's
speculative verify: ``top_k_renorm_prob`` then ``top_p_renorm_prob``). The engine samples from its
output and reports log-probs from it; the verifier checks drafts against it; the GRPO side uses it
too, so train/rollout mismatch cannot come from two definitions.

Conventions (all tie rules are thresholds, so they do not depend on sort order):
* temperature 0 is greedy: a one-hot at the argmax of the masked logits (lowest index on ties),
  never a tiny temperature; top-k / top-p / min-p do not apply to greedy rows;
* top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
  0 or >= V is off;
* top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (a token is in
  when the mass strictly above it in rank is < top_p, accumulated in float64), plus every token tied
  with the least likely one kept; 1 is off;
* min-p keeps tokens with ``prob >= min_p * max_prob``; 0 is off;
* ``token_mask`` (True = allowed) removes tokens before anything else (stop / EOS suppression,
  grammars). A row with no allowed token is an error.

This module knows nothing about models, engines, drafts or random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingTensors", "process_logits"]

_NEG_INF = float("-inf")


def _row_param(value, batch_size: int | None, dtype: torch.dtype, device, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.to(device=device, dtype=dtype).reshape(-1)
    elif isinstance(value, (int, float)):
        if batch_size is None:
            raise ValueError(f"SamplingTensors.from_values: {name} is a scalar; pass batch_size")
        t = torch.full((batch_size,), value, dtype=dtype, device=device)
    else:
        t = torch.tensor(list(value), dtype=dtype, device=device)
    return t


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters, all ``[B]`` on the device of the logits."""

    temperature: torch.Tensor
    """``[B]`` float32, >= 0; 0 means greedy (argmax)."""
    top_k: torch.Tensor
    """``[B]`` int64, >= 0; 0 means off."""
    top_p: torch.Tensor
    """``[B]`` float32 in (0, 1]; 1 means off."""
    min_p: torch.Tensor
    """``[B]`` float32 in [0, 1]; 0 means off."""

    def __post_init__(self) -> None:
        shapes = {n: tuple(getattr(self, n).shape) for n in ("temperature", "top_k", "top_p", "min_p")}
        if len(set(shapes.values())) != 1 or len(shapes["temperature"]) != 1:
            raise ValueError(f"SamplingTensors fields must all be [B], got shapes {shapes}")
        if self.top_k.dtype != torch.int64:
            raise ValueError(f"SamplingTensors.top_k must be int64, got {self.top_k.dtype}")
        for n in ("temperature", "top_p", "min_p"):
            if getattr(self, n).dtype != torch.float32:
                raise ValueError(f"SamplingTensors.{n} must be float32, got {getattr(self, n).dtype}")
        # One host sync at construction (not per step) so bad parameters fail where they are made.
        checks = [
            ("temperature", ~(torch.isfinite(self.temperature) & (self.temperature >= 0)), ">= 0 and finite"),
            ("top_k", self.top_k < 0, ">= 0 (0 = off)"),
            ("top_p", ~((self.top_p > 0) & (self.top_p <= 1)), "in (0, 1] (1 = off)"),
            ("min_p", ~((self.min_p >= 0) & (self.min_p <= 1)), "in [0, 1] (0 = off)"),
        ]
        for name, bad, expected in checks:
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"SamplingTensors.{name}[{row}] = {getattr(self, name)[row].item()} must be {expected}"
                )
        # Which path process_logits may take, decided here once (the engine builds these when its
        # batch changes, then processes logits several times per step with them).
        greedy = self.greedy
        truncated = ((self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0)) & ~greedy
        n_greedy = int(greedy.sum())
        kind = "mixed"
        if n_greedy == greedy.numel():
            kind = "greedy"
        elif n_greedy == 0 and not bool(truncated.any()):
            kind = "plain"
        object.__setattr__(self, "_kind", kind)

    @classmethod
    def from_values(
        cls,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
        top_k: int | Sequence[int] | torch.Tensor = 0,
        top_p: float | Sequence[float] | torch.Tensor = 1.0,
        min_p: float | Sequence[float] | torch.Tensor = 0.0,
        *,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> SamplingTensors:
        """Build from python scalars (broadcast to ``batch_size``), lists or tensors."""
        if batch_size is None:
            for v in (temperature, top_k, top_p, min_p):
                if not isinstance(v, (int, float)):
                    batch_size = len(v)
                    break
        device = torch.device(device) if device is not None else torch.device("cpu")
        return cls(
            temperature=_row_param(temperature, batch_size, torch.float32, device, "temperature"),
            top_k=_row_param(top_k, batch_size, torch.int64, device, "top_k"),
            top_p=_row_param(top_p, batch_size, torch.float32, device, "top_p"),
            min_p=_row_param(min_p, batch_size, torch.float32, device, "min_p"),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> torch.Tensor:
        """``[B]`` bool: rows decoded by argmax."""
        return self.temperature == 0

    def _map(self, fn) -> SamplingTensors:
        return SamplingTensors(
            temperature=fn(self.temperature), top_k=fn(self.top_k), top_p=fn(self.top_p), min_p=fn(self.min_p)
        )

    def repeat_interleave(self, repeats: int) -> SamplingTensors:
        """Each row repeated ``repeats`` times in place, e.g. for the k+1 verify positions of a row."""
        return self._map(lambda t: t.repeat_interleave(repeats))

    def index_select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of ``rows`` (``[R]`` int64), e.g. for the rows still generating."""
        return self._map(lambda t: t.index_select(0, rows.to(t.device)))

    def to(self, device: torch.device | str) -> SamplingTensors:
        return self._map(lambda t: t.to(device))


def _repeats(lead: tuple[int, ...], B: int) -> int:
    """How many rows of logits with leading shape ``lead`` each of ``B`` sampling rows covers."""
    R = math.prod(lead)
    if B == R:
        return 1
    if len(lead) >= 2 and B == lead[0]:
        return R // lead[0]
    raise ValueError(
        f"process_logits: {B} sampling rows fit neither the {R} rows of logits with leading shape "
        f"{list(lead)} nor its first dimension {lead[0] if lead else 0}"
    )


def _rows_for(lead: tuple[int, ...], sampling: SamplingTensors) -> SamplingTensors:
    n = _repeats(lead, sampling.batch_size)
    return sampling if n == 1 else sampling.repeat_interleave(n)


def _keep(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.full((), _NEG_INF, dtype=x.dtype, device=x.device))


def process_logits(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 log-probs of the processed distribution; ``-inf`` outside its support.

    Args:
        logits: ``[..., V]`` raw logits (any float dtype; processed in float32).
        sampling: per-row parameters for the ``prod(...)`` rows of ``logits``, or for its first
            dimension (then shared by the positions of each row, e.g. ``[B, k+1, V]`` with ``B`` rows).
        token_mask: bool, broadcastable to ``logits``; True = allowed.

    Returns:
        ``[..., V]`` float32 log-probs. Greedy rows are one-hot (0 at the argmax, -inf elsewhere).
    """
    if logits.dim() < 1:
        raise ValueError("process_logits: logits must have a vocabulary dimension")
    shape = logits.shape
    V = shape[-1]
    lead = tuple(shape[:-1])
    kind = getattr(sampling, "_kind", "mixed")
    # all-greedy and temperature-only batches need no per-row copy of the parameters
    s = _rows_for(lead, sampling) if kind == "mixed" else sampling
    if kind != "mixed":
        _repeats(lead, sampling.batch_size)  # the row-count check alone
    x = logits.reshape(-1, V).float()  # [R, V]
    if token_mask is not None:
        if token_mask.dtype != torch.bool:
            raise ValueError(
                f"process_logits: token_mask must be bool (True = allowed), got {token_mask.dtype}"
            )
        x = _keep(x, token_mask.to(x.device).expand(shape).reshape(-1, V))
    R = x.shape[0]
    if R == 0:
        return x.reshape(shape)
    if V == 0:
        raise ValueError(f"process_logits: empty vocabulary with {R} rows")
    # Host sync: a row with nothing allowed has no distribution; say which one.
    dead = ~(x.amax(dim=-1) > _NEG_INF)
    if bool(dead.any()):
        row = int(dead.nonzero()[0, 0])
        raise ValueError(f"process_logits: row {row} has no allowed token (all logits -inf, NaN or masked)")

    if kind == "greedy":  # every row argmax: what the general path below computes for such rows
        return torch.full_like(x, _NEG_INF).scatter_(1, x.argmax(dim=-1, keepdim=True), 0.0).reshape(shape)
    if kind == "plain":  # temperature only: the same division and log_softmax as below, no masks
        temp = s.temperature.to(x.device)
        x = x.view(s.batch_size, -1, V) / temp[:, None, None]
        return torch.log_softmax(x.view(-1, V), dim=-1).reshape(shape)
    return _process_mixed(x, s).reshape(shape)


def _process_mixed(x: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """The general path of :func:`process_logits`: ``x [R, V]`` float32 masked logits, ``s`` one row of
    parameters per row of ``x`` -> ``[R, V]`` log-probs. Each truncation acts on the renormalised result
    of the one before; greedy rows skip them and become a one-hot at the argmax."""
    greedy = s.greedy.to(x.device)
    temp = torch.where(greedy, torch.ones_like(s.temperature), s.temperature).to(x.device)
    x = x / temp[:, None]
    _top_k(x, s.top_k.to(x.device), greedy)
    _top_p(x, s.top_p.to(x.device), greedy)
    _min_p(x, s.min_p.to(x.device), greedy)

    logprobs = torch.log_softmax(x, dim=-1)
    rows = greedy.nonzero()[:, 0]
    if rows.numel():
        am = x[rows].argmax(dim=-1, keepdim=True)  # [g, 1], first index of the max
        one_hot = torch.full((rows.numel(), x.shape[-1]), _NEG_INF, dtype=torch.float32, device=x.device)
        logprobs[rows] = one_hot.scatter(1, am, 0.0)
    return logprobs


def _top_k(x: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor) -> None:
    """In place on ``x [R, V]``: keep ``x_t >= x_(k)``, the k-th largest of the row (ties at the boundary
    stay), where ``0 < k < V`` and the row samples."""
    rows = ((top_k > 0) & (top_k < x.shape[-1]) & ~greedy).nonzero()[:, 0]
    if rows.numel():
        xr = x[rows]  # [r, V]
        kr = top_k[rows]
        kth = torch.topk(xr, int(kr.max()), dim=-1).values.gather(1, (kr - 1)[:, None])  # [r, 1]
        x[rows] = _keep(xr, xr >= kth)


def _top_p(x: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor) -> None:
    """In place on ``x [R, V]``: keep the most likely tokens until their mass reaches ``top_p`` (token of
    rank n is in iff ``sum_{m < n} p_(m) < top_p``, in float64), and every token tied with the last one
    kept, where ``top_p < 1`` and the row samples."""
    rows = ((top_p < 1) & ~greedy).nonzero()[:, 0]
    if rows.numel():
        xr = x[rows]
        probs = torch.softmax(xr, dim=-1)  # [r, V]
        sp = torch.sort(probs, dim=-1, descending=True).values
        cum = torch.cumsum(sp.double(), dim=-1)
        above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass ranked above
        n_keep = (above < top_p[rows, None].double()).sum(dim=-1)  # >= 1: above[0] = 0 < top_p
        thr = sp.gather(1, (n_keep - 1)[:, None])
        x[rows] = _keep(xr, probs >= thr)


def _min_p(x: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor) -> None:
    """In place on ``x [R, V]``: keep ``p_t >= min_p * max_t p_t``, where ``min_p > 0`` and the row
    samples."""
    rows = ((min_p > 0) & ~greedy).nonzero()[:, 0]
    if rows.numel():
        xr = x[rows]
        probs = torch.softmax(xr, dim=-1)
        thr = min_p[rows, None] * probs.amax(dim=-1, keepdim=True)
        x[rows] = _keep(xr, probs >= thr)
