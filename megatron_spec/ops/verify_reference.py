"""Pure-PyTorch chain verification with pre-drawn uniforms: fallback and oracle of the compiled op.

Semantics (the compiled CPU/CUDA kernels return the same tokens for the same inputs, bit for bit):

* ``p = spec_exp(target_logprobs)``: a float32 exp built from IEEE additions and multiplications
  only (Cody-Waite reduction + the Cephes polynomial, ``csrc/ms_math.h``), because ``torch.exp``
  is not specified to the last bit and differs between CPU vector widths and CUDA.
* Row ``b`` drafted ``x_0..x_{k-1}`` (target ids; a negative id ends the chain early). Sampled rows
  accept ``x_i`` while ``u_accept[b, i] * q_i(x_i) < p_i(x_i)`` in float64, i.e. ``u < min(1, p/q)``.
  Greedy rows accept while ``x_i == argmax p_i`` (lowest index on ties) and then emit the argmax.
* At the first rejection ``j`` a sampled row draws from ``normalize(max(0, p_j - q_j))``; after ``k``
  acceptances, or at an empty draft slot, from ``p_j`` (the bonus token). When rounding leaves the
  residual without mass (``p <= q`` everywhere) it draws from ``p_j``.
* ``q`` is the dense draft distribution, or the draft-vocabulary distribution scattered through
  ``d2t`` (``target_id = draft_id + d2t[draft_id]``, zero elsewhere), or a point mass at ``x_i``
  when no distribution is given (n-gram). Draft probabilities below 2**-126 count as 0.
* Inverse CDF with ``u_sample[b]`` over the float64 residual ``r``, in this exact order: split the
  vocabulary into chunks of ``SAMPLE_CHUNK`` tokens; sum each chunk sequentially from 0.0; take the
  sequential prefix ``P`` of the chunk sums, ``T = P[-1]`` and ``theta = u * T``; pick the first chunk
  with ``P[c] > theta``; inside it pick the first token whose chunk-local sequential prefix exceeds
  ``theta - P[c-1]``, or, if rounding leaves none, the chunk's last token with ``r > 0``.
  ``torch.cumsum`` on CPU accumulates sequentially in float64, so it realises this order (a test
  pins that); on CUDA it scans in parallel, so compare CUDA kernels with this reference on CPU.

Input checks: the verifier refuses input it would sample wrongly (raw logits passed as log-probs
accept nearly every draft; a NaN in a greedy row made the kernels and this reference disagree). Only
at positions the kernels read anyway, so the checks cost no extra pass over the vocabulary for
sampled rows; the kernels make the same checks at the same positions and refuse the same inputs:

* a sampled row's emission position ``j`` (where its correction or bonus token is drawn) must hold a
  distribution: its mass ``m = sum_t spec_exp(lp[b, j, t])``, summed in float64 in the fixed order of
  ``logprob_mass`` (the kernels sum it in the same pass as the draw), must lie within ``MASS_TOL`` of 1
  (NaN anywhere makes ``m`` NaN);
* a greedy row refuses NaN at every position where it takes an argmax (positions ``0..j``), and at
  ``j`` the largest probability ``spec_exp(max_t lp[b, j, t])`` must lie in ``[(1 - MASS_TOL) / V,
  1 + MASS_TOL]``, as it does in a distribution. Greedy rows get this bound, not the sum: their token
  does not depend on normalisation, and the extra exp pass made greedy verification 5-11x slower;
* a sampled row refuses a tested draft (positions ``0..j``) whose ``p_i(x_i)`` is NaN or above
  ``1 + MASS_TOL``: a log-prob above 0 comes only from unnormalised input.

Point masses (log-prob 0 at one id, -inf elsewhere: greedy rows of ``process_logits``, top-k 1) and
-inf entries in general are legal. Positions the chain never reaches are not checked. The first
offending row (lowest ``b``) is reported; within a row, the first offending position.

``spec_exp``, the inverse CDF, the mass and its bounds are computed by
:mod:`megatron_spec.ops.ms_math_reference` (the reference of ``csrc/ms_math.h``); this module is the chain
walk and the input checks. It knows nothing about models, engines or how the uniforms were drawn.
References: Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding";
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling".
"""

from __future__ import annotations

import torch

from megatron_spec.ops.ms_math_reference import (
    MASS_TOL,
    greedy_max_ok,
    inverse_cdf_chunked,
    mass_ok,
    probability_mass,
    spec_exp_reference,
)

_FLT_MIN = float.fromhex("0x1p-126")  # draft probabilities below it count as 0


def _clean_q(q: torch.Tensor) -> torch.Tensor:
    return torch.where(q >= _FLT_MIN, q, torch.zeros((), dtype=q.dtype, device=q.device))


def _residual(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q) in float64 (NaN -> 0)."""
    d = p.double() if q is None else p.double() - q.double()
    return torch.where(d > 0, d, torch.zeros((), dtype=d.dtype, device=d.device))


def _check_distributions(lp, x, valid, greedy, p_x, j, p_emit) -> None:
    """Raise for the first row whose checked positions are not log-probabilities (module docstring).

    ``p_emit [Bs, V]``: ``spec_exp`` of the sampled rows' emission positions (the draw reuses it).
    """
    B, K1, V = lp.shape
    k = K1 - 1
    # first bad position of each row among the chain's own checks (K1 = none)
    first = torch.full((B,), K1, dtype=torch.int64, device=lp.device)
    if k:
        tested = (torch.arange(k, device=lp.device)[None, :] <= j[:, None]) & valid & ~greedy[:, None]
        bad_p = tested & ~(p_x.double() <= 1.0 + MASS_TOL)  # [B, k]
        first = torch.where(bad_p.any(1), bad_p.long().argmax(1), first)
    g_rows = greedy.nonzero()[:, 0]
    if g_rows.numel():
        reached = torch.arange(K1, device=lp.device)[None, :] <= j[g_rows, None]
        bad_nan = lp[g_rows].isnan().any(-1) & reached  # [g, K1]
        first[g_rows] = torch.where(bad_nan.any(1), bad_nan.long().argmax(1), first[g_rows])
    s_rows = (~greedy).nonzero()[:, 0]
    bad_at_j = torch.zeros(B, dtype=torch.bool, device=lp.device)
    m = torch.zeros(B, dtype=torch.float64, device=lp.device)
    if s_rows.numel():
        m[s_rows] = probability_mass(p_emit)  # [Bs]
        bad_at_j[s_rows] = ~mass_ok(m[s_rows])
    p_max = torch.zeros(B, dtype=torch.float32, device=lp.device)
    if g_rows.numel():
        p_max[g_rows] = spec_exp_reference(lp[g_rows, j[g_rows]].amax(dim=-1))  # NaN rows failed above
        bad_at_j[g_rows] = ~greedy_max_ok(p_max[g_rows], V)
    bad_row = (first < K1) | bad_at_j
    if not bool(bad_row.any()):
        return
    b = int(bad_row.nonzero()[0, 0])
    i = int(first[b])
    if i < K1 and bool(greedy[b]):
        raise ValueError(f"verify_chain: target_logprobs[{b}, {i}] contains NaN (greedy row); "
                         f"log-probs must be finite or -inf")
    if i < K1:
        t = int(x[b, i])
        raise ValueError(
            f"verify_chain: target_logprobs[{b}, {i}, {t}] = {float(lp[b, i, t])} is not a log-probability "
            f"(NaN, or above 0); pass normalised log-probs (process_logits / log_softmax), not raw logits"
        )
    if bool(greedy[b]):
        raise ValueError(
            f"verify_chain: target_logprobs[{b}, {int(j[b])}] is not normalised: its largest probability is "
            f"{float(p_max[b]):.9g}, outside [1/V, 1] (V = {V}, tolerance {MASS_TOL:g}); pass log-probs "
            f"(process_logits / log_softmax), not raw logits"
        )
    _raise_mass(b, int(j[b]), float(m[b]))


def _raise_mass(b: int, j: int, m: float) -> None:
    if m != m:
        raise ValueError(f"verify_chain: target_logprobs[{b}, {j}] contains NaN")
    if m == 0.0:
        raise ValueError(
            f"verify_chain: target_logprobs[{b}, {j}] has no probability mass (every log-prob is -inf)"
        )
    raise ValueError(
        f"verify_chain: target_logprobs[{b}, {j}] is not normalised: its probabilities sum to {m:.9g}, not 1 "
        f"(tolerance {MASS_TOL:g}); pass log-probs (process_logits / log_softmax), not raw logits"
    )


def _t2d(d2t: torch.Tensor, V: int) -> torch.Tensor:
    """Inverse of d2t: ``[V]`` int64 draft id of each target id, -1 outside the draft vocabulary."""
    Vd = d2t.shape[0]
    draft_ids = torch.arange(Vd, device=d2t.device)
    tgt = draft_ids + d2t
    bad = (tgt < 0) | (tgt >= V)
    if bool(bad.any()):
        d = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"verify_chain: d2t[{d}] = {int(d2t[d])} maps draft id {d} to target id {int(tgt[d])}, "
            f"outside the target vocabulary [0, {V})"
        )
    counts = torch.bincount(tgt, minlength=V)
    if bool((counts > 1).any()):
        t = int((counts > 1).nonzero()[0, 0])
        ids = (tgt == t).nonzero()[:, 0].tolist()
        raise ValueError(f"verify_chain: d2t maps draft ids {ids[0]} and {ids[1]} to the same target id {t}")
    t2d = torch.full((V,), -1, dtype=torch.int64, device=d2t.device)
    t2d[tgt] = draft_ids
    return t2d


def _check_inputs(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample) -> None:
    """Shapes and dtypes of the arguments (``Vd``: the draft vocabulary, ``V`` without ``d2t``)."""
    if target_logprobs.dim() != 3 or target_logprobs.dtype != torch.float32:
        raise ValueError(
            f"verify_chain: target_logprobs must be float32 [B, k+1, V], got {target_logprobs.dtype} "
            f"of shape {tuple(target_logprobs.shape)}"
        )
    B, K1, V = target_logprobs.shape
    if K1 < 1:
        raise ValueError(f"verify_chain: target_logprobs needs k+1 >= 1 positions, got {K1}")
    k = K1 - 1
    expect = [
        ("draft_tokens", draft_tokens, (B, k), torch.int64),
        ("greedy", greedy, (B,), torch.bool),
        ("u_accept", u_accept, (B, k), torch.float64),
        ("u_sample", u_sample, (B,), torch.float64),
    ]
    Vd = V
    if d2t is not None:
        if draft_probs is None:
            raise ValueError("verify_chain: d2t given without draft_probs")
        if d2t.dim() != 1 or d2t.dtype != torch.int64:
            raise ValueError(
                f"verify_chain: d2t must be int64 [Vd], got {d2t.dtype} of shape {tuple(d2t.shape)}"
            )
        Vd = d2t.shape[0]
    if draft_probs is not None:
        expect.append(("draft_probs", draft_probs, (B, k, Vd), torch.float32))
    for name, t, shape, dtype in expect:
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"verify_chain: {name} must be {dtype} {list(shape)}, got {t.dtype} of shape {tuple(t.shape)}"
            )


def _check_values(x: torch.Tensor, V: int, u_accept: torch.Tensor, u_sample: torch.Tensor) -> None:
    """Draft ids ``x [B, k]`` inside the target vocabulary of ``V`` tokens, uniforms in [0, 1) (B > 0)."""
    if V == 0:
        raise ValueError(f"verify_chain: empty vocabulary (V = 0) with {x.shape[0]} rows")
    if bool((x >= V).any()):
        b, i = (x >= V).nonzero()[0].tolist()
        raise IndexError(
            f"verify_chain: draft_tokens[{b}, {i}] = {int(x[b, i])} is outside the target vocabulary [0, {V})"
        )
    for name, u in (("u_accept", u_accept), ("u_sample", u_sample)):
        bad = ~((u >= 0) & (u < 1))
        if bool(bad.any()):
            raise ValueError(f"verify_chain: {name} must lie in [0, 1), got {float(u[bad][0])}")


def _accepted(lp: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, draft_probs: torch.Tensor | None,
              t2d: torch.Tensor | None, g_rows: torch.Tensor, u_accept: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance test at every drafted position, and where each row's chain stops.

    A sampled row accepts ``x_i`` iff ``u_accept[b, i] * q_i(x_i) < p_i(x_i)`` in float64, i.e.
    ``u < min(1, p/q)``, with ``p_i = spec_exp(lp[b, i])`` and ``q_i(x_i)`` the draft's probability of
    ``x_i`` (read through ``t2d`` for a draft vocabulary, 0 outside it; 1 for a point-mass draft). A greedy
    row (``g_rows``) accepts iff ``x_i == argmax p_i``; an empty slot (``x_i < 0``) never does.

    Returns ``(p_x [B, k] float32, n_acc [B] int64)``: ``p_i(x_i)``, and ``n_acc = sum_i prod_{i'<=i}
    accept_i'``, the accepted prefix (0 when k = 0).
    """
    k = x.shape[1]
    xs = x.clamp(min=0)
    p_x = spec_exp_reference(lp[:, :k].gather(-1, xs[..., None])[..., 0])  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    elif t2d is None:
        q_x = _clean_q(draft_probs.gather(-1, xs[..., None])[..., 0])
    else:
        d = t2d[xs]  # [B, k]
        q_d = draft_probs.gather(-1, d.clamp(min=0)[..., None])[..., 0]
        q_x = torch.where(d >= 0, _clean_q(q_d), torch.zeros_like(q_d))
    accept = u_accept * q_x.double() < p_x.double()  # [B, k]
    if g_rows.numel() and k:
        accept[g_rows] = lp[g_rows, :k].argmax(dim=-1) == x[g_rows]
    accept &= valid
    # The chain stops at the first rejection or empty slot.
    return p_x, torch.cumprod(accept.long(), dim=1).sum(dim=1)


def _rejected_draft_q(p: torch.Tensor, x: torch.Tensor, draft_probs: torch.Tensor | None,
                      d2t: torch.Tensor | None, dr: torch.Tensor, s_rows: torch.Tensor, js: torch.Tensor
                      ) -> torch.Tensor | None:
    """``q_j [Bs, V]``: the draft distribution, over the target vocabulary, at the emission position ``js``
    of each sampled row ``s_rows`` whose ``j`` holds a rejected draft (``dr [Bs]``); zero in the other
    rows (the bonus token and empty slots draw from ``p_j`` alone). None when no row has one.

    ``q`` is ``draft_probs`` itself, or scattered through ``d2t`` (``target_id = draft_id + d2t[draft_id]``),
    or a point mass at the rejected ``x_j`` (no ``draft_probs``: n-gram); below 2**-126 it counts as 0.
    """
    if not bool(dr.any()):
        return None
    q = torch.zeros_like(p)
    dr_idx = dr.nonzero()[:, 0]
    src_rows, src_pos = s_rows[dr_idx], js[dr_idx]
    if draft_probs is None:
        q[dr_idx, x[src_rows, src_pos]] = 1.0
    elif d2t is None:
        q[dr_idx] = draft_probs[src_rows, src_pos]
    else:
        tgt = torch.arange(d2t.shape[0], device=p.device) + d2t
        q[dr_idx[:, None], tgt[None, :]] = draft_probs[src_rows, src_pos]
    return _clean_q(q)


def _draw_sampled(p: torch.Tensor, q: torch.Tensor | None, us: torch.Tensor, s_rows: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:
    """The sampled rows' emitted tokens ``[Bs]``: the inverse CDF with ``us [Bs]`` of the residual
    ``normalize(max(0, p_j - q_j))``, or of ``p_j [Bs, V]`` itself where there is no ``q_j`` or rounding
    leaves the residual without mass (``p <= q`` everywhere). Raises for a row whose ``p_j`` has no mass."""
    t_s, has = inverse_cdf_chunked(_residual(p, q), us)
    if q is not None and not bool(has.all()):
        # Residual without mass: sample p itself.
        miss = (~has).nonzero()[:, 0]
        t_p, has_p = inverse_cdf_chunked(_residual(p[miss], None), us[miss])
        t_s[miss] = t_p
        has[miss] = has_p
    if not bool(has.all()):
        b = int(s_rows[(~has).nonzero()[0, 0]])
        raise ValueError(
            f"verify_chain: target_logprobs[{b}, {int(j[b])}] has no probability mass "
            f"(every log-prob is -inf or NaN)"
        )
    return t_s


def verify_chain_reference(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    d2t: torch.Tensor | None,
    greedy: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``k`` drafted tokens per row; see the module docstring for the exact semantics.

    Args:
        target_logprobs: ``[B, k+1, V]`` float32 processed log-probs of the target.
        draft_tokens: ``[B, k]`` int64 target ids; a negative id ends the row's chain.
        draft_probs: ``[B, k, Vd]`` float32 draft distributions, or None for point-mass drafts.
        d2t: ``[Vd]`` int64 draft-to-target offsets, or None when the draft uses the target vocabulary.
        greedy: ``[B]`` bool rows verified by argmax.
        u_accept: ``[B, k]`` float64 uniforms in [0, 1) for the acceptance tests.
        u_sample: ``[B]`` float64 uniforms in [0, 1) for the correction / bonus token.

    Returns:
        ``(tokens [B, k+1] int64 padded with -1, num_accepted [B] int64)``.
    """
    _check_inputs(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample)
    B, K1, V = target_logprobs.shape
    k = K1 - 1
    device = target_logprobs.device
    tokens = torch.full((B, K1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    if B == 0:
        return tokens, num_accepted
    x = draft_tokens  # [B, k]
    _check_values(x, V, u_accept, u_sample)
    t2d = _t2d(d2t, V) if d2t is not None else None
    lp = target_logprobs
    valid = x >= 0
    g_rows = greedy.nonzero()[:, 0]
    p_x, n_acc = _accepted(lp, x, valid, draft_probs, t2d, g_rows, u_accept)
    j = n_acc  # where the emitted token goes
    # drafted: position j holds a rejected draft (residual), not an empty slot or the bonus (plain p)
    drafted = torch.zeros(B, dtype=torch.bool, device=device)
    if k:
        drafted = (j < k) & valid.gather(1, j.clamp(max=k - 1)[:, None])[:, 0]
    s_rows = (~greedy).nonzero()[:, 0]
    p_emit = spec_exp_reference(lp[s_rows, j[s_rows]]) if s_rows.numel() else None  # [Bs, V]
    _check_distributions(lp, x, valid, greedy, p_x, j, p_emit)

    tok = torch.empty(B, dtype=torch.int64, device=device)
    if g_rows.numel():
        tok[g_rows] = lp[g_rows, j[g_rows]].argmax(dim=-1)
    if s_rows.numel():
        q = _rejected_draft_q(p_emit, x, draft_probs, d2t, drafted[s_rows], s_rows, j[s_rows])
        tok[s_rows] = _draw_sampled(p_emit, q, u_sample[s_rows], s_rows, j)

    pos = torch.arange(K1, device=device)[None, :]
    x_pad = torch.cat([x, torch.full((B, 1), -1, dtype=torch.int64, device=device)], dim=1)
    tokens = torch.where(pos < j[:, None], x_pad, torch.where(pos == j[:, None], tok[:, None], tokens))
    return tokens, n_acc
