// CPU kernels of the engine's grouped-query attention at decode and verify sizes, fp32 and bf16:
//   out [b, nq, t, d] = softmax(q k^T * scale, masked) v, query head h reading KV head h / (nq / nkv).
//
// Why: a decode step of SmolLM2-135M at batch 16 spent ~0.42 ms a layer in torch's
// scaled_dot_product_attention (16 rows x 9 heads x 1 query over ~128 cached positions: a few MFLOP),
// and a batched verify (16 rows x 4 queries) ~0.86 ms in two matmuls and a softmax: 13-26 ms of a
// 30-layer forward, mostly per-call and per-head overhead. Here one task is one (row, KV head): its
// g * t queries (the query heads of the group times the row's positions) read that head's keys and
// values straight from the cache view (any row / head / position strides, contiguous d), in L1/L2.
//
// Arithmetic, per query: s_j = (q . k_j) * scale over the positions the mask allows, m = max_j s_j,
// p_j = exp(s_j - m) (spec_expf of ms_math.h, ~1 ulp), out = (sum_j p_j v_j) / (sum_j p_j). The dot
// products sum in 8 lanes then across them (AVX2 + FMA) or in order (the default variant): not the bits
// of torch's kernels, the same up to fp32 rounding; tests compare within a tolerance. A query whose
// mask allows no position gets zeros (torch gives NaN there; the engine never asks for one).
//
// attention_bf16 is the same kernel over bf16 q, k, v (the bf16 engine's cache): keys and values are
// widened to fp32 as they are loaded (exact), scores, softmax and the weighted sum stay fp32, and each
// output is rounded to bf16 once (round to nearest even). torch's bf16 path rounds the scores, the
// probabilities and the output to bf16 (two bf16 matmuls), or runs its flash kernel: the results agree to
// bf16 rounding, closer to the fp32 attention of the same inputs than torch's are. Measured on a 2-core
// Zen 4 (SmolLM2's 9/3 heads of 64, ~128 cached positions): the eager bf16 engine spent 3.9 ms of a 26 ms
// batch-1 decode and 12.5 of a 45 ms batch-16 decode in torch's attention (benchmarks/profile_engine_step.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_ATTN_X86 1
#endif

#include "cpu/bf16.h"
#include "cpu/kernels.h"
#include "ms_math.h"

namespace megatron_spec {
namespace {

// T: the element type of the keys and values (float, or uint16_t holding bf16 bits). The queries are
// fp32 here (a bf16 task widens its g * t queries into scratch first) and so is out (a bf16 task's
// outputs are rounded into the result afterwards).
template <typename T>
struct Task {
  const float* q;       // this row and KV head's first query head, position 0
  int64_t q_head, q_pos;  // strides of q between query heads and between positions
  const T* k;           // this row and KV head, position 0
  const T* v;
  int64_t k_pos, v_pos;   // strides between positions
  const bool* mask;     // this row's [t, L]
  float* out;           // this row and KV head's first query head in out [b, nq, t, d] (contiguous)
  int64_t g, t, L, d;
  float scale;
};

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return cpu::widen_bf16(x); }

// exp(s_j - m) in place over a row of scores (masked entries already -inf -> 0), returns the sum.
inline float exp_and_sum(float* s, int64_t L, float m) {
  for (int64_t j = 0; j < L; ++j) s[j] = s[j] == -std::numeric_limits<float>::infinity() ? 0.0f : spec_expf(s[j] - m);
  float sum = 0.0f;
  for (int64_t j = 0; j < L; ++j) sum += s[j];
  return sum;
}

template <typename T>
void attend_scalar(const Task<T>& a, float* s) {
  for (int64_t h = 0; h < a.g; ++h)
    for (int64_t p = 0; p < a.t; ++p) {
      const float* q = a.q + h * a.q_head + p * a.q_pos;
      const bool* mrow = a.mask + p * a.L;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < a.L; ++j) {
        if (!mrow[j]) {
          s[j] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const T* k = a.k + j * a.k_pos;
        float acc = 0.0f;
        for (int64_t c = 0; c < a.d; ++c) acc += q[c] * widen(k[c]);
        s[j] = acc * a.scale;
        m = std::max(m, s[j]);
      }
      float* o = a.out + (h * a.t + p) * a.d;
      std::fill(o, o + a.d, 0.0f);
      if (m == -std::numeric_limits<float>::infinity()) continue;  // nothing to attend: zeros
      const float inv = 1.0f / exp_and_sum(s, a.L, m);
      for (int64_t j = 0; j < a.L; ++j) {
        if (s[j] == 0.0f) continue;
        const T* v = a.v + j * a.v_pos;
        for (int64_t c = 0; c < a.d; ++c) o[c] += s[j] * widen(v[c]);
      }
      for (int64_t c = 0; c < a.d; ++c) o[c] *= inv;
    }
}

#ifdef MS_ATTN_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 x) {
  const __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) { return cpu::widen8_bf16(p); }

// s_j = (q . k_j) * scale for every position, 8 keys at a time (eight accumulators reduced together:
// no horizontal sum per key), then masked positions -> -inf; returns the largest score.
template <typename T>
__attribute__((target("avx2,fma"))) float scores_avx2(const Task<T>& a, const float* q, const bool* mrow, float* s) {
  const int64_t nv = a.d / 8;
  const __m256 scale = _mm256_set1_ps(a.scale);
  int64_t j0 = 0;
  for (; j0 + 8 <= a.L; j0 += 8) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    const T* k = a.k + j0 * a.k_pos;
    for (int64_t c = 0; c < nv; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qc, load8(k + r * a.k_pos + 8 * c), acc[r]);
    }
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                     _mm256_permute2f128_ps(h0123, h4567, 0x31));
    _mm256_storeu_ps(s + j0, _mm256_mul_ps(sum, scale));
  }
  for (; j0 < a.L; ++j0) {
    const T* k = a.k + j0 * a.k_pos;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(k + 8 * c), acc);
    s[j0] = hsum(acc) * a.scale;
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 mx = _mm256_set1_ps(ninf);
  int64_t j = 0;
  for (; j + 8 <= a.L; j += 8) {
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mrow + j));
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(m8), _mm256_setzero_si256()));
    const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(ninf), _mm256_loadu_ps(s + j), keep);
    _mm256_storeu_ps(s + j, v);
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = ninf;
  for (float x : lanes) m = std::max(m, x);
  for (; j < a.L; ++j) {
    if (!mrow[j]) s[j] = ninf;
    m = std::max(m, s[j]);
  }
  return m;
}

// spec_expf (ms_math.h) on 8 lanes, for arguments <= 88: the same reduction and polynomial, fused
// multiply-adds where spec_expf rounds twice (a result may differ from it in the last bit); below -86
// (and -inf) 0.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(0x1.715476p+0f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-0x1.bd0106p-13f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.63p-1f), xc));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(0x1.a0d2cep-13f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0x1.6e879cp-10f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0x1.11121p-7f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0x1.555382p-5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0x1.555554p-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0x1p-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-86.0f), _CMP_LT_OQ));
}

// p_j = exp(s_j - m) in place (-inf -> 0), returns sum_j p_j
__attribute__((target("avx2,fma"))) float exp_sum_avx2(float* s, int64_t L, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  float sum = hsum(acc);
  for (; j < L; ++j) {
    s[j] = spec_expf(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// o = inv * sum_j p_j v_j, the NV * 8 outputs held in registers
template <int NV, typename T>
__attribute__((target("avx2,fma"))) void weighted_values(const Task<T>& a, const float* p, float* o, float inv) {
  __m256 ov[NV];
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) ov[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.L; ++j) {
    if (p[j] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(p[j]);
    const T* v = a.v + j * a.v_pos;
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) ov[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), ov[c]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(ov[c], iv));
}

template <typename T>
using ValuesFn = void (*)(const Task<T>&, const float*, float*, float);
template <typename T, int... NV>
constexpr std::array<ValuesFn<T>, sizeof...(NV)> values_table(std::integer_sequence<int, NV...>) {
  return {&weighted_values<NV + 1, T>...};
}

// d a multiple of 8, at most 128
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Task<T>& a, float* s) {
  static constexpr auto table = values_table<T>(std::make_integer_sequence<int, 16>{});
  const ValuesFn<T> values = table[a.d / 8 - 1];
  for (int64_t h = 0; h < a.g; ++h)
    for (int64_t p = 0; p < a.t; ++p) {
      const float* q = a.q + h * a.q_head + p * a.q_pos;
      const float m = scores_avx2(a, q, a.mask + p * a.L, s);
      float* o = a.out + (h * a.t + p) * a.d;
      if (m == -std::numeric_limits<float>::infinity()) {
        std::fill(o, o + a.d, 0.0f);
        continue;
      }
      values(a, s, o, 1.0f / exp_sum_avx2(s, a.L, m));
    }
}
#endif

bool use_avx2(int64_t d) { return cpu::avx2_fma_active() && d % 8 == 0 && d <= 128; }

// The checks and the threading shared by attention_f32 and attention_bf16 (name: the op, for errors).
at::Tensor attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const at::Tensor& mask_in, double scale, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4 && mask_in.dim() == 4,
              name, ": expects q [b, nq, t, d], k and v [b, nkv, L, d], mask [b, 1, t, L]");
  for (const auto* x : {&q_in, &k_in, &v_in})
    TORCH_CHECK(x->scalar_type() == dtype && x->device().is_cpu(), name, ": expects ",
                dtype == at::kFloat ? "float32" : "bfloat16", " CPU tensors, got ", x->scalar_type(), " on ",
                x->device());
  TORCH_CHECK(mask_in.scalar_type() == at::kBool, name, ": the mask must be bool (True = attend)");
  const int64_t b = q_in.size(0), nq = q_in.size(1), t = q_in.size(2), d = q_in.size(3);
  const int64_t nkv = k_in.size(1), L = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == b && v_in.size(0) == b && v_in.size(1) == nkv && v_in.size(2) == L &&
                  k_in.size(3) == d && v_in.size(3) == d,
              name, ": k ", k_in.sizes(), " and v ", v_in.sizes(), " do not match q ", q_in.sizes());
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, name, ": ", nq, " query heads are not a multiple of ", nkv, " KV heads");
  TORCH_CHECK(mask_in.size(0) == b && mask_in.size(1) == 1 && mask_in.size(2) == t && mask_in.size(3) == L,
              name, ": mask ", mask_in.sizes(), " is not [b, 1, t, L] = [", b, ", 1, ", t, ", ", L, "]");
  // the last dimension must be contiguous; the cache views the engine passes already are
  auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  auto k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  auto v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  auto mask = mask_in.contiguous();
  auto out = at::empty({b, nq, t, d}, q.options());
  if (out.numel() == 0) return out;
  const int64_t g = nq / nkv;
  const bool avx2 = use_avx2(d);
  const bool* mp = mask.data_ptr<bool>();
  const float scl = static_cast<float>(scale);
  auto run = [&](auto* kp, auto* vp, auto&& task_io) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, b * nkv, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores(std::max<int64_t>(L, 1)), scratch;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / nkv, hk = i % nkv;
        Task<T> a{nullptr, 0, 0, kp + r * k.stride(0) + hk * k.stride(1), vp + r * v.stride(0) + hk * v.stride(1),
                  k.stride(2), v.stride(2), mp + r * t * L, nullptr, g, t, L, d, scl};
        task_io(a, r, hk, scratch, [&] {
#ifdef MS_ATTN_X86
          if (avx2) return attend_avx2(a, scores.data());
#endif
          attend_scalar(a, scores.data());
        });
      }
    });
  };
  if (dtype == at::kFloat) {
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    run(k.data_ptr<float>(), v.data_ptr<float>(), [&](Task<float>& a, int64_t r, int64_t hk, std::vector<float>&,
                                                      auto&& attend) {
      a.q = qp + r * q.stride(0) + hk * g * q.stride(1);
      a.q_head = q.stride(1);
      a.q_pos = q.stride(2);
      a.out = op + ((r * nq + hk * g) * t) * d;
      attend();
    });
  } else {
    // bf16: the task's g * t queries widened into scratch [g, t, d], its outputs computed there in fp32
    // (after the queries: q and out share the buffer), then rounded once into out
    const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    auto* op = out.data_ptr<at::BFloat16>();
    run(reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
        [&](Task<uint16_t>& a, int64_t r, int64_t hk, std::vector<float>& scratch, auto&& attend) {
          const int64_t n = g * t * d;
          scratch.resize(2 * n);
          float* qs = scratch.data();
          for (int64_t h = 0; h < g; ++h)
            for (int64_t p = 0; p < t; ++p) {
              const uint16_t* src = qp + r * q.stride(0) + (hk * g + h) * q.stride(1) + p * q.stride(2);
              float* dst = qs + (h * t + p) * d;
              for (int64_t c = 0; c < d; ++c) dst[c] = widen(src[c]);
            }
          a.q = qs;
          a.q_head = t * d;
          a.q_pos = d;
          a.out = qs + n;
          attend();
          at::BFloat16* o = op + ((r * nq + hk * g) * t) * d;
          for (int64_t e = 0; e < n; ++e) o[e] = at::BFloat16(a.out[e]);  // round to nearest even
        });
  }
  return out;
}

at::Tensor attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale) {
  return attention_cpu(q, k, v, mask, scale, at::kFloat, "attention_f32");
}

at::Tensor attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale) {
  return attention_cpu(q, k, v, mask, scale, at::kBFloat16, "attention_bf16");
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("attention_f32", &megatron_spec::attention_f32);
  m.impl("attention_bf16", &megatron_spec::attention_bf16);
}
