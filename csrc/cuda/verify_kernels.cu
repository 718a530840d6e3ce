// CUDA kernels for chain verification (speculative sampling) with pre-drawn uniforms.
//
// Torch-free; binding in csrc/cuda/ops_binding.cpp. Same semantics and same float64 summation order
// as the CPU kernel (csrc/verify_cpu.cpp) and the reference (megatron_spec/ops/verify_reference.py):
// one thread block per row; the acceptance walk is computed redundantly by every thread (uniform
// control flow), greedy rows use a block-wide argmax (lowest index on ties), and the residual /
// bonus draw sums each kSampleChunk-token chunk sequentially in one thread, then thread 0 scans the
// chunk sums and the selected chunk in order. Parallel across chunks, sequential inside them: the
// rounding is identical to the CPU's. The input checks (NaN in a greedy argmax and its largest
// probability, p_i(x_i) of a tested draft, a sampled row's emission mass) are those of the CPU
// kernel, at the same positions.
// References: Leviathan et al. (2023); Chen et al. (2023).
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/launchers.h"
#include "ms_math.h"

namespace megatron_spec {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kModeNone = 0, kModeDense = 1, kModeMapped = 2, kModePoint = 3;

__device__ float q_at(int mode, const float* q, const int32_t* t2d, int64_t x, int64_t t) {
  if (mode == kModeDense) return spec_clean_q(q[t]);
  if (mode == kModeMapped) {
    const int32_t d = t2d[t];
    return d < 0 ? 0.0f : spec_clean_q(q[d]);
  }
  if (mode == kModePoint) return t == x ? 1.0f : 0.0f;
  return 0.0f;
}

// (value, index) of the better candidate: larger value, then lower index; index -1 = no candidate.
__device__ void argmax_combine(float& bv, int64_t& bi, float ov, int64_t oi) {
  if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
    bv = ov;
    bi = oi;
  }
}

// First index of the maximum over x[0, V) (lowest index on ties), or -1 when x holds a NaN; every
// thread returns it.
__device__ int64_t block_argmax(const float* __restrict__ x, int64_t V, float* s_val, int64_t* s_idx) {
  float bv = 0.0f;
  int64_t bi = -1;
  int nan = 0;
  for (int64_t t = threadIdx.x; t < V; t += kThreads) {
    const float v = x[t];
    nan |= v != v;
    argmax_combine(bv, bi, v, t);
  }
  if (__syncthreads_or(nan)) return -1;
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, off);
    const int64_t oi = __shfl_xor_sync(0xFFFFFFFFu, bi, off);
    argmax_combine(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_val[warp] = bv;
    s_idx[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) argmax_combine(bv, bi, s_val[w], s_idx[w]);
    s_idx[0] = bi < 0 ? 0 : bi;
  }
  __syncthreads();
  const int64_t r = s_idx[0];
  __syncthreads();  // s_idx is reused by the next call
  return r;
}

// Inverse-CDF draw from max(0, p - q) of one row position. Returns -1 when there is no mass. S holds
// 2 * ceil(V / kSampleChunk) doubles; the same pass writes the mass of p itself to *s_mass.
__device__ int64_t block_sample(const float* __restrict__ lp, int mode, const float* q, const int32_t* t2d,
                                int64_t x, int64_t V, double u, double* __restrict__ S, int64_t* s_tok,
                                double* s_mass) {
  const int64_t C = kSampleChunk;
  const int64_t nC = (V + C - 1) / C;
  double* M = S + nC;
  for (int64_t c = threadIdx.x; c < nC; c += kThreads) {
    const int64_t a = c * C, b = min(V, a + C);
    double acc = 0.0;
    double l[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};  // the mass in the CPU's lane order
    for (int64_t t0 = a; t0 < b; t0 += 8) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t t = t0 + j;
        if (t < b) {
          const float p = spec_expf(lp[t]);
          acc = dadd_rn(acc, spec_residual(p, q_at(mode, q, t2d, x, t)));
          l[j] = dadd_rn(l[j], static_cast<double>(p));
        }
      }
    }
    S[c] = acc;
    M[c] = dadd_rn(dadd_rn(dadd_rn(l[0], l[1]), dadd_rn(l[2], l[3])), dadd_rn(dadd_rn(l[4], l[5]), dadd_rn(l[6], l[7])));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = 0.0;
    for (int64_t c = 0; c < nC; ++c) m = dadd_rn(m, M[c]);
    *s_mass = m;
    double P = 0.0;
    for (int64_t c = 0; c < nC; ++c) {
      P = dadd_rn(P, S[c]);
      S[c] = P;
    }
    int64_t tok = -1;
    if (P > 0.0) {
      const double theta = dmul_rn(u, P);
      int64_t cs = nC - 1;
      for (int64_t c = 0; c < nC; ++c) {
        if (S[c] > theta) {
          cs = c;
          break;
        }
      }
      const double theta_local = dsub_rn(theta, cs > 0 ? S[cs - 1] : 0.0);
      const int64_t a = cs * C, b = min(V, a + C);
      double acc = 0.0;
      int64_t last_pos = -1;
      for (int64_t t = a; t < b; ++t) {
        const double r = spec_residual(spec_expf(lp[t]), q_at(mode, q, t2d, x, t));
        acc = dadd_rn(acc, r);
        if (acc > theta_local) {
          tok = t;
          break;
        }
        if (r > 0.0) last_pos = t;
      }
      if (tok < 0) tok = last_pos;
    }
    *s_tok = tok;
  }
  __syncthreads();
  const int64_t tok = *s_tok;
  __syncthreads();
  return tok;
}

__global__ void __launch_bounds__(kThreads)
    verify_chain_kernel(const float* __restrict__ lp, const int64_t* __restrict__ dt, const float* __restrict__ qp,
                        const int32_t* __restrict__ t2d, int64_t Vd, const bool* __restrict__ greedy,
                        const double* __restrict__ ua, const double* __restrict__ us, int64_t k, int64_t V,
                        double* __restrict__ scratch, int64_t* __restrict__ tokens, int64_t* __restrict__ num_acc,
                        int32_t* __restrict__ status, double* __restrict__ row_err) {
  __shared__ float s_val[kThreads / 32];
  __shared__ int64_t s_idx[kThreads / 32];
  __shared__ int64_t s_tok;
  __shared__ double s_mass;
  const int64_t b = blockIdx.x;
  const int64_t K1 = k + 1;
  const float* lpb = lp + b * K1 * V;
  const int64_t* xb = dt + b * k;
  const bool is_greedy = greedy[b];
  const int draft_mode = qp == nullptr ? kModePoint : (t2d != nullptr ? kModeMapped : kModeDense);
  // Uniform control flow: every thread takes the same branches, so all return together on an error.
  auto fail = [&](int kind, int64_t pos, int64_t tok, double val) {
    if (threadIdx.x == 0) {
      double* e = row_err + b * 4;
      e[0] = kind;
      e[1] = static_cast<double>(pos);
      e[2] = static_cast<double>(tok);
      e[3] = val;
      atomicMin(&status[kBadInput], static_cast<int32_t>(b));
    }
  };
  double* S = scratch + b * 2 * ((V + kSampleChunk - 1) / kSampleChunk);
  int64_t n_acc = 0, greedy_tok = -1;
  bool drafted = false;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t x = xb[i];
    if (x < 0) break;
    bool accept;
    if (is_greedy) {
      const int64_t am = block_argmax(lpb + i * V, V, s_val, s_idx);
      if (am < 0) return fail(kRowGreedyNaN, i, 0, 0.0);
      accept = am == x;
      if (!accept) greedy_tok = am;
    } else {
      float q;
      if (draft_mode == kModePoint) {
        q = 1.0f;
      } else if (draft_mode == kModeDense) {
        q = spec_clean_q(qp[(b * k + i) * Vd + x]);
      } else {
        const int32_t d = t2d[x];
        q = d < 0 ? 0.0f : spec_clean_q(qp[(b * k + i) * Vd + d]);
      }
      const float p = spec_expf(lpb[i * V + x]);
      if (!spec_p_ok(p)) return fail(kRowBadDraftP, i, x, static_cast<double>(lpb[i * V + x]));
      accept = spec_accept(ua[b * k + i], q, p);
    }
    if (!accept) {
      drafted = true;
      break;
    }
    ++n_acc;
  }
  const int64_t j = n_acc;
  int64_t tok;
  if (is_greedy) {
    tok = greedy_tok >= 0 ? greedy_tok : block_argmax(lpb + j * V, V, s_val, s_idx);
    if (tok < 0) return fail(kRowGreedyNaN, j, 0, 0.0);
    const float p_max = spec_expf(lpb[j * V + tok]);
    if (!spec_greedy_max_ok(p_max, V)) return fail(kRowBadGreedyMax, j, 0, static_cast<double>(p_max));
  } else {
    const int mode = drafted ? draft_mode : kModeNone;
    const float* qrow = (drafted && qp != nullptr) ? qp + (b * k + j) * Vd : nullptr;
    const int64_t x = drafted ? xb[j] : -1;
    tok = block_sample(lpb + j * V, mode, qrow, t2d, x, V, us[b], S, &s_tok, &s_mass);
    const double m = s_mass;  // written by thread 0 before block_sample's barriers
    if (!spec_mass_ok(m)) return fail(kRowBadMass, j, 0, m);
    if (tok < 0 && mode != kModeNone)
      tok = block_sample(lpb + j * V, kModeNone, nullptr, nullptr, -1, V, us[b], S, &s_tok, &s_mass);
    if (tok < 0 && threadIdx.x == 0) atomicMin(&status[kNoMass], static_cast<int32_t>(b));
  }
  if (threadIdx.x == 0) {
    int64_t* ob = tokens + b * K1;
    for (int64_t i = 0; i < K1; ++i) ob[i] = i < j ? xb[i] : (i == j ? tok : -1);
    num_acc[b] = n_acc;
  }
}

__global__ void verify_validate_kernel(const int64_t* __restrict__ dt, const double* __restrict__ ua,
                                       const double* __restrict__ us, int64_t B, int64_t k, int64_t V,
                                       int32_t* __restrict__ status) {
  const int64_t n = B * k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n + B;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n) {
      if (dt[i] >= V) atomicMin(&status[kBadToken], static_cast<int32_t>(i));
      if (!(ua[i] >= 0.0 && ua[i] < 1.0)) atomicMin(&status[kBadUAccept], static_cast<int32_t>(i));
    } else {
      const int64_t b = i - n;
      if (!(us[b] >= 0.0 && us[b] < 1.0)) atomicMin(&status[kBadUSample], static_cast<int32_t>(b));
    }
  }
}

__global__ void build_t2d_kernel(const int64_t* __restrict__ d2t, int64_t Vd, int64_t V, int32_t* __restrict__ t2d,
                                 int32_t* __restrict__ status) {
  for (int64_t d = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; d < Vd;
       d += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = d + d2t[d];
    if (t < 0 || t >= V) {
      atomicMin(&status[kBadD2tRange], static_cast<int32_t>(d));
      continue;
    }
    if (atomicCAS(&t2d[t], -1, static_cast<int32_t>(d)) != -1) atomicMin(&status[kD2tCollision], static_cast<int32_t>(t));
  }
}

unsigned int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

cudaError_t launch_verify_validate(const int64_t* draft_tokens, const double* u_accept, const double* u_sample,
                                   int64_t B, int64_t k, int64_t V, int32_t* status, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  verify_validate_kernel<<<grid_for(B * k + B), kThreads, 0, stream>>>(draft_tokens, u_accept, u_sample, B, k, V,
                                                                      status);
  return cudaGetLastError();
}

cudaError_t launch_build_t2d(const int64_t* d2t, int64_t Vd, int64_t V, int32_t* t2d, int32_t* status,
                             cudaStream_t stream) {
  if (Vd == 0) return cudaSuccess;
  build_t2d_kernel<<<grid_for(Vd), kThreads, 0, stream>>>(d2t, Vd, V, t2d, status);
  return cudaGetLastError();
}

cudaError_t launch_verify_chain(const float* target_logprobs, const int64_t* draft_tokens,
                                const float* draft_probs, const int32_t* t2d, int64_t Vd, const bool* greedy,
                                const double* u_accept, const double* u_sample, int64_t B, int64_t k,
                                int64_t V, double* chunk_scratch, int64_t* tokens, int64_t* num_accepted,
                                int32_t* status, double* row_err, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  if (B > 2147483647LL) return cudaErrorInvalidValue;
  verify_chain_kernel<<<static_cast<unsigned int>(B), kThreads, 0, stream>>>(
      target_logprobs, draft_tokens, draft_probs, t2d, Vd, greedy, u_accept, u_sample, k, V, chunk_scratch, tokens,
      num_accepted, status, row_err);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megatron_spec
