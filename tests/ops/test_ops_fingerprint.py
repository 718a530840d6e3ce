"""Compiled fingerprint sums == the numpy reference, bit for bit: every width, kernel variant, edge value."""

from __future__ import annotations

import pytest
import torch

from megatron_spec import ops
from megatron_spec.sync import fingerprint as fpm

pytestmark = pytest.mark.skipif(
    not ops.compiled_kernel_for("bits_sums", torch.device("cpu")),
    reason="compiled ops unavailable: megatron_spec._C not built (pip install --no-build-isolation -e .) or "
           "MEGATRON_SPEC_FORCE_REFERENCE=1",
)
MOD = 1 << 64


def compiled(bits: torch.Tensor) -> tuple[int, int]:
    s1, s2 = torch.ops.megatron_spec.bits_sums(bits).tolist()
    return s1 % MOD, s2 % MOD


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
# below, at and across the kernel's chunks
@pytest.mark.parametrize("n", [0, 1, 7, (1 << 18) + 3, 3 * (1 << 18)])
def test_sums_equal_the_reference(kernel_variant, dtype, n):
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(info.min, info.max, (n,), dtype=dtype, generator=g)
    if n:
        bits[0], bits[-1] = info.min, info.max  # the extremes: squares that wrap mod 2**64
    assert compiled(bits) == fpm._numpy_sums(bits.numpy())


def test_exact_values_by_hand():
    bits = torch.tensor([-1, 2, -3], dtype=torch.int32)
    assert compiled(bits) == ((-2) % MOD, 14)
    big = torch.tensor([torch.iinfo(torch.int64).min] * 2, dtype=torch.int64)  # (-2**63) * 2 == 0 mod 2**64
    assert compiled(big) == (0, 0)


def test_fingerprint_is_the_same_with_and_without_the_kernel(monkeypatch):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(300, 70, generator=g), torch.randn(5000, generator=g).to(torch.bfloat16),
               torch.randint(-5, 5, (33,), generator=g)]
    fast = fpm.fingerprint_tensors(tensors)
    monkeypatch.setattr(fpm, "_compiled_sums", lambda: False)
    assert fpm.fingerprint_tensors(tensors) == fast


def test_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bits_sums expects int8, int16, int32 or int64 bits"):
        torch.ops.megatron_spec.bits_sums(torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, (1 << 18) + 3, 3 * (1 << 18)])
def test_sums_while_copying_equal_the_reference_and_copy_every_bit(kernel_variant, dtype, n):
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(n + 1)
    bits = torch.randint(info.min, info.max, (n,), dtype=dtype, generator=g)
    if n:
        bits[0], bits[-1] = info.min, info.max
    dst = torch.full((n,), 7, dtype=dtype)
    s1, s2 = torch.ops.megatron_spec.bits_sums_copy(bits, dst).tolist()
    assert (s1 % MOD, s2 % MOD) == fpm._numpy_sums(bits.numpy())
    assert torch.equal(dst, bits)


def test_sums_while_copying_refuse_a_destination_that_does_not_match():
    src = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="dst must match bits"):
        torch.ops.megatron_spec.bits_sums_copy(src, torch.zeros(8, dtype=torch.int16))
    with pytest.raises(ValueError, match="dst must match bits"):
        torch.ops.megatron_spec.bits_sums_copy(src, torch.zeros(9, dtype=torch.int32))
    with pytest.raises(ValueError, match="dst must be contiguous"):
        torch.ops.megatron_spec.bits_sums_copy(src, torch.zeros(16, dtype=torch.int32)[::2])


@pytest.mark.parametrize("offset", range(17))
def test_sums_while_copying_into_any_alignment(kernel_variant, offset):
    """The AVX2 copy streams its stores from the first 32-byte boundary of the destination on, the AVX-512 one
    from the first 64-byte boundary: a bucket's tensors start wherever the one before ended (4-byte alignment
    for fp32), so every offset is met."""
    g = torch.Generator().manual_seed(offset)
    n = 1000 + offset
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    dst = torch.full((n + 16,), 7, dtype=torch.int32)[offset:offset + n]
    s1, s2 = torch.ops.megatron_spec.bits_sums_copy(bits, dst).tolist()
    assert (s1 % MOD, s2 % MOD) == fpm._numpy_sums(bits.numpy())
    assert torch.equal(dst, bits)
