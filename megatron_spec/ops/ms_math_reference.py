"""Pure-PyTorch reference of the per-element math of ``csrc/ms_math.h`` that chain verification stands on,
to the bit: ``spec_exp`` (a float32 exp from IEEE additions and multiplications only: Cody-Waite reduction
+ the Cephes polynomial), the chunked float64 inverse CDF, the fixed-order probability mass, and the bounds
the input checks hold a mass or a largest probability to.

The orders of summation these realise are part of the op's specification (the module docstring of
``megatron_spec.ops.verify_reference``); each function's docstring states its own. It knows nothing about
drafts, acceptance or the rows of a verify.
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


def inverse_cdf_chunked(r: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one index per row of the unnormalised float64 weights ``r [R, V]`` with ``u [R]``.

    Order: chunks of ``SAMPLE_CHUNK`` tokens, each summed sequentially from 0.0; ``P`` the sequential
    prefix of the chunk sums, ``theta = u * P[-1]``; the first chunk ``c`` with ``P[c] > theta``, in it
    the first token whose chunk-local sequential prefix exceeds ``theta - P[c-1]`` (or, if rounding leaves
    none, the chunk's last token with ``r > 0``). ``torch.cumsum`` on CPU accumulates sequentially in
    float64, so it realises this order.

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
    return probability_mass(spec_exp_reference(lp))


def probability_mass(p: torch.Tensor) -> torch.Tensor:
    """:func:`logprob_mass` of the probabilities ``p [R, V]`` (float32, already ``spec_exp``'d)."""
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


def mass_ok(m: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: a mass ``m [R]`` a distribution can have (within ``MASS_TOL`` of 1)."""
    return (m >= 1.0 - MASS_TOL) & (m <= 1.0 + MASS_TOL)  # False for NaN


def greedy_max_ok(p_max: torch.Tensor, V: int) -> torch.Tensor:
    """``[R]`` bool: a largest probability ``p_max [R]`` a distribution over ``V`` tokens can have: in
    ``[(1 - MASS_TOL) / V, 1 + MASS_TOL]``."""
    p = p_max.double()
    return (p <= 1.0 + MASS_TOL) & (p * V >= 1.0 - MASS_TOL)  # False for NaN
