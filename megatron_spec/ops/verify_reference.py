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

This module knows nothing about models, engines or how the uniforms were drawn.
References: Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding";
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling".
"""

from __future__ import annotations

import torch

SAMPLE_CHUNK = 256  # csrc/ms_math.h kSampleChunk
# csrc/ms_math.h kMassTol. process_logits' float32 log_softmax sums to 1 within ~1e-6 even at
# V = 152k and low temperature (tests/ops/test_ops_verify.py measures it); raw logits sum to 1 within
# 1e-3 only by accident.
MASS_TOL = 1e-3

# float32 constants of spec_exp, written exactly (csrc/ms_math.h uses the same hex literals).
_LOG2E = float.fromhex("0x1.715476p+0")
_LN2_HI = float.fromhex("0x1.63p-1")
_LN2_LO = -float.fromhex("0x1.bd0106p-13")
_MAGIC = float.fromhex("0x1.8p+23")  # 1.5 * 2**23: x + magic - magic rounds x to nearest even
_POLY = [float.fromhex(h) for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7",
                                    "0x1.555382p-5", "0x1.555554p-3", "0x1p-1")]
_FLT_MIN = float.fromhex("0x1p-126")


def spec_exp_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 exp of log-probabilities: 0 below -86, inputs clamped at 88, NaN kept. About 1 ulp."""
    if x.dtype != torch.float32:
        raise ValueError(f"spec_exp expects float32, got {x.dtype}")

    def c(v: float) -> torch.Tensor:  # 0-dim float32 constant: every op below stays in float32
        return torch.tensor(v, dtype=torch.float32, device=x.device)

    isnan = torch.isnan(x)
    xc = torch.where(x > 88.0, c(88.0), x)
    xc = torch.where((xc < -86.0) | isnan, c(-86.0), xc)
    n = (xc * c(_LOG2E) + c(_MAGIC)) - c(_MAGIC)
    r = (xc - n * c(_LN2_HI)) - n * c(_LN2_LO)
    z = r * r
    y = torch.full_like(r, _POLY[0])
    for coef in _POLY[1:]:
        y = y * r + c(coef)
    y = (y * z + r) + c(1.0)
    scale = torch.bitwise_left_shift(n.to(torch.int32) + 127, 23).view(torch.float32)
    out = y * scale
    out = torch.where(x < -86.0, c(0.0), out)
    return torch.where(isnan, x, out)


def _clean_q(q: torch.Tensor) -> torch.Tensor:
    return torch.where(q >= _FLT_MIN, q, torch.zeros((), dtype=q.dtype, device=q.device))


def _residual(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q) in float64 (NaN -> 0)."""
    d = p.double() if q is None else p.double() - q.double()
    return torch.where(d > 0, d, torch.zeros((), dtype=d.dtype, device=d.device))


def inverse_cdf_chunked(r: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one index per row of the unnormalised float64 weights ``r [R, V]`` with ``u [R]``.

    Returns ``(index [R] int64, has_mass [R] bool)``; the index of a row without mass is garbage.
    """
    R, V = r.shape
    C = SAMPLE_CHUNK
    nC = -(-V // C)
    r3 = torch.nn.functional.pad(r, (0, nC * C - V)).view(R, nC, C)  # [R, nC, C]
    L = torch.cumsum(r3, dim=-1)  # within-chunk sequential prefix
    P = torch.cumsum(L[..., -1].contiguous(), dim=-1)  # [R, nC] prefix of chunk sums
    total = P[:, -1]
    has_mass = total > 0
    theta = u * total  # [R]
    cs = torch.searchsorted(P, theta[:, None], right=True)[:, 0].clamp(max=nC - 1)  # [R]
    rows = torch.arange(R, device=r.device)
    p_prev = torch.where(cs > 0, P[rows, (cs - 1).clamp(min=0)], torch.zeros_like(theta))
    theta_local = theta - p_prev
    Lc = L[rows, cs].contiguous()  # [R, C]
    ti = torch.searchsorted(Lc, theta_local[:, None], right=True)[:, 0]
    pos = torch.arange(C, device=r.device)
    last = torch.where(r3[rows, cs] > 0, pos, torch.full_like(pos, -1)).amax(dim=-1)
    ti = torch.where(ti < C, ti, last)
    return cs * C + ti, has_mass


def logprob_mass(lp: torch.Tensor) -> torch.Tensor:
    """``[R]`` float64 mass ``sum_t spec_exp(lp[r, t])`` of ``lp [R, V]`` float32, in a fixed order.

    Per ``SAMPLE_CHUNK``-token chunk, eight lanes: lane ``l`` sums the chunk's tokens ``l, l+8, ...``
    sequentially from 0.0, and the chunk's mass is ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`` (the order
    the kernels vectorise); the chunk masses are then summed sequentially. NaN anywhere in a row makes
    its mass NaN.
    """
    return _mass(spec_exp_reference(lp))


def _mass(p: torch.Tensor) -> torch.Tensor:
    """``logprob_mass`` of the probabilities ``p [R, V]`` (float32, already ``spec_exp``'d)."""
    R, V = p.shape
    C = SAMPLE_CHUNK
    nC = -(-V // C)
    if nC == 0:
        return torch.zeros(R, dtype=torch.float64, device=p.device)
    pd = torch.nn.functional.pad(p.double(), (0, nC * C - V))  # zeros add nothing
    by_lane = pd.view(R, nC, C // 8, 8).transpose(2, 3).contiguous()  # [R, nC, 8, C/8]
    lanes = torch.cumsum(by_lane, dim=-1)[..., -1]  # [R, nC, 8]: sequential per lane
    pairs = lanes[..., 0::2] + lanes[..., 1::2]  # [R, nC, 4]
    chunk = (pairs[..., 0] + pairs[..., 1]) + (pairs[..., 2] + pairs[..., 3])  # [R, nC]
    return torch.cumsum(chunk.contiguous(), dim=-1)[:, -1]


def _mass_ok(m: torch.Tensor) -> torch.Tensor:
    return (m >= 1.0 - MASS_TOL) & (m <= 1.0 + MASS_TOL)  # False for NaN


def _greedy_max_ok(p_max: torch.Tensor, V: int) -> torch.Tensor:
    p = p_max.double()
    return (p <= 1.0 + MASS_TOL) & (p * V >= 1.0 - MASS_TOL)  # False for NaN


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
        m[s_rows] = _mass(p_emit)  # [Bs]
        bad_at_j[s_rows] = ~_mass_ok(m[s_rows])
    p_max = torch.zeros(B, dtype=torch.float32, device=lp.device)
    if g_rows.numel():
        p_max[g_rows] = spec_exp_reference(lp[g_rows, j[g_rows]].amax(dim=-1))  # NaN rows failed above
        bad_at_j[g_rows] = ~_greedy_max_ok(p_max[g_rows], V)
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


def _check_inputs(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample) -> int:
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
    return Vd


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
    Vd = _check_inputs(target_logprobs, draft_tokens, draft_probs, d2t, greedy, u_accept, u_sample)
    B, K1, V = target_logprobs.shape
    k = K1 - 1
    device = target_logprobs.device
    tokens = torch.full((B, K1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    if B == 0:
        return tokens, num_accepted
    if V == 0:
        raise ValueError(f"verify_chain: empty vocabulary (V = 0) with {B} rows")
    x = draft_tokens  # [B, k]
    if bool((x >= V).any()):
        b, i = (x >= V).nonzero()[0].tolist()
        raise IndexError(
            f"verify_chain: draft_tokens[{b}, {i}] = {int(x[b, i])} is outside the target vocabulary [0, {V})"
        )
    for name, u in (("u_accept", u_accept), ("u_sample", u_sample)):
        bad = ~((u >= 0) & (u < 1))
        if bool(bad.any()):
            raise ValueError(f"verify_chain: {name} must lie in [0, 1), got {float(u[bad][0])}")
    t2d = _t2d(d2t, V) if d2t is not None else None
    lp = target_logprobs
    valid = x >= 0
    xs = x.clamp(min=0)

    # Acceptance tests at every drafted position (cheap: k gathers per row).
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
    g_rows = greedy.nonzero()[:, 0]
    if g_rows.numel() and k:
        accept[g_rows] = lp[g_rows, :k].argmax(dim=-1) == x[g_rows]
    accept &= valid
    # The chain stops at the first rejection or empty slot: j = n_acc is where the emitted token goes.
    n_acc = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B] (0 when k = 0)
    j = n_acc
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
        js = j[s_rows]
        p = p_emit  # [Bs, V]
        q = None
        dr = drafted[s_rows]
        if bool(dr.any()):
            q = torch.zeros_like(p)
            dr_idx = dr.nonzero()[:, 0]
            src_rows, src_pos = s_rows[dr_idx], js[dr_idx]
            if draft_probs is None:
                q[dr_idx, x[src_rows, src_pos]] = 1.0
            elif t2d is None:
                q[dr_idx] = draft_probs[src_rows, src_pos]
            else:
                tgt = torch.arange(Vd, device=device) + d2t
                q[dr_idx[:, None], tgt[None, :]] = draft_probs[src_rows, src_pos]
            q = _clean_q(q)
        us = u_sample[s_rows]
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
        tok[s_rows] = t_s

    pos = torch.arange(K1, device=device)[None, :]
    x_pad = torch.cat([x, torch.full((B, 1), -1, dtype=torch.int64, device=device)], dim=1)
    tokens = torch.where(pos < j[:, None], x_pad, torch.where(pos == j[:, None], tok[:, None], tokens))
    return tokens, n_acc
