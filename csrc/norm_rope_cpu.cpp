// CPU kernels of the engine's fp32 RMSNorm and rotate-half RoPE, each one pass over its input.
//
// Why: torch 2.13's CPU rms_norm is a composite of five ops (pow, mean, add, rsqrt, two muls), so a
// decode row of SmolLM2 (576 features) costs ~23 us where reading it costs well under one, and a
// 1024-row prefill 3.1 ms (layer_norm, one fused kernel, takes 0.17 ms for the same shape); the
// rotation (chunk, neg, cat, two muls, add) ~30-45 us a layer at decode sizes. Over SmolLM2's 61 norms
// and 30 rotations a decode step spent ~4 of its ~30 ms there (benchmarks/profile_engine_step.py).
//
// rms_norm_f32(x [..., H], w [H], eps) -> y, x's shape, contiguous:
//   y = (x * inv) * w with inv = 1 / sqrt(sum(x^2) / H + eps), per row of H.
// transformers' LlamaRMSNorm in fp32 (weight * (x * rsqrt(mean + eps))): the same two rounded
// products; the sum of squares is accumulated in another order (8 lanes x 4 chains, FMA under AVX2),
// so results agree to fp32 rounding, not bit for bit. x may be any strided view whose last dimension
// is contiguous (the per-head q/k norms of Qwen3 read a split of the qkv projection in place).
//
// rope_f32(x [B, n, T, d], cos [B, 1, T, d], sin [B, 1, T, d]) -> [B, n, T, d] contiguous:
//   out[j] = x[j] * cos[j] + r[j] * sin[j], r = cat(-x[d/2:], x[:d/2]) (rotate-half; HF, Megatron).
// Products and sum rounded one at a time as torch's eager arithmetic does them (no FMA): the same
// bits as `x * cos + cat([-x2, x1], -1) * sin`. x may be any strided view with contiguous d (the
// engine rotates the transposed query/key part of the qkv projection in place); the tables likewise.
//
// rms_norm_bf16 / rope_bf16: the same over bf16 tensors (the bf16 engine's), each rounding where torch's
// bf16 eager arithmetic rounds (round to nearest even, as c10::BFloat16): the norm is transformers'
// LlamaRMSNorm in bf16, w * bf16(x_f32 * inv) with inv from the fp32 sum of squares (one bf16 rounding
// of the normalised value, one of its product with the weight; agrees with torch to bf16 rounding, the
// sum accumulated in another order); the rotation rounds each product and the sum to bf16, the bits of
// `x * cos + cat([-x2, x1], -1) * sin` over bf16 tensors. Measured on a 2-core Zen 4 in the bf16 engine:
// torch's composite norm took 2.0 ms of a 21 ms batch-1 decode of SmolLM2, the rotation 0.7 ms.
//
// Threads split rows (or (b, head) pairs) only where there is enough work to pay for waking them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_NORM_X86 1
#endif

#include "cpu/bf16.h"
#include "cpu/kernels.h"

namespace megatron_spec {
namespace {

constexpr int64_t kGrainElems = 1 << 15;  // ~32k floats a task: below it one thread does the whole op

// ---- RMSNorm ------------------------------------------------------------------------------------
void rms_row_scalar(const float* x, const float* w, float* y, int64_t H, float eps) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * x[i + j];
  float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) {
    const float n = x[k] * inv;
    y[k] = n * w[k];
  }
}

#ifdef MS_NORM_X86
// 8 values (ld8) or one (val) as fp32, from float32 or bf16 bits (widening is exact)
__attribute__((target("avx2,fma"))) inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 ld8(const uint16_t* p) { return cpu::widen8_bf16(p); }
inline float val(float x) { return x; }
inline float val(uint16_t h) { return cpu::widen_bf16(h); }

// 1 / sqrt(mean(x^2) + eps) over a row of H: 8 lanes x 4 chains of fused multiply-adds, then across them
template <typename T>
__attribute__((target("avx2,fma"))) float inv_rms_avx2(const T* x, int64_t H, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    const __m256 x0 = ld8(x + i), x1 = ld8(x + i + 8), x2 = ld8(x + i + 16), x3 = ld8(x + i + 24);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
    a2 = _mm256_fmadd_ps(x2, x2, a2);
    a3 = _mm256_fmadd_ps(x3, x3, a3);
  }
  for (; i + 8 <= H; i += 8) {
    const __m256 x0 = ld8(x + i);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float ss = _mm_cvtss_f32(h);
  for (; i < H; ++i) ss += val(x[i]) * val(x[i]);
  return 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
}

__attribute__((target("avx2,fma"))) void rms_row_avx2(const float* x, const float* w, float* y, int64_t H,
                                                       float eps) {
  const float inv = inv_rms_avx2(x, H, eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 8 <= H; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv), _mm256_loadu_ps(w + k)));
  for (; k < H; ++k) {
    const float n = x[k] * inv;
    y[k] = n * w[k];
  }
}
#endif

// ---- bf16 -----------------------------------------------------------------------------------------
inline float bf_widen(uint16_t h) { return cpu::widen_bf16(h); }
inline uint16_t bf_round(float f) { return c10::BFloat16(f).x; }  // round to nearest even, NaN kept
inline float bf_rf(float f) { return bf_widen(bf_round(f)); }     // f rounded to bf16, as a float

void rms_row_bf16_scalar(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t H, float eps) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += bf_widen(x[i + j]) * bf_widen(x[i + j]);
  float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < H; ++i) ss += bf_widen(x[i]) * bf_widen(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) y[k] = bf_round(bf_widen(w[k]) * bf_rf(bf_widen(x[k]) * inv));
}

void rope_vec_bf16_scalar(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float r = j < h ? -bf_widen(x[j + h]) : bf_widen(x[j - h]);
    o[j] = bf_round(bf_rf(bf_widen(x[j]) * bf_widen(c[j])) + bf_rf(r * bf_widen(s[j])));
  }
}

#ifdef MS_NORM_X86
__attribute__((target("avx2,fma"))) inline __m256 bf_load8(const uint16_t* p) { return ld8(p); }  // widened, exact
// the bf16 bits of 8 floats (in the low 16 bits of each lane), rounded as c10::BFloat16 rounds
__attribute__((target("avx2,fma"))) inline __m256i bf_round8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}
__attribute__((target("avx2,fma"))) inline __m256 bf_rf8(__m256 v) {  // rounded to bf16, as floats
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf_round8(v), 16));
}
__attribute__((target("avx2,fma"))) inline void bf_store8(uint16_t* p, __m256 v) {
  const __m256i r = bf_round8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

__attribute__((target("avx2,fma"))) void rms_row_bf16_avx2(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                                            int64_t H, float eps) {
  const float inv = inv_rms_avx2(x, H, eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 8 <= H; k += 8)
    bf_store8(y + k, _mm256_mul_ps(bf_load8(w + k), bf_rf8(_mm256_mul_ps(bf_load8(x + k), vinv))));
  for (; k < H; ++k) y[k] = bf_round(bf_widen(w[k]) * bf_rf(bf_widen(x[k]) * inv));
}

__attribute__((target("avx2,fma"))) void rope_vec_bf16_avx2(const uint16_t* x, const uint16_t* c, const uint16_t* s,
                                                             uint16_t* o, int64_t d) {
  const int64_t h = d / 2;
  if (h % 8 != 0) return rope_vec_bf16_scalar(x, c, s, o, d);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 lo = bf_load8(x + j), hi = bf_load8(x + j + h);
    const __m256 a0 = bf_rf8(_mm256_mul_ps(lo, bf_load8(c + j)));
    const __m256 b0 = bf_rf8(_mm256_mul_ps(_mm256_xor_ps(hi, sign), bf_load8(s + j)));
    bf_store8(o + j, _mm256_add_ps(a0, b0));
    const __m256 a1 = bf_rf8(_mm256_mul_ps(hi, bf_load8(c + j + h)));
    const __m256 b1 = bf_rf8(_mm256_mul_ps(lo, bf_load8(s + j + h)));
    bf_store8(o + j + h, _mm256_add_ps(a1, b1));
  }
}
#endif

using RmsRowFn = void (*)(const float*, const float*, float*, int64_t, float);

RmsRowFn rms_row_fn() {
#ifdef MS_NORM_X86
  if (cpu::avx2_fma_active()) return rms_row_avx2;
#endif
  return rms_row_scalar;
}

// Element offset of row r of x viewed as [R, H] (the leading dims in row-major order, any strides).
struct RowIndex {
  std::vector<int64_t> sizes, strides;  // leading dims only
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

using RmsRowBf16Fn = void (*)(const uint16_t*, const uint16_t*, uint16_t*, int64_t, float);

RmsRowBf16Fn rms_row_bf16_fn() {
#ifdef MS_NORM_X86
  if (cpu::avx2_fma_active()) return rms_row_bf16_avx2;
#endif
  return rms_row_bf16_scalar;
}

// The element type's pointer into a tensor of float32 (float) or bfloat16 (uint16_t, its bits).
template <typename T>
T* elems(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}
template <typename T>
constexpr const char* dtype_word() { return std::is_same_v<T, float> ? "float32" : "bfloat16"; }

template <typename T, typename RowFn>
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps, const char* name, RowFn row) {
  const at::ScalarType st = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == st && x.device().is_cpu() && x.dim() >= 1,
              name, ": expects a ", dtype_word<T>(), " CPU input [..., H], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == st && w.device().is_cpu(),
              name, ": the weight must be a ", dtype_word<T>(), " CPU vector, got ", w.sizes(), " ", w.scalar_type());
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.size(0) == H, name, ": input has ", H, " features, the weight ", w.size(0));
  TORCH_CHECK(eps >= 0 && std::isfinite(eps), name, ": eps must be finite and >= 0, got ", eps);
  const at::Tensor xs = (H > 1 && x.stride(-1) != 1) ? x.contiguous() : x;
  const auto wc = w.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  const int64_t R = H == 0 ? 0 : x.numel() / H;
  if (R == 0 || H == 0) return y;
  RowIndex idx;
  for (int64_t d = 0; d + 1 < xs.dim(); ++d) {
    idx.sizes.push_back(xs.size(d));
    idx.strides.push_back(xs.stride(d));
  }
  const T* xp = elems<T>(xs);
  const T* wp = elems<T>(wc);
  T* yp = elems<T>(y);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, std::max<int64_t>(1, kGrainElems / H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(xp + idx.offset(r), wp, yp + r * H, H, e);
  });
  return y;
}

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_cpu<float>(x, w, eps, "rms_norm_f32", rms_row_fn());
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_cpu<uint16_t>(x, w, eps, "rms_norm_bf16", rms_row_bf16_fn());
}

// ---- Rotate-half RoPE ---------------------------------------------------------------------------
// One (b, head, t) vector of d: out = x * c + r * s with r = cat(-x[h:], x[:h]), h = d / 2.
void rope_vec_scalar(const float* x, const float* c, const float* s, float* o, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j] * c[j], b = (-x[j + h]) * s[j];
    o[j] = a + b;
  }
  for (int64_t j = h; j < d; ++j) {
    const float a = x[j] * c[j], b = x[j - h] * s[j];
    o[j] = a + b;
  }
}

#ifdef MS_NORM_X86
__attribute__((target("avx2,fma"))) void rope_vec_avx2(const float* x, const float* c, const float* s, float* o,
                                                        int64_t d) {
  const int64_t h = d / 2;
  if (h % 8 != 0) return rope_vec_scalar(x, c, s, o, d);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + j + h);
    // separate multiplies and add (no FMA): the bits of torch's x * cos + rotated * sin
    const __m256 a0 = _mm256_mul_ps(lo, _mm256_loadu_ps(c + j));
    const __m256 b0 = _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(s + j));
    _mm256_storeu_ps(o + j, _mm256_add_ps(a0, b0));
    const __m256 a1 = _mm256_mul_ps(hi, _mm256_loadu_ps(c + j + h));
    const __m256 b1 = _mm256_mul_ps(lo, _mm256_loadu_ps(s + j + h));
    _mm256_storeu_ps(o + j + h, _mm256_add_ps(a1, b1));
  }
}
#endif

using RopeVecFn = void (*)(const float*, const float*, const float*, float*, int64_t);

RopeVecFn rope_vec_fn() {
#ifdef MS_NORM_X86
  if (cpu::avx2_fma_active()) return rope_vec_avx2;
#endif
  return rope_vec_scalar;
}

using RopeVecBf16Fn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t);

RopeVecBf16Fn rope_vec_bf16_fn() {
#ifdef MS_NORM_X86
  if (cpu::avx2_fma_active()) return rope_vec_bf16_avx2;
#endif
  return rope_vec_bf16_scalar;
}

template <typename T, typename VecFn>
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* name, VecFn vec) {
  const at::ScalarType st = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == st && x.device().is_cpu(),
              name, ": expects a ", dtype_word<T>(), " CPU input [B, n, T, d], got ", x.sizes(), " ", x.scalar_type());
  const int64_t B = x.size(0), n = x.size(1), T_ = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, name, ": the head dimension must be even, got ", d);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == st && t->device().is_cpu(),
                name, ": the tables must be ", dtype_word<T>(), " CPU [B, 1, T, d], got ", t->sizes(), " ",
                t->scalar_type());
    TORCH_CHECK(t->size(0) == B && t->size(1) == 1 && t->size(2) == T_ && t->size(3) == d,
                name, ": tables of shape ", t->sizes(), " do not match the input ", x.sizes(),
                " (expected [", B, ", 1, ", T_, ", ", d, "])");
  }
  const at::Tensor xs = (d > 1 && x.stride(3) != 1) ? x.contiguous() : x;
  const at::Tensor cs = (d > 1 && cos.stride(3) != 1) ? cos.contiguous() : cos;
  const at::Tensor ss = (d > 1 && sin.stride(3) != 1) ? sin.contiguous() : sin;
  auto out = at::empty({B, n, T_, d}, x.options());
  if (out.numel() == 0) return out;
  const T* xp = elems<T>(xs);
  const T* cp = elems<T>(cs);
  const T* sp = elems<T>(ss);
  T* op = elems<T>(out);
  const int64_t xb = xs.stride(0), xn = xs.stride(1), xt = xs.stride(2);
  const int64_t cb = cs.stride(0), ct = cs.stride(2), sb = ss.stride(0), st_ = ss.stride(2);
  // tasks: (b, head) pairs, T vectors of d each
  at::parallel_for(0, B * n, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, T_ * d)),
                   [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / n, hd = p % n;
      for (int64_t t = 0; t < T_; ++t)
        vec(xp + b * xb + hd * xn + t * xt, cp + b * cb + t * ct, sp + b * sb + t * st_, op + (p * T_ + t) * d, d);
    }
  });
  return out;
}

at::Tensor rope_f32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_cpu<float>(x, cos, sin, "rope_f32", rope_vec_fn());
}

at::Tensor rope_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_cpu<uint16_t>(x, cos, sin, "rope_bf16", rope_vec_bf16_fn());
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("rms_norm_f32", &megatron_spec::rms_norm_f32);
  m.impl("rope_f32", &megatron_spec::rope_f32);
  m.impl("rms_norm_bf16", &megatron_spec::rms_norm_bf16);
  m.impl("rope_bf16", &megatron_spec::rope_bf16);
}
