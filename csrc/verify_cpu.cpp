// CPU kernel for chain verification (speculative sampling) with pre-drawn uniforms.
//
// For each row b with k drafted tokens x_0..x_{k-1} (target ids; a negative id ends the chain):
//   sampled rows: accept x_i while u_accept[b,i] * q_i(x_i) < p_i(x_i)   (u < min(1, p/q));
//                 at the first rejection j emit a token from normalize(max(0, p_j - q_j)),
//                 after k acceptances (or at an empty draft slot) emit one from p_j itself;
//   greedy rows:  accept x_i while x_i == argmax p_i (lowest index on ties) and emit the argmax at
//                 the first mismatch, or the argmax of p_k (the bonus token).
// p = spec_expf(target_logprobs); q is the dense draft distribution, the draft distribution scattered
// through d2t (target_id = draft_id + d2t[draft_id], zero outside the draft vocabulary), or a point
// mass at x_i when no draft distribution is given (n-gram drafts).
//
// The residual / bonus token is drawn by inverse CDF with u_sample[b]; the float64 sums follow the
// fixed chunked order documented in megatron_spec/ops/verify_reference.py so this kernel, the CUDA
// kernel and the reference agree bit for bit. Only one position per row needs a full-vocabulary
// pass (the reference makes several); rows run in parallel with at::parallel_for (OpenMP).
//
// References: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (2023);
// Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (2023).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "ms_math.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on _mm512_undefined_*() (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace megatron_spec {
namespace {

constexpr int64_t kC = kSampleChunk;
constexpr int64_t kTileChunks = 8;  // chunk sums of 8 chunks run as 8 independent add chains

enum class QMode { kNone, kDense, kMapped, kPoint };

struct QSource {
  const float* q = nullptr;      // [Vd] draft probabilities at this position (dense / mapped)
  const int32_t* t2d = nullptr;  // [V] target id -> draft id or -1 (mapped)
  int64_t x = -1;                // the drafted token (point mass)
};

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

// r[t - t0] = max(0, p(t) - q(t)) in float64 for t in [t0, t1).
template <QMode M>
void residual_tile(const float* __restrict lp, const QSource& s, int64_t t0, int64_t t1,
                   double* __restrict r) {
  for (int64_t t = t0; t < t1; ++t) r[t - t0] = spec_residual(spec_expf(lp[t]), q_at<M>(s, t));
}

// Inverse-CDF draw from the (unnormalised) residual. Returns -1 when the residual has no mass.
template <QMode M>
int64_t sample_residual(const float* __restrict lp, const QSource& s, int64_t V, double u,
                        std::vector<double>& prefix, double* __restrict rbuf) {
  const int64_t nC = (V + kC - 1) / kC;
  prefix.resize(static_cast<size_t>(nC));
  double* __restrict S = prefix.data();
  // Chunk sums: each chunk summed sequentially from 0.0 in token order.
  for (int64_t t0 = 0; t0 < V; t0 += kTileChunks * kC) {
    const int64_t t1 = std::min(V, t0 + kTileChunks * kC);
    residual_tile<M>(lp, s, t0, t1, rbuf);
    const int64_t c0 = t0 / kC;
    if (t1 - t0 == kTileChunks * kC) {
      double acc[kTileChunks] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      for (int64_t i = 0; i < kC; ++i) {
        for (int64_t g = 0; g < kTileChunks; ++g) acc[g] = dadd_rn(acc[g], rbuf[g * kC + i]);
      }
      for (int64_t g = 0; g < kTileChunks; ++g) S[c0 + g] = acc[g];
    } else {
      for (int64_t a = 0; a < t1 - t0; a += kC) {
        const int64_t b = std::min(t1 - t0, a + kC);
        double acc = 0.0;
        for (int64_t i = a; i < b; ++i) acc = dadd_rn(acc, rbuf[i]);
        S[c0 + a / kC] = acc;
      }
    }
  }
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
  const int64_t a = cs * kC, b = std::min(V, a + kC);
  residual_tile<M>(lp, s, a, b, rbuf);
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

int64_t sample_position(QMode mode, const float* lp, const QSource& s, int64_t V, double u,
                        std::vector<double>& prefix, double* rbuf) {
  int64_t t = -1;
  switch (mode) {
    case QMode::kDense: t = sample_residual<QMode::kDense>(lp, s, V, u, prefix, rbuf); break;
    case QMode::kMapped: t = sample_residual<QMode::kMapped>(lp, s, V, u, prefix, rbuf); break;
    case QMode::kPoint: t = sample_residual<QMode::kPoint>(lp, s, V, u, prefix, rbuf); break;
    case QMode::kNone: break;
  }
  // No residual mass (p <= q everywhere, reachable through rounding) or no draft: sample p itself.
  if (t < 0) t = sample_residual<QMode::kNone>(lp, s, V, u, prefix, rbuf);
  return t;
}

// First index of the maximum (lowest index on ties), like torch.argmax for NaN-free input.
int64_t argmax_first(const float* __restrict x, int64_t V) {
#if defined(MS_HAVE_AVX512)
  if (V >= 16) {
    __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 16 <= V; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + t));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, vm);
    float m = lanes[0];
    for (int l = 1; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
    for (; t < V; ++t) m = x[t] > m ? x[t] : m;
    const __m512 vmv = _mm512_set1_ps(m);
    for (t = 0; t + 16 <= V; t += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + t), vmv, _CMP_EQ_OQ);
      if (eq) return t + __builtin_ctz(static_cast<unsigned>(eq));
    }
    for (; t < V; ++t)
      if (x[t] == m) return t;
    return 0;  // all NaN: undefined input, keep a valid id
  }
#endif
  int64_t best = 0;
  float bv = x[0];
  for (int64_t t = 1; t < V; ++t) {
    if (x[t] > bv) {
      bv = x[t];
      best = t;
    }
  }
  return best;
}

enum RowError : int8_t { kOk = 0, kNoMass = 1 };

std::tuple<at::Tensor, at::Tensor> verify_chain_cpu(const at::Tensor& target_logprobs,
                                                    const at::Tensor& draft_tokens,
                                                    const c10::optional<at::Tensor>& draft_probs,
                                                    const c10::optional<at::Tensor>& d2t,
                                                    const at::Tensor& greedy, const at::Tensor& u_accept,
                                                    const at::Tensor& u_sample) {
  TORCH_CHECK_VALUE(target_logprobs.dim() == 3 && target_logprobs.scalar_type() == at::kFloat,
                    "verify_chain: target_logprobs must be float32 [B, k+1, V], got ",
                    target_logprobs.scalar_type(), " of shape ", target_logprobs.sizes());
  const int64_t B = target_logprobs.size(0), K1 = target_logprobs.size(1), V = target_logprobs.size(2);
  TORCH_CHECK_VALUE(K1 >= 1, "verify_chain: target_logprobs needs k+1 >= 1 positions, got ", K1);
  const int64_t k = K1 - 1;
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(0) == B && draft_tokens.size(1) == k &&
                        draft_tokens.scalar_type() == at::kLong,
                    "verify_chain: draft_tokens must be int64 [", B, ", ", k, "], got ",
                    draft_tokens.scalar_type(), " of shape ", draft_tokens.sizes());
  TORCH_CHECK_VALUE(greedy.dim() == 1 && greedy.size(0) == B && greedy.scalar_type() == at::kBool,
                    "verify_chain: greedy must be bool [", B, "], got ", greedy.scalar_type(), " of shape ",
                    greedy.sizes());
  TORCH_CHECK_VALUE(u_accept.dim() == 2 && u_accept.size(0) == B && u_accept.size(1) == k &&
                        u_accept.scalar_type() == at::kDouble,
                    "verify_chain: u_accept must be float64 [", B, ", ", k, "], got ", u_accept.scalar_type(),
                    " of shape ", u_accept.sizes());
  TORCH_CHECK_VALUE(u_sample.dim() == 1 && u_sample.size(0) == B && u_sample.scalar_type() == at::kDouble,
                    "verify_chain: u_sample must be float64 [", B, "], got ", u_sample.scalar_type(),
                    " of shape ", u_sample.sizes());
  const bool has_q = draft_probs.has_value();
  const bool has_map = d2t.has_value();
  TORCH_CHECK_VALUE(!has_map || has_q, "verify_chain: d2t given without draft_probs");
  int64_t Vd = V;
  if (has_map) {
    TORCH_CHECK_VALUE(d2t->dim() == 1 && d2t->scalar_type() == at::kLong,
                      "verify_chain: d2t must be int64 [Vd], got ", d2t->scalar_type(), " of shape ",
                      d2t->sizes());
    Vd = d2t->size(0);
  }
  if (has_q) {
    const at::Tensor& q = *draft_probs;
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == B && q.size(1) == k && q.size(2) == Vd &&
                          q.scalar_type() == at::kFloat,
                      "verify_chain: draft_probs must be float32 [", B, ", ", k, ", ", Vd, "] (",
                      has_map ? "draft vocabulary of d2t" : "target vocabulary", "), got ", q.scalar_type(),
                      " of shape ", q.sizes());
  }
  at::Tensor tokens = at::full({B, K1}, -1, draft_tokens.options());
  at::Tensor num_accepted = at::zeros({B}, draft_tokens.options());
  if (B == 0) return {tokens, num_accepted};
  TORCH_CHECK_VALUE(V > 0, "verify_chain: empty vocabulary (V = 0) with ", B, " rows");

  const at::Tensor lp_c = target_logprobs.contiguous();
  const at::Tensor dt_c = draft_tokens.contiguous();
  const at::Tensor g_c = greedy.contiguous();
  const at::Tensor ua_c = u_accept.contiguous();
  const at::Tensor us_c = u_sample.contiguous();
  const at::Tensor q_c = has_q ? draft_probs->contiguous() : at::Tensor();
  const float* lp = lp_c.data_ptr<float>();
  const int64_t* dt = dt_c.data_ptr<int64_t>();
  const bool* gr = g_c.data_ptr<bool>();
  const double* ua = ua_c.data_ptr<double>();
  const double* us = us_c.data_ptr<double>();
  const float* qp = has_q ? q_c.data_ptr<float>() : nullptr;

  // Every non-negative draft id must be a target id, whether or not the chain reaches it.
  for (int64_t i = 0; i < B * k; ++i)
    TORCH_CHECK_INDEX(dt[i] < V, "verify_chain: draft_tokens[", i / k, ", ", i % k, "] = ", dt[i],
                      " is outside the target vocabulary [0, ", V, ")");
  for (int64_t i = 0; i < B * k; ++i)
    TORCH_CHECK_VALUE(ua[i] >= 0.0 && ua[i] < 1.0, "verify_chain: u_accept must lie in [0, 1), got ", ua[i],
                      " at flat index ", i);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK_VALUE(us[b] >= 0.0 && us[b] < 1.0, "verify_chain: u_sample must lie in [0, 1), got ", us[b],
                      " at row ", b);

  std::vector<int32_t> t2d;
  if (has_map) {
    TORCH_CHECK_VALUE(V <= std::numeric_limits<int32_t>::max(), "verify_chain: vocabulary too large");
    const at::Tensor m_c = d2t->contiguous();
    const int64_t* m = m_c.data_ptr<int64_t>();
    t2d.assign(static_cast<size_t>(V), -1);
    for (int64_t d = 0; d < Vd; ++d) {
      const int64_t t = d + m[d];
      TORCH_CHECK_VALUE(t >= 0 && t < V, "verify_chain: d2t[", d, "] = ", m[d], " maps draft id ", d,
                        " to target id ", t, ", outside the target vocabulary [0, ", V, ")");
      TORCH_CHECK_VALUE(t2d[static_cast<size_t>(t)] < 0, "verify_chain: d2t maps draft ids ",
                        t2d[static_cast<size_t>(t)], " and ", d, " to the same target id ", t);
      t2d[static_cast<size_t>(t)] = static_cast<int32_t>(d);
    }
  }
  const QMode draft_mode = !has_q ? QMode::kPoint : (has_map ? QMode::kMapped : QMode::kDense);

  int64_t* out_tok = tokens.data_ptr<int64_t>();
  int64_t* out_acc = num_accepted.data_ptr<int64_t>();
  std::vector<int8_t> row_err(static_cast<size_t>(B), kOk);
  std::vector<int64_t> row_err_pos(static_cast<size_t>(B), 0);

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> prefix;
    std::vector<double> rbuf(static_cast<size_t>(kTileChunks * kC));
    for (int64_t b = begin; b < end; ++b) {
      const float* lpb = lp + b * K1 * V;
      const int64_t* xb = dt + b * k;
      int64_t n_acc = 0;
      int64_t greedy_tok = -1;  // argmax at the position where a greedy row stopped
      bool drafted = false;     // whether position n_acc holds a (rejected) draft
      for (int64_t i = 0; i < k; ++i) {
        const int64_t x = xb[i];
        if (x < 0) break;  // ragged draft: the chain ends here
        bool accept;
        if (gr[b]) {
          const int64_t am = argmax_first(lpb + i * V, V);
          accept = am == x;
          if (!accept) greedy_tok = am;
        } else {
          float q;
          if (draft_mode == QMode::kPoint) {
            q = 1.0f;
          } else if (draft_mode == QMode::kDense) {
            q = spec_clean_q(qp[(b * k + i) * Vd + x]);
          } else {
            const int32_t d = t2d[static_cast<size_t>(x)];
            q = d < 0 ? 0.0f : spec_clean_q(qp[(b * k + i) * Vd + d]);
          }
          accept = spec_accept(ua[b * k + i], q, spec_expf(lpb[i * V + x]));
        }
        if (!accept) {
          drafted = true;
          break;
        }
        ++n_acc;
      }
      const int64_t j = n_acc;
      int64_t tok;
      if (gr[b]) {
        tok = greedy_tok >= 0 ? greedy_tok : argmax_first(lpb + j * V, V);
      } else {
        QSource src;
        QMode mode = QMode::kNone;
        if (drafted) {
          mode = draft_mode;
          src.x = xb[j];
          src.t2d = has_map ? t2d.data() : nullptr;
          src.q = has_q ? qp + (b * k + j) * Vd : nullptr;
        }
        tok = sample_position(mode, lpb + j * V, src, V, us[b], prefix, rbuf.data());
        if (tok < 0) {
          row_err[static_cast<size_t>(b)] = kNoMass;
          row_err_pos[static_cast<size_t>(b)] = j;
          continue;
        }
      }
      int64_t* ob = out_tok + b * K1;
      for (int64_t i = 0; i < j; ++i) ob[i] = xb[i];
      ob[j] = tok;
      out_acc[b] = n_acc;
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    const int8_t e = row_err[static_cast<size_t>(b)];
    const int64_t i = row_err_pos[static_cast<size_t>(b)];
    TORCH_CHECK_VALUE(e != kNoMass, "verify_chain: target_logprobs[", b, ", ", i,
                      "] has no probability mass (every log-prob is -inf or NaN)");
  }
  return {tokens, num_accepted};
}

at::Tensor spec_exp_cpu(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "spec_exp expects float32, got ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* in = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, xc.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = spec_expf(in[i]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("verify_chain", &verify_chain_cpu);
  m.impl("spec_exp", &spec_exp_cpu);
}

}  // namespace megatron_spec
