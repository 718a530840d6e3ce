// Host launchers of the CUDA kernels in csrc/cuda/*.cu: raw pointers, sizes and a cudaStream_t.
//
// This header is the boundary between the torch-free kernel files (compiled by nvcc) and the torch
// binding csrc/cuda/ops_binding.cpp (compiled by the host compiler with a CUDA torch). It includes
// no torch header, so the .cu files build with a plain CUDA toolkit (tests/ops/test_cuda_compile.py).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace megatron_spec {
namespace cuda {

enum class FloatKind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// w [N, K] (row-major, of `kind`) -> out [N, K] fp8 e4m3 bytes, scale_inv [ceil(N/bn), ceil(K/bk)].
cudaError_t launch_fp8_block_quantize(const void* w, FloatKind kind, int64_t N, int64_t K, int64_t bn,
                                      int64_t bk, uint8_t* out, float* scale_inv, cudaStream_t stream);

// q [N, K] fp8 e4m3 bytes, scale_inv [ceil(N/bn), ceil(K/bk)] -> out [N, K] of `out_kind`.
cudaError_t launch_fp8_block_dequantize(const uint8_t* q, const float* scale_inv, int64_t N, int64_t K,
                                        int64_t bn, int64_t bk, FloatKind out_kind, void* out,
                                        cudaStream_t stream);

// out[i] = spec_expf(x[i]) for i < n.
cudaError_t launch_spec_exp(const float* x, float* out, int64_t n, cudaStream_t stream);

// Status words written by the verification launchers (initialise all to kNoError).
constexpr int32_t kNoError = 0x7FFFFFFF;
enum VerifyStatus : int {
  kBadToken = 0,     // smallest flat index b*k+i with draft_tokens >= V
  kBadUAccept = 1,   // smallest flat index with u_accept outside [0, 1)
  kBadUSample = 2,   // smallest row with u_sample outside [0, 1)
  kBadD2tRange = 3,  // smallest draft id mapped outside [0, V)
  kD2tCollision = 4, // a target id reached by two draft ids
  kNoMass = 5,       // smallest row whose sampled position has no probability mass
  kBadInput = 6,     // smallest row whose log-probs fail the input checks (details in row_err)
  kNumStatus = 7
};

// Kinds in row_err[b * 4 + 0] (row_err[b * 4 + 1..3]: position, token, value), as csrc/verify_cpu.cpp.
enum VerifyRowError : int { kRowGreedyNaN = 2, kRowBadDraftP = 3, kRowBadMass = 4, kRowBadGreedyMax = 5 };

// Checks draft_tokens [B*k] < V and the uniforms, records the first offenders in status.
cudaError_t launch_verify_validate(const int64_t* draft_tokens, const double* u_accept, const double* u_sample,
                                   int64_t B, int64_t k, int64_t V, int32_t* status, cudaStream_t stream);

// t2d [V] must be filled with -1 first; writes t2d[d + d2t[d]] = d and flags range errors / collisions.
cudaError_t launch_build_t2d(const int64_t* d2t, int64_t Vd, int64_t V, int32_t* t2d, int32_t* status,
                             cudaStream_t stream);

// One block per row. draft_probs may be null (point-mass drafts); t2d null unless a d2t map is used.
// chunk_scratch: B * 2 * ceil(V / kSampleChunk) doubles. tokens [B, k+1] and num_accepted [B] are
// written for every row without an error (tokens padded with -1); row_err: B * 4 doubles, written for
// rows that fail the input checks (megatron_spec/ops/verify_reference.py, "Input checks").
cudaError_t launch_verify_chain(const float* target_logprobs, const int64_t* draft_tokens,
                                const float* draft_probs, const int32_t* t2d, int64_t Vd, const bool* greedy,
                                const double* u_accept, const double* u_sample, int64_t B, int64_t k,
                                int64_t V, double* chunk_scratch, int64_t* tokens, int64_t* num_accepted,
                                int32_t* status, double* row_err, cudaStream_t stream);

}  // namespace cuda
}  // namespace megatron_spec
