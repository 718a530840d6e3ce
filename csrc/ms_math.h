// Per-element math shared by the CPU kernels (csrc/*.cpp) and the CUDA kernels (csrc/cuda/*.cu).
//
// Everything here is a pure function of scalars, written so that the C++ compiler, nvcc and the
// pure-PyTorch references in megatron_spec/ops/ produce the same bits:
//   * only IEEE-754 basic operations (add, sub, mul, div, compare) and integer bit manipulation;
//   * on the device the arithmetic goes through the __f*_rn / __d*_rn intrinsics, which are never
//     contracted into FMAs and ignore --use_fast_math's approximate division;
//   * on the host the build passes -ffp-contract=off (setup.py) for the same reason;
//   * no value computed here is a float32 subnormal where the result depends on it, so the
//     flush-to-zero mode that --use_fast_math turns on cannot change a result.
// The file does not include torch headers (nvcc here cannot compile them, see docs/design.md,
// "nvcc and the CPU torch wheel") and knows nothing about tensors, strides or threads.
//
// References:
//   * FP8 E4M3FN: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); the encoder follows
//     c10/util/Float8_e4m3fn.h (fp8e4m3fn_from_fp32_value) with saturation at 448 instead of NaN.
//   * Block quantisation: DeepSeek-V3 / SGLang per_block_cast_to_fp8 (weight_scale_inv = amax/448,
//     amax clamped at 1e-4, quantised as x * (448 * (1/amax))).
//   * exp: Cody-Waite range reduction with the Cephes expf polynomial (S. Moshier, Cephes library).
//   * Speculative sampling: Leviathan et al. (2023) and Chen et al. (2023); acceptance test
//     u < min(1, p/q) is evaluated as u*q < p in float64.
#pragma once

#include <stdint.h>

#include <cstring>

#if defined(__CUDACC__)
#define MS_HD __host__ __device__ __forceinline__
#else
// Always inlined: the CPU kernels are compiled once per ISA (csrc/cpu/kernels.h) and include this
// header as baseline code; inlined into a variant's loop, a function is vectorised for that ISA.
#define MS_HD inline __attribute__((always_inline))
#endif

#if defined(__FAST_MATH__) && !defined(__CUDA_ARCH__)
#error "ms_math.h must not be compiled with -ffast-math: kernels and references must agree bit for bit"
#endif

namespace megatron_spec {

// ---------------------------------------------------------------------------------------------
// Bit casts and exactly rounded arithmetic.
// ---------------------------------------------------------------------------------------------
MS_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MS_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

#if defined(__CUDA_ARCH__)
MS_HD float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
MS_HD float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
MS_HD float fsub_rn(float a, float b) { return __fsub_rn(a, b); }
MS_HD float fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
MS_HD double dmul_rn(double a, double b) { return __dmul_rn(a, b); }
MS_HD double dadd_rn(double a, double b) { return __dadd_rn(a, b); }
MS_HD double dsub_rn(double a, double b) { return __dsub_rn(a, b); }
#else
MS_HD float fmul_rn(float a, float b) { return a * b; }
MS_HD float fadd_rn(float a, float b) { return a + b; }
MS_HD float fsub_rn(float a, float b) { return a - b; }
MS_HD float fdiv_rn(float a, float b) { return a / b; }
MS_HD double dmul_rn(double a, double b) { return a * b; }
MS_HD double dadd_rn(double a, double b) { return a + b; }
MS_HD double dsub_rn(double a, double b) { return a - b; }
#endif

// ---------------------------------------------------------------------------------------------
// 16-bit float formats (storage as uint16_t so the header needs no vendor types).
// ---------------------------------------------------------------------------------------------
MS_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN keeps its sign and becomes a quiet NaN (as c10::BFloat16 does).
MS_HD uint16_t f32_to_bf16_rne(float f) {
  const uint32_t u = f32_bits(f);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
}

// IEEE half -> float, exact for every input (subnormal halves are normal floats).
MS_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  // normal: rebias 15 -> 127; inf/nan: exponent all ones; subnormal: m * 2^-24 (exact).
  const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13);
  const uint32_t infnan = sign | 0x7F800000u | (m << 13);
  const float sub = fmul_rn(static_cast<float>(m), 5.9604644775390625e-08f);  // 2^-24
  const uint32_t subb = sign | f32_bits(sub);
  return f32_from_bits(e == 0u ? subb : (e == 31u ? infnan : normal));
}

// float -> IEEE half, round to nearest even, overflow to inf, NaN stays NaN (quiet, sign kept).
// Subnormal halves use the same magic-add trick as the FP8 encoder: adding 0.5 leaves |f| < 2^-14
// in ulps of 2^-24 (the half subnormal step), rounded to nearest even by the FPU.
MS_HD uint16_t f32_to_f16_rne(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t nrm_base = a - (112u << 23);  // rebias 127 -> 15
  const uint32_t nrm = (nrm_base + 0xFFFu + ((nrm_base >> 13) & 1u)) >> 13;
  const uint32_t sub = f32_bits(fadd_rn(f32_from_bits(a), 0.5f)) - 0x3F000000u;
  uint32_t r = a < (113u << 23) ? sub : nrm;
  r = a >= 0x477FF000u ? 0x7C00u : r;  // rounds to >= 65520: inf
  r = a > 0x7F800000u ? 0x7E00u : r;   // NaN
  return static_cast<uint16_t>(sign | r);
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3FN (bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448).
// ---------------------------------------------------------------------------------------------
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;  // SGLang/DeepGEMM clamp(1e-4): all-zero blocks get 1e-4/448

// Round to nearest even, saturating finite magnitudes above 448 (and infinities) at +-448.
MS_HD uint8_t fp8e4m3_from_f32_sat(float f) {
  const uint32_t bits = f32_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  uint32_t a = bits ^ sign;
  const bool nan = a > 0x7F800000u;
  a = a > 0x43E00000u ? 0x43E00000u : a;  // 448.0f
  // |f| < 2^-6 (fp8 subnormal): adding 2^14 leaves the value in ulps of 2^-9, rounded RNE by the FPU
  // (the operand is never a float32 subnormal that matters: those all round to 0 either way).
  const uint32_t sub = f32_bits(fadd_rn(f32_from_bits(a), 16384.0f)) - (141u << 23);
  // normal: rebias 127 -> 7 and round the mantissa to 3 bits, ties to even.
  const uint32_t nrm = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  uint32_t r = a < (121u << 23) ? sub : nrm;
  r = nan ? 0x7Fu : r;
  return static_cast<uint8_t>(r | (sign >> 24));
}

// Exact decode. NaN codes decode to sign|0x7FF00000, as torch's float8_e4m3fn -> float32 does.
MS_HD float fp8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xFu;
  const uint32_t m = v & 0x7u;
  const uint32_t normal = sign | ((e + 120u) << 23) | (m << 20);
  const float sub = fmul_rn(static_cast<float>(m), 0.001953125f);  // m * 2^-9, exact
  const uint32_t subb = sign | f32_bits(sub);
  const uint32_t nan = sign | 0x7FF00000u;
  return f32_from_bits((v & 0x7Fu) == 0x7Fu ? nan : (e == 0u ? subb : normal));
}

// |x| as ordered bits: for non-negative floats, integer order == numeric order and any NaN is
// larger than +inf, so an integer max over these propagates NaN and inf (and ignores -0.0).
MS_HD uint32_t f32_abs_bits(float f) { return f32_bits(f) & 0x7FFFFFFFu; }
MS_HD uint32_t bf16_abs_bits(uint16_t h) { return static_cast<uint32_t>(h & 0x7FFFu) << 16; }

// Block scale from the block's max |x| (float32): amax is clamped at 1e-4 (all-zero blocks),
// weight_scale_inv = amax / 448 (IEEE division) is the dequantisation multiplier, and the
// quantisation multiplier is (1/amax) * 448, rounded twice, which is how torch evaluates
// `448.0 / amax` in SGLang's per_block_cast_to_fp8 (Tensor.__rtruediv__ = reciprocal() * other).
MS_HD float fp8_block_amax_clamped(float amax) { return amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax; }
MS_HD float fp8_block_scale_inv(float amax_clamped) { return fdiv_rn(amax_clamped, kFp8E4M3Max); }
MS_HD float fp8_block_quant_mult(float amax_clamped) {
  return fmul_rn(fdiv_rn(1.0f, amax_clamped), kFp8E4M3Max);
}

// Vector (AVX2 / AVX-512) forms of the conversions above live with the CPU loops that use them,
// in csrc/cpu/kernels_impl.h.

// ---------------------------------------------------------------------------------------------
// Speculative sampling.
// ---------------------------------------------------------------------------------------------
// Residual inverse-CDF sampling sums float64 values sequentially inside chunks of this many
// tokens, then sequentially over chunk sums (see ops/verify_reference.py for the exact order).
// Fixed chunks let a GPU block sum chunks in parallel and still match the CPU bit for bit.
constexpr int64_t kSampleChunk = 256;

// Deterministic float32 exp of a log-probability.
//   x < -86 -> 0 (exp(-86) ~ 4e-38: keeps every nonzero result a normal float32),
//   x > 88 is clamped to 88 (log-probabilities are <= 0; this only keeps the result finite),
//   NaN -> NaN.
// Cody-Waite reduction x = n ln2 + r with n = rint(x log2 e) (the 1.5*2^23 trick rounds to nearest
// even), Cephes polynomial for e^r, then exact scaling by 2^n built from bits. About 1 ulp.
// Constants are the float32 values of Cephes' decimal ones, written exactly (hex) so that C++, CUDA
// and Python (float.fromhex) cannot round them differently.
MS_HD float spec_expf(float x) {
  // Selects only (no && / ||): keeps the loop branch-free so GCC vectorises it.
  float xc = x > 88.0f ? 88.0f : x;
  xc = xc < -86.0f ? -86.0f : xc;
  xc = x == x ? xc : -86.0f;  // NaN: compute on a dummy, return NaN below
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float n = fsub_rn(fadd_rn(fmul_rn(xc, 0x1.715476p+0f), magic), magic);
  const float r = fsub_rn(fsub_rn(xc, fmul_rn(n, 0x1.63p-1f)), fmul_rn(n, -0x1.bd0106p-13f));
  const float z = fmul_rn(r, r);
  float y = 0x1.a0d2cep-13f;
  y = fadd_rn(fmul_rn(y, r), 0x1.6e879cp-10f);
  y = fadd_rn(fmul_rn(y, r), 0x1.11121p-7f);
  y = fadd_rn(fmul_rn(y, r), 0x1.555382p-5f);
  y = fadd_rn(fmul_rn(y, r), 0x1.555554p-3f);
  y = fadd_rn(fmul_rn(y, r), 0x1p-1f);
  y = fadd_rn(fadd_rn(fmul_rn(y, z), r), 1.0f);
  const int32_t ni = static_cast<int32_t>(n);  // in [-124, 127]
  const float scale = f32_from_bits(static_cast<uint32_t>(ni + 127) << 23);
  const float out = x < -86.0f ? 0.0f : fmul_rn(y, scale);
  return x == x ? out : x;
}

// Draft probabilities below the smallest normal float32 (and negative or NaN ones) count as 0.
MS_HD float spec_clean_q(float q) { return q >= 0x1p-126f ? q : 0.0f; }

// Accept a draft token with probability min(1, p/q): u*q < p in float64, u in [0, 1).
// q == 0 accepts whenever p > 0 (ratio +inf); p == 0 never accepts.
MS_HD bool spec_accept(double u, float q, float p) {
  return dmul_rn(u, static_cast<double>(q)) < static_cast<double>(p);
}

// Input checks (megatron_spec/ops/verify_reference.py, "Input checks"): the mass of a sampled row's
// log-probs, summed in float64 in the order of verify_reference.logprob_mass, must lie within
// kMassTol of 1; a greedy row's largest probability must be one a distribution can have; a tested
// draft's p_i(x_i) must not exceed 1 + kMassTol. All are false for NaN.
constexpr double kMassTol = 1e-3;
MS_HD bool spec_mass_ok(double m) { return m >= 1.0 - kMassTol && m <= 1.0 + kMassTol; }
MS_HD bool spec_p_ok(float p) { return static_cast<double>(p) <= 1.0 + kMassTol; }
// A greedy row's largest probability, as a distribution has it: in [(1 - kMassTol) / V, 1 + kMassTol].
MS_HD bool spec_greedy_max_ok(float p_max, int64_t V) {
  const double p = static_cast<double>(p_max);
  return p <= 1.0 + kMassTol && dmul_rn(p, static_cast<double>(V)) >= 1.0 - kMassTol;
}

// One term of the residual max(0, p - q) in float64 (NaN -> 0, so NaN tokens are never sampled).
MS_HD double spec_residual(float p, float q) {
  const double d = dsub_rn(static_cast<double>(p), static_cast<double>(q));
  return d > 0.0 ? d : 0.0;
}

}  // namespace megatron_spec
