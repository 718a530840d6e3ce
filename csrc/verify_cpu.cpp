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
// pass (the reference makes several); rows run in parallel with at::parallel_for (OpenMP). The
// full-vocabulary loops (residual sampling, argmax, exp) are in csrc/cpu/kernels_impl.h, compiled per
// ISA and chosen at run time (csrc/cpu/kernels.h); this file checks arguments and walks the chains.
//
// Input checks, at the positions the walk reads anyway (verify_reference.py, "Input checks"): a
// sampled row's emission mass within kMassTol of 1 (summed in the sampling pass), no NaN where a
// greedy row takes an argmax and its largest probability at the emission position in [1/V, 1], and
// p_i(x_i) <= 1 + kMassTol at every tested draft. The first offending row is reported, as the
// reference does.
//
// References: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (2023);
// Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (2023).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu/kernels.h"
#include "ms_math.h"

namespace megatron_spec {
namespace {

using cpu::kTileChunks;
using cpu::QSource;
constexpr int64_t kC = kSampleChunk;

enum class QMode { kNone, kDense, kMapped, kPoint };

// Returns the token, or -1 when p has no mass; *mass is the mass of p (the input check).
int64_t sample_position(const cpu::KernelTable& kt, QMode mode, const float* lp, const QSource& s, int64_t V,
                        double u, std::vector<double>& prefix, double* rbuf, float* pbuf, double* mass) {
  prefix.resize(static_cast<size_t>((V + kC - 1) / kC));
  int64_t t = -1;
  double unused;
  switch (mode) {
    case QMode::kDense: t = kt.sample_dense(lp, s, V, u, prefix.data(), rbuf, pbuf, mass); break;
    case QMode::kMapped: t = kt.sample_mapped(lp, s, V, u, prefix.data(), rbuf, pbuf, mass); break;
    case QMode::kPoint: t = kt.sample_point(lp, s, V, u, prefix.data(), rbuf, pbuf, mass); break;
    case QMode::kNone: return kt.sample_p(lp, s, V, u, prefix.data(), rbuf, pbuf, mass);
  }
  if (!spec_mass_ok(*mass)) return -1;
  // No residual mass (p <= q everywhere, reachable through rounding): sample p itself.
  if (t < 0) t = kt.sample_p(lp, s, V, u, prefix.data(), rbuf, pbuf, &unused);
  return t;
}

// Per-row outcome; the first row with one raises after the parallel walk (as the reference does).
enum RowError : int8_t { kOk = 0, kNoMass = 1, kGreedyNaN = 2, kBadDraftP = 3, kBadMass = 4, kBadGreedyMax = 5 };
struct RowErr {
  int8_t kind = kOk;
  int64_t pos = 0;
  int64_t tok = 0;
  double val = 0.0;
};

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
  std::vector<RowErr> row_err(static_cast<size_t>(B));

  const cpu::KernelTable& kt = cpu::kernels();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> prefix;
    std::vector<double> rbuf(static_cast<size_t>(kTileChunks * kC));
    std::vector<float> pbuf(static_cast<size_t>(kTileChunks * kC));
    for (int64_t b = begin; b < end; ++b) {
      const float* lpb = lp + b * K1 * V;
      const int64_t* xb = dt + b * k;
      RowErr& err = row_err[static_cast<size_t>(b)];
      int64_t n_acc = 0;
      int64_t greedy_tok = -1;  // argmax at the position where a greedy row stopped
      bool drafted = false;     // whether position n_acc holds a (rejected) draft
      for (int64_t i = 0; i < k; ++i) {
        const int64_t x = xb[i];
        if (x < 0) break;  // ragged draft: the chain ends here
        bool accept;
        if (gr[b]) {
          const int64_t am = kt.argmax_first(lpb + i * V, V);
          if (am < 0) {
            err = {kGreedyNaN, i, 0, 0.0};
            break;
          }
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
          const float p = spec_expf(lpb[i * V + x]);
          if (!spec_p_ok(p)) {
            err = {kBadDraftP, i, x, static_cast<double>(lpb[i * V + x])};
            break;
          }
          accept = spec_accept(ua[b * k + i], q, p);
        }
        if (!accept) {
          drafted = true;
          break;
        }
        ++n_acc;
      }
      if (err.kind != kOk) continue;
      const int64_t j = n_acc;
      int64_t tok;
      if (gr[b]) {
        tok = greedy_tok >= 0 ? greedy_tok : kt.argmax_first(lpb + j * V, V);
        if (tok < 0) {
          err = {kGreedyNaN, j, 0, 0.0};
          continue;
        }
        const float p_max = spec_expf(lpb[j * V + tok]);
        if (!spec_greedy_max_ok(p_max, V)) {
          err = {kBadGreedyMax, j, 0, static_cast<double>(p_max)};
          continue;
        }
      } else {
        QSource src;
        QMode mode = QMode::kNone;
        if (drafted) {
          mode = draft_mode;
          src.x = xb[j];
          src.t2d = has_map ? t2d.data() : nullptr;
          src.q = has_q ? qp + (b * k + j) * Vd : nullptr;
        }
        double m = 0.0;
        tok = sample_position(kt, mode, lpb + j * V, src, V, us[b], prefix, rbuf.data(), pbuf.data(), &m);
        if (!spec_mass_ok(m)) {
          err = {kBadMass, j, 0, m};
          continue;
        }
        if (tok < 0) {
          err = {kNoMass, j, 0, 0.0};
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
    const RowErr& e = row_err[static_cast<size_t>(b)];
    const int64_t i = e.pos;
    TORCH_CHECK_VALUE(e.kind != kGreedyNaN, "verify_chain: target_logprobs[", b, ", ", i,
                      "] contains NaN (greedy row); log-probs must be finite or -inf");
    TORCH_CHECK_VALUE(e.kind != kBadDraftP, "verify_chain: target_logprobs[", b, ", ", i, ", ", e.tok, "] = ", e.val,
                      " is not a log-probability (NaN, or above 0); pass normalised log-probs "
                      "(process_logits / log_softmax), not raw logits");
    TORCH_CHECK_VALUE(e.kind != kBadGreedyMax, "verify_chain: target_logprobs[", b, ", ", i,
                      "] is not normalised: its largest probability is ", e.val, ", outside [1/V, 1] (V = ", V,
                      ", tolerance ", kMassTol, "); pass log-probs (process_logits / log_softmax), not raw logits");
    TORCH_CHECK_VALUE(!(e.kind == kBadMass && e.val != e.val), "verify_chain: target_logprobs[", b, ", ", i,
                      "] contains NaN");
    TORCH_CHECK_VALUE(!(e.kind == kBadMass && e.val == 0.0), "verify_chain: target_logprobs[", b, ", ", i,
                      "] has no probability mass (every log-prob is -inf)");
    TORCH_CHECK_VALUE(e.kind != kBadMass, "verify_chain: target_logprobs[", b, ", ", i,
                      "] is not normalised: its probabilities sum to ", e.val, ", not 1 (tolerance ", kMassTol,
                      "); pass log-probs (process_logits / log_softmax), not raw logits");
    TORCH_CHECK_VALUE(e.kind != kNoMass, "verify_chain: target_logprobs[", b, ", ", i,
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
  const cpu::KernelTable& kt = cpu::kernels();
  at::parallel_for(0, xc.numel(), 1 << 16,
                   [&](int64_t begin, int64_t end) { kt.spec_exp(in + begin, o + begin, end - begin); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("verify_chain", &verify_chain_cpu);
  m.impl("spec_exp", &spec_exp_cpu);
}

}  // namespace megatron_spec
