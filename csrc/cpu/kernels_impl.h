// The CPU hot loops, compiled once per instruction set (see kernels.h). Included only by
// csrc/cpu/kernels_<isa>.cpp, after the system headers and ms_math.h, inside a `#pragma GCC target`
// region, with MS_CPU_NS (the namespace), MS_CPU_TABLE (the table's name) and MS_ISA_LEVEL
// (0 default, 1 AVX2+FMA+F16C, 2 AVX-512 F/BW/VL/DQ) defined.
//
// The per-element math comes from ms_math.h (scalar, compiled for the baseline and inlined here,
// where GCC vectorises it for the region's ISA). Where GCC would not vectorise a loop well, an
// intrinsics version computes the same integer and float steps lane by lane (bf16/f16 -> f32,
// the finite FP8 encoder, argmax): tests compare every variant with the references bit for bit.
//
// Reference: megatron_spec/ops/fp8_reference.py and verify_reference.py (the oracles).

#if !defined(MS_CPU_NS) || !defined(MS_CPU_TABLE) || !defined(MS_ISA_LEVEL)
#error "kernels_impl.h is included by csrc/cpu/kernels_<isa>.cpp only"
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on _mm512_undefined_*() (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace megatron_spec {
namespace cpu {
namespace MS_CPU_NS {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// =================================================================================================
// Lane helpers: same steps as ms_math.h's scalar functions.
// =================================================================================================
#if MS_ISA_LEVEL == 2
inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
inline __m512 f16x16_to_f32(const uint16_t* p) {  // F16C conversion is exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp8e4m3_from_f32_sat for 16 finite values with |v| < 464. Inside a block quantised with its own
// (finite) amax, |x * mult| <= 448 (1 + 3 * 2^-24), so NaN and saturation cannot occur and the
// normal-path rounding already yields 0x7E at the top, exactly like the scalar function.
inline __m128i fp8e4m3_from_f32_finite_x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f))),
      _mm512_set1_epi32(static_cast<int>(141u << 23)));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i nrm = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(0x7FFFFu - (120u << 23)))), odd), 20);
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(121u << 23)));
  const __m512i r = _mm512_mask_blend_epi32(is_sub, nrm, sub);
  // r | ((bits >> 24) & 0x80): ternary logic A | (B & C)
  const __m512i out = _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
  return _mm512_cvtepi32_epi8(out);
}
#elif MS_ISA_LEVEL == 1
// AVX2 has half the lanes and no mask registers, so its encoder takes fewer steps per lane than the
// AVX-512 one (the vector shift units bound it): one magic add serves the normal and the subnormal
// range, and the signs are merged after packing to bytes. For a finite |v| < 464 with exponent
// field E, let E' = max(E, 121) (121: 2^-6, fp8's smallest normal; below it the fp8 step is fixed at
// 2^-9) and c = 2^(E' - 127 + 20). |v| + c rounds |v|, to nearest even by the FPU, to a multiple of
// c's ulp 2^(E' - 127 - 3), the fp8 step at E' (exactly fp8e4m3_from_f32_sat's sub path, 16384 =
// 2^14, when E' = 121), and leaves the exponent at E' + 20, so k = bits(|v| + c) - bits(c) is the
// rounded |v| in steps (8..16 for normals, 0..8 below) and the code is (E' - 121) * 8 + k.
inline __m256i fp8e4m3_abs_codes_x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i e = _mm256_max_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000)),
                                     _mm256_set1_epi32(static_cast<int>(121u << 23)));
  const __m256i c = _mm256_add_epi32(e, _mm256_set1_epi32(static_cast<int>(20u << 23)));
  const __m256i k =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(c))), c);
  return _mm256_add_epi32(k, _mm256_sub_epi32(_mm256_srli_epi32(e, 20), _mm256_set1_epi32(121 << 3)));
}
// 32 values (four vectors of 8, each pair of 128-bit lanes in the order `perm` restores) -> 32 fp8
// bytes. Codes are 0..126 and pack exactly (unsigned saturation); the signs pack with signed
// saturation, which keeps each float's sign in bit 7 of its byte.
inline __m256i encode_x32(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256i perm) {
  const __m256i codes = _mm256_packus_epi16(
      _mm256_packus_epi32(fp8e4m3_abs_codes_x8(v0), fp8e4m3_abs_codes_x8(v1)),
      _mm256_packus_epi32(fp8e4m3_abs_codes_x8(v2), fp8e4m3_abs_codes_x8(v3)));
  const __m256i signs = _mm256_packs_epi16(
      _mm256_packs_epi32(_mm256_castps_si256(v0), _mm256_castps_si256(v1)),
      _mm256_packs_epi32(_mm256_castps_si256(v2), _mm256_castps_si256(v3)));
  const __m256i out = _mm256_or_si256(codes, _mm256_and_si256(signs, _mm256_set1_epi8(static_cast<char>(0x80))));
  return _mm256_permutevar8x32_epi32(out, perm);
}
// Packing four vectors of 8 consecutive values interleaves 4-byte groups as 0 2 4 6 | 1 3 5 7.
inline __m256i perm_consecutive() { return _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); }
#endif

// =================================================================================================
// FP8 block quantisation.
//
// Input traits. Pass 1 takes the max of |x| as ordered integer bits in the input's own width
// (u16 for 16-bit floats: twice the lanes), then converts that one value to float32.
// =================================================================================================
struct F32In {
  using T = float;
  using Bits = uint32_t;
  static inline uint32_t abs_bits(float x) { return f32_abs_bits(x); }
  static inline float amax_f32(uint32_t m) { return f32_from_bits(m); }
  static inline float load(float x) { return x; }
#if MS_ISA_LEVEL == 2
  static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#elif MS_ISA_LEVEL == 1
  static inline __m256i encode32(const float* p, __m256 s) {
    return encode_x32(_mm256_mul_ps(_mm256_loadu_ps(p), s), _mm256_mul_ps(_mm256_loadu_ps(p + 8), s),
                      _mm256_mul_ps(_mm256_loadu_ps(p + 16), s), _mm256_mul_ps(_mm256_loadu_ps(p + 24), s),
                      perm_consecutive());
  }
#endif
};
struct BF16In {
  using T = uint16_t;
  using Bits = uint16_t;
  static inline uint16_t abs_bits(uint16_t x) { return static_cast<uint16_t>(x & 0x7FFFu); }
  static inline float amax_f32(uint16_t m) { return bf16_to_f32(m); }
  static inline float load(uint16_t x) { return bf16_to_f32(x); }
#if MS_ISA_LEVEL == 2
  static inline __m512 load16(const uint16_t* p) { return bf16x16_to_f32(p); }
#elif MS_ISA_LEVEL == 1
  // bf16 -> f32 is "put the 16 bits on top": interleaving with zeros does it without shifts, giving
  // values 0-3 8-11 | 4-7 12-15 per 16 loaded; the packs then restore the order but for the
  // 4-byte groups 0 1 4 5 | 2 3 6 7, which the permutation undoes.
  static inline __m256i encode32(const uint16_t* p, __m256 s) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const auto f = [&](__m256i h) { return _mm256_mul_ps(_mm256_castsi256_ps(h), s); };
    return encode_x32(f(_mm256_unpacklo_epi16(z, x)), f(_mm256_unpackhi_epi16(z, x)), f(_mm256_unpacklo_epi16(z, y)),
                      f(_mm256_unpackhi_epi16(z, y)), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  }
#endif
};
struct F16In {
  using T = uint16_t;
  using Bits = uint16_t;
  static inline uint16_t abs_bits(uint16_t x) { return static_cast<uint16_t>(x & 0x7FFFu); }
  static inline float amax_f32(uint16_t m) { return f16_to_f32(m); }
  static inline float load(uint16_t x) { return f16_to_f32(x); }
#if MS_ISA_LEVEL == 2
  static inline __m512 load16(const uint16_t* p) { return f16x16_to_f32(p); }
#elif MS_ISA_LEVEL == 1
  static inline __m256i encode32(const uint16_t* p, __m256 s) {
    const auto f = [&](const uint16_t* q) {  // F16C conversion is exact
      return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), s);
    };
    return encode_x32(f(p), f(p + 8), f(p + 16), f(p + 24), perm_consecutive());
  }
#endif
};

// Quantise row[a, b) of one block with multiplier s into orow[a, b).
template <typename In>
inline void quantize_run(const typename In::T* __restrict row, uint8_t* __restrict orow, int64_t a, int64_t b,
                         float s, bool finite) {
  int64_t c = a;
#if MS_ISA_LEVEL == 2
  if (finite) {
    const __m512 vs = _mm512_set1_ps(s);
    for (; c + 16 <= b; c += 16) {
      const __m128i q = fp8e4m3_from_f32_finite_x16(_mm512_mul_ps(In::load16(row + c), vs));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + c), q);
    }
  }
#elif MS_ISA_LEVEL == 1
  if (finite) {
    const __m256 vs = _mm256_set1_ps(s);
    for (; c + 32 <= b; c += 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c), In::encode32(row + c, vs));
    }
  }
#else
  (void)finite;
#endif
  for (; c < b; ++c) orow[c] = fp8e4m3_from_f32_sat(fmul_rn(In::load(row[c]), s));
}

// Pass 1 sweeps the unit's rows left to right keeping a running column-wise max of |x| bits
// (vertical max: no horizontal reductions in the hot loop, one contiguous stream per row for the
// prefetcher); pass 2 sweeps the same rows again (now in L2) and writes the quantised bytes.
template <typename In>
void quantize_unit(const typename In::T* __restrict w, uint8_t* __restrict out, int64_t ld, int64_t rows,
                   int64_t nc, int64_t bk, float* __restrict scale_out, uint32_t* colmax_scratch,
                   float* __restrict mult, uint8_t* __restrict finite) {
  using T = typename In::T;
  using Bits = typename In::Bits;
  Bits* __restrict cm = reinterpret_cast<Bits*>(colmax_scratch);
  for (int64_t c = 0; c < nc; ++c) cm[c] = 0;
  // Pass 1: column-wise max of |x| over the block row (integer max: NaN/inf propagate).
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict row = w + r * ld;
    for (int64_t c = 0; c < nc; ++c) {
      const Bits v = In::abs_bits(row[c]);
      cm[c] = v > cm[c] ? v : cm[c];
    }
  }
  const int64_t nb = (nc + bk - 1) / bk;
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t a = j * bk, b = imin(nc, a + bk);
    Bits m = 0;
    for (int64_t c = a; c < b; ++c) m = cm[c] > m ? cm[c] : m;
    const float raw = In::amax_f32(m);
    const float amax = fp8_block_amax_clamped(raw);
    scale_out[j] = fp8_block_scale_inv(amax);
    mult[j] = fp8_block_quant_mult(amax);
    finite[j] = f32_abs_bits(raw) < 0x7F800000u;
  }
  // Pass 2: quantise, one column block at a time so the multiplier is a loop constant.
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict row = w + r * ld;
    uint8_t* __restrict orow = out + r * ld;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t a = j * bk, b = imin(nc, a + bk);
      quantize_run<In>(row, orow, a, b, mult[j], finite[j] != 0);
    }
  }
}

struct F32Out {
  using T = float;
  static inline float store(float x) { return x; }
};
struct BF16Out {
  using T = uint16_t;
  static inline uint16_t store(float x) { return f32_to_bf16_rne(x); }
};
struct F16Out {
  using T = uint16_t;
  static inline uint16_t store(float x) { return f32_to_f16_rne(x); }
};

template <typename Out>
void dequantize_row(const uint8_t* __restrict q, const float* __restrict srow, int64_t K, int64_t bk,
                    typename Out::T* __restrict out) {
  const int64_t nbk = (K + bk - 1) / bk;
  for (int64_t bj = 0; bj < nbk; ++bj) {
    const int64_t a = bj * bk, b = imin(K, a + bk);
    const float s = srow[bj];
    for (int64_t c = a; c < b; ++c) out[c] = Out::store(fmul_rn(fp8e4m3_to_f32(q[c]), s));
  }
}

// =================================================================================================
// Chain verification: residual sampling (the one full-vocabulary pass per row), argmax, exp.
// =================================================================================================
constexpr int64_t kC = kSampleChunk;

enum class QMode { kNone, kDense, kMapped, kPoint };

template <QMode M>
inline float q_at(const QSource& s, int64_t t) {
  if constexpr (M == QMode::kNone) {
    return 0.0f;
  } else if constexpr (M == QMode::kDense) {
    return spec_clean_q(s.q[t]);
  } else if constexpr (M == QMode::kMapped) {
    const int32_t d = s.t2d[t];
    const float v = s.q[d < 0 ? 0 : d];  // unconditional load keeps the loop vectorisable
    return d < 0 ? 0.0f : spec_clean_q(v);
  } else {
    return t == s.x ? 1.0f : 0.0f;
  }
}

// r[t - t0] = max(0, p(t) - q(t)) in float64 and pt[t - t0] = p(t) for t in [t0, t1).
template <QMode M>
void residual_tile(const float* __restrict lp, const QSource& s, int64_t t0, int64_t t1, double* __restrict r,
                   float* __restrict pt) {
  // Two simple loops: GCC vectorises each (one fused loop with two stores lost that for point masses).
  for (int64_t t = t0; t < t1; ++t) pt[t - t0] = spec_expf(lp[t]);
  for (int64_t t = t0; t < t1; ++t) r[t - t0] = spec_residual(pt[t - t0], q_at<M>(s, t));
}

// Mass of one chunk of p (at most kC values): eight float64 lanes, lane l summing the values at
// l, l+8, ... in order, combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) (ms_math_reference.
// logprob_mass). Lane-wise so the compiler vectorises it: the input check costs little next to the draw.
inline double chunk_mass(const float* __restrict p, int64_t n) {
  double l[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) l[j] = dadd_rn(l[j], static_cast<double>(p[i + j]));
  }
  for (int j = 0; i + j < n; ++j) l[j] = dadd_rn(l[j], static_cast<double>(p[i + j]));
  return dadd_rn(dadd_rn(dadd_rn(l[0], l[1]), dadd_rn(l[2], l[3])), dadd_rn(dadd_rn(l[4], l[5]), dadd_rn(l[6], l[7])));
}

// Inverse-CDF draw from the (unnormalised) residual, float64 sums in the fixed chunked order of
// megatron_spec/ops/verify_reference.py. Returns -1 when the residual has no mass. The same pass sums
// p itself into *mass, in the lane order of chunk_mass (the input check, ms_math_reference.logprob_mass).
template <QMode M>
int64_t sample_residual(const float* __restrict lp, const QSource& s, int64_t V, double u, double* __restrict S,
                        double* __restrict rbuf, float* __restrict pbuf, double* __restrict mass) {
  const int64_t nC = (V + kC - 1) / kC;
  double m = 0.0;
  // Chunk sums: each chunk summed sequentially from 0.0 in token order.
  for (int64_t t0 = 0; t0 < V; t0 += kTileChunks * kC) {
    const int64_t t1 = imin(V, t0 + kTileChunks * kC);
    residual_tile<M>(lp, s, t0, t1, rbuf, pbuf);
    const int64_t c0 = t0 / kC;
    if (t1 - t0 == kTileChunks * kC) {
      double acc[kTileChunks] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      for (int64_t i = 0; i < kC; ++i) {
        for (int64_t g = 0; g < kTileChunks; ++g) acc[g] = dadd_rn(acc[g], rbuf[g * kC + i]);
      }
      for (int64_t g = 0; g < kTileChunks; ++g) {
        S[c0 + g] = acc[g];
        m = dadd_rn(m, chunk_mass(pbuf + g * kC, kC));
      }
    } else {
      for (int64_t a = 0; a < t1 - t0; a += kC) {
        const int64_t b = imin(t1 - t0, a + kC);
        double acc = 0.0;
        for (int64_t i = a; i < b; ++i) acc = dadd_rn(acc, rbuf[i]);
        S[c0 + a / kC] = acc;
        m = dadd_rn(m, chunk_mass(pbuf + a, b - a));
      }
    }
  }
  *mass = m;
  // Sequential prefix over chunk sums, in place.
  double P = 0.0;
  for (int64_t c = 0; c < nC; ++c) {
    P = dadd_rn(P, S[c]);
    S[c] = P;
  }
  const double total = P;
  if (!(total > 0.0)) return -1;
  const double theta = dmul_rn(u, total);
  int64_t cs = nC - 1;  // first chunk whose inclusive prefix exceeds theta (searchsorted, right)
  for (int64_t c = 0; c < nC; ++c) {
    if (S[c] > theta) {
      cs = c;
      break;
    }
  }
  const double theta_local = dsub_rn(theta, cs > 0 ? S[cs - 1] : 0.0);
  const int64_t a = cs * kC, b = imin(V, a + kC);
  residual_tile<M>(lp, s, a, b, rbuf, pbuf);
  double acc = 0.0;
  int64_t last_pos = -1;
  for (int64_t i = 0; i < b - a; ++i) {
    acc = dadd_rn(acc, rbuf[i]);
    if (acc > theta_local) return a + i;
    if (rbuf[i] > 0.0) last_pos = a + i;
  }
  // Rounding left theta_local at or above the chunk's own sum: take its last token with mass.
  return last_pos;
}

// First index of the maximum (lowest index on ties), like torch.argmax; -1 when x holds a NaN (the
// verifier refuses such rows: torch.argmax would pick the NaN, a max over ordered compares skips it).
int64_t argmax_first(const float* __restrict x, int64_t V) {
#if MS_ISA_LEVEL == 2
  if (V >= 16) {
    __m512 vm = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    int64_t t = 0;
    for (; t + 16 <= V; t += 16) {
      const __m512 v = _mm512_loadu_ps(x + t);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vm = _mm512_max_ps(vm, v);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, vm);
    float m = lanes[0];
    for (int l = 1; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
    for (; t < V; ++t) {
      if (x[t] != x[t]) nan = 1;
      m = x[t] > m ? x[t] : m;
    }
    if (nan) return -1;
    const __m512 vmv = _mm512_set1_ps(m);
    for (t = 0; t + 16 <= V; t += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + t), vmv, _CMP_EQ_OQ);
      if (eq) return t + __builtin_ctz(static_cast<unsigned>(eq));
    }
    for (; t < V; ++t)
      if (x[t] == m) return t;
    return 0;  // all NaN: undefined input, keep a valid id
  }
#elif MS_ISA_LEVEL == 1
  if (V >= 8) {
    __m256 vm = _mm256_set1_ps(-__builtin_inff());
    __m256 vnan = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= V; t += 8) {
      const __m256 v = _mm256_loadu_ps(x + t);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vm = _mm256_max_ps(vm, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    float m = lanes[0];
    for (int l = 1; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    bool nan = _mm256_movemask_ps(vnan) != 0;
    for (; t < V; ++t) {
      if (x[t] != x[t]) nan = true;
      m = x[t] > m ? x[t] : m;
    }
    if (nan) return -1;
    const __m256 vmv = _mm256_set1_ps(m);
    for (t = 0; t + 8 <= V; t += 8) {
      const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + t), vmv, _CMP_EQ_OQ));
      if (eq) return t + __builtin_ctz(static_cast<unsigned>(eq));
    }
    for (; t < V; ++t)
      if (x[t] == m) return t;
    return 0;  // all NaN: undefined input, keep a valid id
  }
#endif
  int64_t best = 0;
  float bv = x[0];
  bool nan = x[0] != x[0];
  for (int64_t t = 1; t < V; ++t) {
    nan = nan || x[t] != x[t];
    if (x[t] > bv) {
      bv = x[t];
      best = t;
    }
  }
  return nan ? -1 : best;
}

void spec_exp_n(const float* __restrict x, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = spec_expf(x[i]);
}

// The fingerprint's sums over n bit patterns read as signed integers: out[0] += sum(b), out[1] += sum(b * b),
// mod 2**64. A square of 8 or 16 bits fits 32 (it is at most 2**30), one of 32 bits 64 (at most 2**62): the
// products are exact in those widths and only the sums wrap, so every variant gives the reference's bits.
#if MS_ISA_LEVEL >= 1
// The fingerprint's sums of 32-bit patterns on AVX2, 8 a step with no lane-crossing shuffle: squares of the even and
// odd words by vpmuldq (the low 32 bits of a 64-bit lane, signed), sums of their unsigned values in 64-bit lanes,
// minus 2**32 for every negative word (counted in 32-bit lanes: exact below 2**35 words). GCC's own vectorisation
// sign-extended through three shuffles a step and ran at 1.5 words a cycle (2-core AVX2 EPYC), below what one core
// reads from memory: a sync's pack and its sums, or the engine's re-pack and its checksum, waited on the sums.
struct Sums32 {
  __m256i even, odd, neg, sq_even, sq_odd;

  static constexpr int64_t kWords = 8;  // a step's words (bits_sums_i32_simd)

  // a constructor of its own: an implicit one is compiled outside the target region and cannot inline the intrinsic
  inline Sums32() : even(_mm256_setzero_si256()), odd(even), neg(even), sq_even(even), sq_odd(even) {}

  static inline __m256i load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline void stream(int32_t* p, __m256i x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x); }

  inline void add(__m256i x) {
    const __m256i hi = _mm256_srli_epi64(x, 32);
    even = _mm256_add_epi64(even, _mm256_and_si256(x, _mm256_set1_epi64x(0xFFFFFFFFll)));
    odd = _mm256_add_epi64(odd, hi);
    neg = _mm256_add_epi32(neg, _mm256_srli_epi32(x, 31));
    sq_even = _mm256_add_epi64(sq_even, _mm256_mul_epi32(x, x));
    sq_odd = _mm256_add_epi64(sq_odd, _mm256_mul_epi32(hi, hi));
  }

  // out[0] += sum, out[1] += sum of squares (mod 2**64)
  inline void finish(uint64_t* out) const {
    alignas(32) uint64_t l1[4], l2[4];
    alignas(32) uint32_t ln[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(l1), _mm256_add_epi64(even, odd));
    _mm256_store_si256(reinterpret_cast<__m256i*>(l2), _mm256_add_epi64(sq_even, sq_odd));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ln), neg);
    uint64_t s1 = 0, s2 = 0, negatives = 0;
    for (int k = 0; k < 4; ++k) {
      s1 += l1[k];
      s2 += l2[k];
    }
    for (int k = 0; k < 8; ++k) negatives += ln[k];
    out[0] += s1 - (negatives << 32);
    out[1] += s2;
  }
};

inline void add_word_sums(int32_t x, uint64_t* out) {
  const int64_t v = x;
  out[0] += static_cast<uint64_t>(v);
  out[1] += static_cast<uint64_t>(v * v);
}
#endif

#if MS_ISA_LEVEL >= 2
// Sums32's sums 16 words a step (AVX-512F: vpmuldq on zmm). With the words of a whole cache line in one register,
// the 32-bit lanes' count of negative words is exact below 2**36 words. Not two Sums32 on the register's halves: the
// pack with its sums ran at 4.0 GB/s that way against 6.6 (one core of a 2-core AMX Xeon, alternated).
struct Sums512 {
  __m512i even, odd, neg, sq_even, sq_odd;
  static constexpr int64_t kWords = 16;

  inline Sums512() : even(_mm512_setzero_si512()), odd(even), neg(even), sq_even(even), sq_odd(even) {}

  static inline __m512i load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static inline void stream(int32_t* p, __m512i x) { _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x); }

  inline void add(__m512i x) {
    const __m512i hi = _mm512_srli_epi64(x, 32);
    even = _mm512_add_epi64(even, _mm512_and_si512(x, _mm512_set1_epi64(0xFFFFFFFFll)));
    odd = _mm512_add_epi64(odd, hi);
    neg = _mm512_add_epi32(neg, _mm512_srli_epi32(x, 31));
    sq_even = _mm512_add_epi64(sq_even, _mm512_mul_epi32(x, x));
    sq_odd = _mm512_add_epi64(sq_odd, _mm512_mul_epi32(hi, hi));
  }

  inline void finish(uint64_t* out) const {
    alignas(64) uint64_t l1[8], l2[8];
    alignas(64) uint32_t ln[16];
    _mm512_store_si512(l1, _mm512_add_epi64(even, odd));
    _mm512_store_si512(l2, _mm512_add_epi64(sq_even, sq_odd));
    _mm512_store_si512(ln, neg);
    uint64_t s1 = 0, s2 = 0, negatives = 0;
    for (int k = 0; k < 8; ++k) {
      s1 += l1[k];
      s2 += l2[k];
    }
    for (int k = 0; k < 16; ++k) negatives += ln[k];
    out[0] += s1 - (negatives << 32);
    out[1] += s2;
  }
};

// 16 rows x 16 words of a panel (one cache line a row) into 16 columns of it: rows interleaved by pairs and
// quadruples within 128-bit lanes, then the lanes gathered; bit moves only. Column j of the block lands in out[j].
inline void transpose16x16_u32(const __m512i* r, __m512i* out) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + m], lane L: word 4L + m of rows 4k .. 4k + 3
    b[4 * k + 0] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // column 4L + m: lane L of b[m], b[4 + m], b[8 + m], b[12 + m]
    const __m512i c0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44), c1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
    out[m] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    out[8 + m] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}
#endif

#if MS_ISA_LEVEL >= 1
// The sums of n 32-bit words a vector at a time (Acc: Sums32 on AVX2, Sums512 on AVX-512, whose loop GCC vectorised
// worse than the AVX2 one: 5.9 against 6.6 GB/s on one core of a 2-core AMX Xeon). Copying, the stores stream past
// the caches (a sync's bucket or parameters are read next by another core, or after the whole sync): no read of each
// destination line before it is written, a third of the memory traffic; the words before the first vector boundary
// of dst are copied one by one.
template <typename Acc, bool Copy>
inline void bits_sums_i32_simd(const int32_t* __restrict b, int32_t* __restrict dst, int64_t n, uint64_t* out) {
  constexpr int64_t W = Acc::kWords;
  Acc acc;
  int64_t i = 0;
  if constexpr (Copy) {
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & (4 * W - 1)) != 0; ++i) {
      dst[i] = b[i];
      add_word_sums(b[i], out);
    }
  }
  for (; i + W <= n; i += W) {
    const auto x = Acc::load(b + i);
    if constexpr (Copy) Acc::stream(dst + i, x);
    acc.add(x);
  }
  if constexpr (Copy) _mm_sfence();
  acc.finish(out);
  for (; i < n; ++i) {
    if constexpr (Copy) dst[i] = b[i];
    add_word_sums(b[i], out);
  }
}
#endif

template <typename T, bool Copy>
inline void bits_sums_impl(const T* __restrict b, T* __restrict dst, int64_t n, uint64_t* out) {
#if MS_ISA_LEVEL >= 1
  if constexpr (sizeof(T) == 4) {
#if MS_ISA_LEVEL >= 2
    using Acc = Sums512;
#else
    using Acc = Sums32;
#endif
    bits_sums_i32_simd<Acc, Copy>(reinterpret_cast<const int32_t*>(b), reinterpret_cast<int32_t*>(dst), n, out);
    return;
  }
#endif
  uint64_t s1 = 0, s2 = 0;
  if constexpr (sizeof(T) <= 2) {
    for (int64_t i = 0; i < n; ++i) {
      const T x = b[i];
      if constexpr (Copy) dst[i] = x;
      const int32_t v = x;
      s1 += static_cast<uint64_t>(static_cast<int64_t>(v));
      s2 += static_cast<uint32_t>(v * v);
    }
  } else if constexpr (sizeof(T) == 4) {
    for (int64_t i = 0; i < n; ++i) {
      const T x = b[i];
      if constexpr (Copy) dst[i] = x;
      const int64_t v = x;
      s1 += static_cast<uint64_t>(v);
      s2 += static_cast<uint64_t>(v * v);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T x = b[i];
      if constexpr (Copy) dst[i] = x;
      const uint64_t v = static_cast<uint64_t>(x);
      s1 += v;
      s2 += v * v;
    }
  }
  out[0] += s1;
  out[1] += s2;
}

template <typename T>
void bits_sums(const T* __restrict b, int64_t n, uint64_t* out) {
  bits_sums_impl<T, false>(b, nullptr, n, out);
}

template <typename T>
void bits_sums_copy(const T* __restrict b, T* __restrict dst, int64_t n, uint64_t* out) {
  bits_sums_impl<T, true>(b, dst, n, out);
}

// pack_panels16_sums_u32 (kernels.h): panel by panel. With AVX-512 and a panel on a 64-byte boundary, 16 rows x 16
// words at a time (transpose16x16_u32) stored as whole cache lines; then, with AVX2, a full panel goes 4 rows x 4 words at a time through
// SSE's 4 x 4 transpose (bit moves only) and its words are summed from the same registers, so the weights are read
// once for both; the scalar loop serves a last, partial panel and the columns past a multiple of 4. Without, the
// panel is transposed by the scalar loop and its rows summed again from cache.
void pack_panels16_sums_u32(const uint32_t* w, int64_t N, int64_t C, uint32_t* out, uint64_t* out_sums) {
  constexpr int64_t P = 16;
  uint64_t sums[2] = {0, 0};
  for (int64_t p = 0; p * P < N; ++p) {
    const uint32_t* src = w + p * P * C;
    uint32_t* dst = out + p * C * P;
    const int64_t rows = imin(P, N - p * P);
    int64_t c = 0;
#if MS_ISA_LEVEL >= 1
    if (rows == P) {
      Sums32 acc;
      const bool aligned = (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
#if MS_ISA_LEVEL >= 2
      // 16 columns at a time: a cache line of each row in, a whole line of the panel out per column
      if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
        Sums512 acc16;
        for (; c + 16 <= C; c += 16) {
          __m512i r[16], t[16];
          for (int64_t j = 0; j < P; ++j) {
            r[j] = _mm512_loadu_si512(src + j * C + c);
            acc16.add(r[j]);
          }
          transpose16x16_u32(r, t);
          for (int64_t j = 0; j < 16; ++j) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + (c + j) * P), t[j]);
        }
        acc16.finish(sums);
      }
#endif
      for (; c + 4 <= C; c += 4)
        for (int64_t j = 0; j < P; j += 4) {
          const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 0) * C + c));
          const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 1) * C + c));
          const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 2) * C + c));
          const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 3) * C + c));
          acc.add(_mm256_set_m128i(r1, r0));
          acc.add(_mm256_set_m128i(r3, r2));
          __m128 f0 = _mm_castsi128_ps(r0), f1 = _mm_castsi128_ps(r1), f2 = _mm_castsi128_ps(r2),
                 f3 = _mm_castsi128_ps(r3);
          _MM_TRANSPOSE4_PS(f0, f1, f2, f3);
          if (aligned) {
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + (c + 0) * P + j), _mm_castps_si128(f0));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + (c + 1) * P + j), _mm_castps_si128(f1));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + (c + 2) * P + j), _mm_castps_si128(f2));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + (c + 3) * P + j), _mm_castps_si128(f3));
          } else {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c + 0) * P + j), _mm_castps_si128(f0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c + 1) * P + j), _mm_castps_si128(f1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c + 2) * P + j), _mm_castps_si128(f2));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c + 3) * P + j), _mm_castps_si128(f3));
          }
        }
      acc.finish(sums);
      for (int64_t cc = c; cc < C; ++cc)
        for (int64_t j = 0; j < P; ++j) {
          dst[cc * P + j] = src[j * C + cc];
          add_word_sums(static_cast<int32_t>(src[j * C + cc]), sums);
        }
      continue;
    }
#endif
    if (rows < P)
      for (int64_t i = 0; i < C * P; ++i) dst[i] = 0;
    for (; c < C; ++c)
      for (int64_t j = 0; j < rows; ++j) dst[c * P + j] = src[j * C + c];
    bits_sums_impl<int32_t, false>(reinterpret_cast<const int32_t*>(src), nullptr, rows * C, sums);
  }
#if MS_ISA_LEVEL >= 1
  _mm_sfence();  // the streaming stores reach memory before the panels are read (by any thread)
#endif
  out_sums[0] += sums[0];
  out_sums[1] += sums[1];
}

}  // namespace MS_CPU_NS

extern const KernelTable MS_CPU_TABLE;
const KernelTable MS_CPU_TABLE = {
    MS_CPU_NAME,
    &MS_CPU_NS::quantize_unit<MS_CPU_NS::F32In>,
    &MS_CPU_NS::quantize_unit<MS_CPU_NS::BF16In>,
    &MS_CPU_NS::quantize_unit<MS_CPU_NS::F16In>,
    &MS_CPU_NS::dequantize_row<MS_CPU_NS::F32Out>,
    &MS_CPU_NS::dequantize_row<MS_CPU_NS::BF16Out>,
    &MS_CPU_NS::dequantize_row<MS_CPU_NS::F16Out>,
    &MS_CPU_NS::sample_residual<MS_CPU_NS::QMode::kNone>,
    &MS_CPU_NS::sample_residual<MS_CPU_NS::QMode::kDense>,
    &MS_CPU_NS::sample_residual<MS_CPU_NS::QMode::kMapped>,
    &MS_CPU_NS::sample_residual<MS_CPU_NS::QMode::kPoint>,
    &MS_CPU_NS::argmax_first,
    &MS_CPU_NS::spec_exp_n,
    &MS_CPU_NS::bits_sums<int8_t>,
    &MS_CPU_NS::bits_sums<int16_t>,
    &MS_CPU_NS::bits_sums<int32_t>,
    &MS_CPU_NS::bits_sums<int64_t>,
    &MS_CPU_NS::bits_sums_copy<int8_t>,
    &MS_CPU_NS::bits_sums_copy<int16_t>,
    &MS_CPU_NS::bits_sums_copy<int32_t>,
    &MS_CPU_NS::bits_sums_copy<int64_t>,
    &MS_CPU_NS::pack_panels16_sums_u32,
};

}  // namespace cpu
}  // namespace megatron_spec
