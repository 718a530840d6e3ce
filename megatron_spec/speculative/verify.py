"""Chain verification: accept drafted tokens so the emitted stream follows the target exactly.

For a row with drafts ``x_1..x_k`` drawn from ``q`` (or proposed without a distribution), the target
accepts ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection it emits a
token from ``normalize(max(0, p_i - q_i))``; if all ``k`` pass it emits a bonus token from
``p_{k+1}``. Each emitted token is then distributed exactly as ``p`` (Leviathan et al. 2023, Thm. 1;
Chen et al. 2023). Drafters without a distribution (n-gram) use a point mass ``q = 1[x_i]``: accept
with ``p(x_i)``, else sample ``p`` without ``x_i``. Greedy rows (temperature 0) accept while the draft
equals the target argmax, so their output equals argmax decoding token for token.

``p`` must already be the processed distribution (``process_logits``): the verifier never applies
temperature or truncation itself. Randomness is explicit: pre-drawn uniforms or a
``torch.Generator``. The arithmetic (and the compiled kernels that run it) is documented in
``megatron_spec/ops/verify_reference.py``.

This module does not know where logits come from, how drafts were made, or any engine state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_spec.ops import verify_chain_op

__all__ = [
    "TreeVerifyResult",
    "VerifyResult",
    "acceptance_probability",
    "expected_num_accepted",
    "sample_from_logprobs",
    "verify_chain",
    "verify_tree",
]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one chain per row."""

    tokens: torch.Tensor
    """``[B, k+1]`` int64: the accepted drafts, then the correction or bonus token, then -1 padding."""
    num_accepted: torch.Tensor
    """``[B]`` int64 in ``[0, k]``: drafts accepted."""
    logprobs: torch.Tensor
    """``[B, k+1]`` float32: the target log-prob of each emitted token under the processed
    distribution (what the engine reports); 0 on padding."""

    @property
    def num_emitted(self) -> torch.Tensor:
        """``[B]`` int64: ``num_accepted + 1`` tokens emitted per row."""
        return self.num_accepted + 1

    def emitted(self) -> list[list[int]]:
        """Emitted token ids per row as python lists (one host sync)."""
        return [row[row >= 0].tolist() for row in self.tokens.cpu()]


def _draw_uniforms(
    B: int, k: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    # Order is part of the contract: u_accept first, then u_sample (reproducible for a given seed).
    u_accept = torch.rand((B, k), dtype=torch.float64, generator=generator, device=device)
    u_sample = torch.rand((B,), dtype=torch.float64, generator=generator, device=device)
    return u_accept, u_sample


def verify_chain(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    d2t: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    u_accept: torch.Tensor | None = None,
    u_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify ``k`` drafted tokens per row against the target's processed distribution.

    Args:
        target_logprobs: ``[B, k+1, V]`` log-probs from ``process_logits`` at the k+1 positions
            (position i conditions on the drafts before it).
        draft_tokens: ``[B, k]`` drafted target ids; a negative id ends that row's chain early
            (ragged drafts, e.g. n-gram lookups that matched fewer than k tokens).
        draft_probs: ``[B, k, Vd]`` draft distributions the drafts were sampled from, over the target
            vocabulary (``Vd == V``) or the draft vocabulary when ``d2t`` is given; None for drafters
            without a distribution (point mass at the draft).
        d2t: ``[Vd]`` int64 offsets of a reduced draft vocabulary: ``target_id = draft_id + d2t[draft_id]``
            (EAGLE-3 ``d2t``); q is zero on target ids outside the draft vocabulary.
        greedy: ``[B]`` bool rows verified by argmax (temperature 0); default none.
        u_accept: ``[B, k]`` float64 uniforms in [0, 1) for the acceptance tests.
        u_sample: ``[B]`` float64 uniforms in [0, 1) for the correction / bonus token.
        generator: draws ``u_accept`` then ``u_sample`` when the uniforms are not given.

    Returns:
        :class:`VerifyResult` with ``tokens [B, k+1]``, ``num_accepted [B]``, ``logprobs [B, k+1]``.

    Raises:
        ValueError: ``target_logprobs`` are not log-probabilities where the chain reads them (raw
            logits, NaN, a sampled row whose emission position does not sum to 1 within 1e-3:
            ``megatron_spec/ops/verify_reference.py``, "Input checks"), or malformed arguments.
    """
    if target_logprobs.dim() != 3:
        raise ValueError(
            f"verify_chain: target_logprobs must be [B, k+1, V], got shape {tuple(target_logprobs.shape)}"
        )
    B, K1, _ = target_logprobs.shape
    k = K1 - 1
    device = target_logprobs.device
    lp = target_logprobs.float().contiguous()
    x = draft_tokens.to(device=device, dtype=torch.int64).contiguous()
    q = draft_probs.to(device=device, dtype=torch.float32).contiguous() if draft_probs is not None else None
    m = d2t.to(device=device, dtype=torch.int64).contiguous() if d2t is not None else None
    g = (
        torch.zeros(B, dtype=torch.bool, device=device)
        if greedy is None
        else greedy.to(device=device, dtype=torch.bool).contiguous()
    )
    given = (u_accept is not None, u_sample is not None)
    if any(given):
        if not all(given):
            raise ValueError("verify_chain: pass both u_accept and u_sample, or a generator")
        if generator is not None:
            raise ValueError("verify_chain: pass uniforms or a generator, not both")
        ua = u_accept.to(device=device, dtype=torch.float64).contiguous()
        us = u_sample.to(device=device, dtype=torch.float64).contiguous()
    elif generator is not None:
        ua, us = _draw_uniforms(B, k, device, generator)
    else:
        raise ValueError(
            "verify_chain: randomness must be explicit: pass u_accept and u_sample, or a generator"
        )
    tokens, num_accepted = verify_chain_op(lp, x, q, m, g, ua, us)
    logprobs = lp.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]  # [B, k+1]
    logprobs = torch.where(tokens >= 0, logprobs, torch.zeros_like(logprobs))
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, logprobs=logprobs)


@dataclass(frozen=True)
class TreeVerifyResult(VerifyResult):
    """Outcome of :func:`verify_tree`: ``tokens``, ``num_accepted``, ``logprobs`` along the kept path
    (``[B, k+m+1]``; ``num_accepted`` is the tokens emitted minus one), and where the path ran."""

    positions: torch.Tensor = None
    """``[B, k+m+1]`` int64: the index into the tree's ``k+1+m`` positions (the last token, x_1..x_k,
    y_1..y_m) whose logits verified each emitted token (the node of the token before it)."""
    first_accepted: torch.Tensor = None
    """``[B]`` int64: drafts of the first branch on the kept path (what a chain of x alone accepted)."""
    second: torch.Tensor = None
    """``[B]`` bool: the path went on along y past the first branch's tokens (the cached tokens of the
    path are then y_1..y_n, whose K/V sit at y's positions)."""
    second_len: torch.Tensor = None
    """``[B]`` int64: n, the tokens of y cached on the kept path (``num_accepted``; 0 where not
    ``second``)."""


def verify_tree(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    second_logprobs: torch.Tensor,
    second_tokens: torch.Tensor,
    *,
    d2t: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    generator: torch.Generator,
) -> TreeVerifyResult:
    """Verify two draft branches after the same last token: ``x_1..x_k`` drawn from ``q`` (as in
    :func:`verify_chain`) and a deterministic ``y_1..y_m`` (a history proposal, point mass).

    The rule (recursive rejection with a point-mass second draft): at the first position, accept
    ``x_1`` with ``min(1, p/q)``; else the residual ``r = norm(max(p - q, 0))`` is the distribution
    left to match, ``y_1`` is accepted with probability ``r(y_1)``, else a token is drawn from ``r``
    without ``y_1``. That is exactly what drawing the correction token ``c ~ r`` and accepting ``y_1``
    iff ``c == y_1`` does, so: the first branch is verified as a chain; where the tokens it emitted
    (accepted drafts and the correction or bonus token) are a prefix of the second branch, the
    second branch's remaining tokens are verified as a point-mass chain against its own positions'
    logits. Every emitted token follows ``p`` (the first chain is exact; the second continues from a
    context the emitted tokens decided, with fresh uniforms, and a proposal fixed before them).
    With ``y_1 == x_1`` the branches share a prefix and the rule is the same (``r(x_1) = 0``).

    Args:
        target_logprobs: ``[B, k+1, V]`` the target at the last token and at ``x_1..x_k``.
        draft_tokens, draft_probs, d2t, greedy: the first branch, as in :func:`verify_chain`.
        second_logprobs: ``[B, m, V]`` the target at ``y_1..y_m`` (given ``y_1..y_j``).
        second_tokens: ``[B, m]`` the second branch; -1 ends it (a row without one: all -1).
        generator: draws the uniforms (of the first chain, then of the second).
    Returns:
        :class:`TreeVerifyResult`.
    """
    first = verify_chain(
        target_logprobs, draft_tokens, draft_probs, d2t=d2t, greedy=greedy, generator=generator
    )
    b, k1 = first.tokens.shape
    m = second_tokens.shape[1]
    dev = first.tokens.device
    y = second_tokens.to(device=dev, dtype=torch.int64)
    a = first.num_accepted
    tokens = torch.full((b, k1 + m), -1, dtype=torch.long, device=dev)
    logprobs = torch.zeros(b, k1 + m, device=dev)
    tokens[:, :k1], logprobs[:, :k1] = first.tokens, first.logprobs
    num = a.clone()
    positions = torch.arange(k1 + m, device=dev).expand(b, -1).clone()
    second = torch.zeros(b, dtype=torch.bool, device=dev)
    second_len = torch.zeros(b, dtype=torch.long, device=dev)

    def result():
        return TreeVerifyResult(tokens, num, logprobs, positions, a, second, second_len)

    if m == 0:
        return result()
    # go on along y where the a + 1 tokens the first branch emitted are y_1..y_{a+1} and y_{a+2} exists
    j = torch.arange(k1, device=dev).view(1, -1)
    y_pad = torch.cat([y, torch.full((b, max(0, k1 - m)), -1, dtype=torch.long, device=dev)], 1)[:, :k1]
    agree = ((first.tokens == y_pad) | (j > a.view(-1, 1))).all(1)
    cont = agree & (a + 1 < m)
    cont &= y.gather(1, (a + 1).clamp(max=m - 1).view(-1, 1))[:, 0] >= 0
    idx = cont.nonzero()[:, 0]
    if not idx.numel():
        return result()
    start = a[idx] + 1  # y_1..y_start are emitted; y_{start+1}.. are verified at the logits of y_start..
    w = int((m - start).max())  # drafts left on the longest row
    col = torch.arange(w + 1, device=dev).view(1, -1)
    lp2 = second_logprobs[idx.view(-1, 1), (start.view(-1, 1) - 1 + col).clamp(max=m - 1)]  # [R, w+1, V]
    d_off = start.view(-1, 1) + col[:, :w]
    d2 = torch.where(d_off < m, y[idx.view(-1, 1), d_off.clamp(max=m - 1)], torch.full_like(d_off, -1))
    res2 = verify_chain(lp2, d2, None, greedy=None if greedy is None else greedy[idx], generator=generator)
    for r, s0, toks, lps, n2 in zip(idx.tolist(), start.tolist(), res2.tokens, res2.logprobs,
                                    res2.num_accepted.tolist()):
        tokens[r, s0:s0 + n2 + 1] = toks[:n2 + 1]
        logprobs[r, s0:s0 + n2 + 1] = lps[:n2 + 1]
        num[r] = second_len[r] = s0 + n2
        second[r] = True
        # token j at y_j's
        positions[r, s0:] = (k1 - 1 + torch.arange(s0, k1 + m, device=dev)).clamp(max=k1 + m - 1)
    return result()


def sample_from_logprobs(
    logprobs: torch.Tensor,
    greedy: torch.Tensor | None = None,
    *,
    u: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logprobs [B, V]`` (autoregressive step): ``[B]`` int64.

    The same inverse-CDF draw the verifier uses for its bonus token (a chain with k = 0), so plain
    and speculative decoding share one sampler, and the same input checks (each sampled row must sum
    to 1 within 1e-3; greedy rows refuse NaN). ``u [B]`` float64 in [0, 1), or a ``generator``.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"sample_from_logprobs: logprobs must be [B, V], got shape {tuple(logprobs.shape)}")
    B = logprobs.shape[0]
    empty_draft = torch.empty((B, 0), dtype=torch.int64, device=logprobs.device)
    if u is not None:
        res = verify_chain(
            logprobs[:, None, :], empty_draft, greedy=greedy, generator=generator,
            u_accept=torch.empty((B, 0), dtype=torch.float64, device=logprobs.device), u_sample=u,
        )
    else:
        res = verify_chain(logprobs[:, None, :], empty_draft, greedy=greedy, generator=generator)
    return res.tokens[:, 0]


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) over the last dim: the chance a draft from q is accepted."""
    return torch.minimum(p, q).sum(dim=-1)


def expected_num_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts of a chain with per-position acceptance ``alpha [..., k]``:
    ``sum_i prod_{j<=i} alpha_j`` (positions independent of earlier draws)."""
    return torch.cumprod(alpha, dim=-1).sum(dim=-1)
