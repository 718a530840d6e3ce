// CUDA kernels for chain verification (speculative sampling) with pre-drawn uniforms.
//
// Torch-free; binding in csrc/cuda/ops_binding.cpp. Same semantics and same float64 summation order
// as the CPU kernel (csrc/verify_cpu.cpp) and the reference (megatron_spec/ops/verify_reference.py):
// one thread block per row; the acceptance walk is computed redundantly by every thread (uniform
// control flow), greedy rows use a block-wide argmax (lowest index on ties), and the residual /
// bonus draw sums each kSampleChunk-token chunk sequentially in one thread, then thread 0 scans the
// chunk sums and the selected chunk in order. Parallel across chunks, sequential inside them: the
// rounding is identical to the CPU's.
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

// First index of the maximum over x[0, V) (lowest index on ties); every thread returns it.
__device__ int64_t block_argmax(const float* __restrict__ x, int64_t V, float* s_val, int64_t* s_idx) {
  float bv = 0.0f;
  int64_t bi = -1;
  for (int64_t t = threadIdx.x; t < V; t += kThreads) argmax_combine(bv, bi, x[t], t);
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

// Inverse-CDF draw from max(0, p - q) of one row position. Returns -1 when there is no mass.
__device__ int64_t block_sample(const float* __restrict__ lp, int mode, const float* q, const int32_t* t2d,
                                int64_t x, int64_t V, double u, double* __restrict__ S, int64_t* s_tok) {
  const int64_t C = kSampleChunk;
  const int64_t nC = (V + C - 1) / C;
  for (int64_t c = threadIdx.x; c < nC; c += kThreads) {
    const int64_t a = c * C, b = min(V, a + C);
    double acc = 0.0;
    for (int64_t t = a; t < b; ++t) acc = dadd_rn(acc, spec_residual(spec_expf(lp[t]), q_at(mode, q, t2d, x, t)));
    S[c] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
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
                        int32_t* __restrict__ status) {
  __shared__ float s_val[kThreads / 32];
  __shared__ int64_t s_idx[kThreads / 32];
  __shared__ int64_t s_tok;
  const int64_t b = blockIdx.x;
  const int64_t K1 = k + 1;
  const float* lpb = lp + b * K1 * V;
  const int64_t* xb = dt + b * k;
  const bool is_greedy = greedy[b];
  const int draft_mode = qp == nullptr ? kModePoint : (t2d != nullptr ? kModeMapped : kModeDense);
  int64_t n_acc = 0, greedy_tok = -1;
  bool drafted = false;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t x = xb[i];
    if (x < 0) break;
    bool accept;
    if (is_greedy) {
      const int64_t am = block_argmax(lpb + i * V, V, s_val, s_idx);
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
  if (is_greedy) {
    tok = greedy_tok >= 0 ? greedy_tok : block_argmax(lpb + j * V, V, s_val, s_idx);
  } else {
    const int mode = drafted ? draft_mode : kModeNone;
    const float* qrow = (drafted && qp != nullptr) ? qp + (b * k + j) * Vd : nullptr;
    const int64_t x = drafted ? xb[j] : -1;
    double* S = scratch + b * ((V + kSampleChunk - 1) / kSampleChunk);
    tok = block_sample(lpb + j * V, mode, qrow, t2d, x, V, us[b], S, &s_tok);
    if (tok < 0 && mode != kModeNone) tok = block_sample(lpb + j * V, kModeNone, nullptr, nullptr, -1, V, us[b], S, &s_tok);
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
                                int32_t* status, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  if (B > 2147483647LL) return cudaErrorInvalidValue;
  verify_chain_kernel<<<static_cast<unsigned int>(B), kThreads, 0, stream>>>(
      target_logprobs, draft_tokens, draft_probs, t2d, Vd, greedy, u_accept, u_sample, k, V, chunk_scratch, tokens,
      num_accepted, status);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megatron_spec
