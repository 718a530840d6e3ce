// CPU kernel of the engine's fp32 grouped-query attention at decode and verify sizes:
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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_ATTN_X86 1
#endif

#include "cpu/kernels.h"
#include "ms_math.h"

namespace megatron_spec {
namespace {

struct Task {
  const float* q;       // this row and KV head's first query head, position 0
  int64_t q_head, q_pos;  // strides of q between query heads and between positions
  const float* k;       // this row and KV head, position 0
  const float* v;
  int64_t k_pos, v_pos;   // strides between positions
  const bool* mask;     // this row's [t, L]
  float* out;           // this row and KV head's first query head in out [b, nq, t, d] (contiguous)
  int64_t g, t, L, d;
  float scale;
};

// exp(s_j - m) in place over a row of scores (masked entries already -inf -> 0), returns the sum.
inline float exp_and_sum(float* s, int64_t L, float m) {
  for (int64_t j = 0; j < L; ++j) s[j] = s[j] == -std::numeric_limits<float>::infinity() ? 0.0f : spec_expf(s[j] - m);
  float sum = 0.0f;
  for (int64_t j = 0; j < L; ++j) sum += s[j];
  return sum;
}

void attend_scalar(const Task& a, float* s) {
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
        const float* k = a.k + j * a.k_pos;
        float acc = 0.0f;
        for (int64_t c = 0; c < a.d; ++c) acc += q[c] * k[c];
        s[j] = acc * a.scale;
        m = std::max(m, s[j]);
      }
      float* o = a.out + (h * a.t + p) * a.d;
      std::fill(o, o + a.d, 0.0f);
      if (m == -std::numeric_limits<float>::infinity()) continue;  // nothing to attend: zeros
      const float inv = 1.0f / exp_and_sum(s, a.L, m);
      for (int64_t j = 0; j < a.L; ++j) {
        if (s[j] == 0.0f) continue;
        const float* v = a.v + j * a.v_pos;
        for (int64_t c = 0; c < a.d; ++c) o[c] += s[j] * v[c];
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

// s_j = (q . k_j) * scale for every position, 8 keys at a time (eight accumulators reduced together:
// no horizontal sum per key), then masked positions -> -inf; returns the largest score.
__attribute__((target("avx2,fma"))) float scores_avx2(const Task& a, const float* q, const bool* mrow, float* s) {
  const int64_t nv = a.d / 8;
  const __m256 scale = _mm256_set1_ps(a.scale);
  int64_t j0 = 0;
  for (; j0 + 8 <= a.L; j0 += 8) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    const float* k = a.k + j0 * a.k_pos;
    for (int64_t c = 0; c < nv; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + r * a.k_pos + 8 * c), acc[r]);
    }
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                     _mm256_permute2f128_ps(h0123, h4567, 0x31));
    _mm256_storeu_ps(s + j0, _mm256_mul_ps(sum, scale));
  }
  for (; j0 < a.L; ++j0) {
    const float* k = a.k + j0 * a.k_pos;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
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
template <int NV>
__attribute__((target("avx2,fma"))) void weighted_values(const Task& a, const float* p, float* o, float inv) {
  __m256 ov[NV];
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) ov[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.L; ++j) {
    if (p[j] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* v = a.v + j * a.v_pos;
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) ov[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), ov[c]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(ov[c], iv));
}

using ValuesFn = void (*)(const Task&, const float*, float*, float);
template <int... NV>
constexpr std::array<ValuesFn, sizeof...(NV)> values_table(std::integer_sequence<int, NV...>) {
  return {&weighted_values<NV + 1>...};
}

// d a multiple of 8, at most 128
__attribute__((target("avx2,fma"))) void attend_avx2(const Task& a, float* s) {
  static constexpr auto table = values_table(std::make_integer_sequence<int, 16>{});
  const ValuesFn values = table[a.d / 8 - 1];
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

at::Tensor attention_f32(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4 && mask_in.dim() == 4,
              "attention_f32: expects q [b, nq, t, d], k and v [b, nkv, L, d], mask [b, 1, t, L]");
  for (const auto* x : {&q_in, &k_in, &v_in})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu(), "attention_f32: expects float32 CPU "
                "tensors, got ", x->scalar_type(), " on ", x->device());
  TORCH_CHECK(mask_in.scalar_type() == at::kBool, "attention_f32: the mask must be bool (True = attend)");
  const int64_t b = q_in.size(0), nq = q_in.size(1), t = q_in.size(2), d = q_in.size(3);
  const int64_t nkv = k_in.size(1), L = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == b && v_in.size(0) == b && v_in.size(1) == nkv && v_in.size(2) == L &&
                  k_in.size(3) == d && v_in.size(3) == d,
              "attention_f32: k ", k_in.sizes(), " and v ", v_in.sizes(), " do not match q ", q_in.sizes());
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "attention_f32: ", nq, " query heads are not a multiple of ", nkv,
              " KV heads");
  TORCH_CHECK(mask_in.size(0) == b && mask_in.size(1) == 1 && mask_in.size(2) == t && mask_in.size(3) == L,
              "attention_f32: mask ", mask_in.sizes(), " is not [b, 1, t, L] = [", b, ", 1, ", t, ", ", L, "]");
  // the last dimension must be contiguous; the cache views the engine passes already are
  auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  auto k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  auto v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  auto mask = mask_in.contiguous();
  auto out = at::empty({b, nq, t, d}, q.options());
  if (out.numel() == 0) return out;
  const int64_t g = nq / nkv;
  const bool avx2 = use_avx2(d);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * nkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(std::max<int64_t>(L, 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / nkv, hk = i % nkv;
      Task a{qp + r * q.stride(0) + hk * g * q.stride(1), q.stride(1), q.stride(2),
             kp + r * k.stride(0) + hk * k.stride(1), vp + r * v.stride(0) + hk * v.stride(1),
             k.stride(2), v.stride(2), mp + r * t * L, op + ((r * nq + hk * g) * t) * d,
             g, t, L, d, static_cast<float>(scale)};
#ifdef MS_ATTN_X86
      if (avx2) {
        attend_avx2(a, scores.data());
        continue;
      }
#endif
      attend_scalar(a, scores.data());
    }
  });
  return out;
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) { m.impl("attention_f32", &megatron_spec::attention_f32); }
