// CUDA kernels for FP8 E4M3 block quantisation / dequantisation and the verifier's exp.
//
// Torch-free (raw pointers, sizes, a cudaStream_t) so nvcc builds it without torch's CUDA headers;
// the torch binding is csrc/cuda/ops_binding.cpp. The per-element math comes from csrc/ms_math.h,
// the same functions the CPU kernels (csrc/fp8_cpu.cpp) run, so both produce identical bytes.
// Quantisation: one thread block per block_n x block_k tile: a block-wide max of |x| bits (integer
// max, so NaN/inf propagate exactly as on the CPU), then the scale, then the bytes.
// Reference: megatron_spec/ops/fp8_reference.py.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/launchers.h"
#include "ms_math.h"

namespace megatron_spec {
namespace cuda {
namespace {

constexpr int kThreads = 256;

struct F32Load {
  using T = float;
  __device__ static uint32_t abs_bits(float x) { return f32_abs_bits(x); }
  __device__ static float load(float x) { return x; }
};
struct BF16Load {
  using T = uint16_t;
  __device__ static uint32_t abs_bits(uint16_t x) { return bf16_abs_bits(x); }
  __device__ static float load(uint16_t x) { return bf16_to_f32(x); }
};
struct F16Load {
  using T = uint16_t;
  __device__ static uint32_t abs_bits(uint16_t x) { return f32_abs_bits(f16_to_f32(x)); }
  __device__ static float load(uint16_t x) { return f16_to_f32(x); }
};

__device__ uint32_t block_max_u32(uint32_t v, uint32_t* smem) {
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, v, off);
    v = o > v ? o : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kThreads / 32) ? smem[lane] : 0u;
    for (int off = 16; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, v, off);
      v = o > v ? o : v;
    }
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  return smem[0];
}

template <typename L>
__global__ void __launch_bounds__(kThreads)
    fp8_quantize_kernel(const typename L::T* __restrict__ w, int64_t N, int64_t K, int64_t bn, int64_t bk,
                        uint8_t* __restrict__ out, float* __restrict__ scale_inv) {
  __shared__ uint32_t smem[kThreads / 32];
  __shared__ float s_mult;
  const int64_t bj = blockIdx.x, bi = blockIdx.y;
  const int64_t nbk = (K + bk - 1) / bk;
  const int64_t r0 = bi * bn, c0 = bj * bk;
  const int64_t rows = min(bn, N - r0), cols = min(bk, K - c0);
  const int64_t n = rows * cols;
  uint32_t m = 0u;
  for (int64_t e = threadIdx.x; e < n; e += kThreads) {
    const int64_t r = e / cols, c = e % cols;
    const uint32_t v = L::abs_bits(w[(r0 + r) * K + c0 + c]);
    m = v > m ? v : m;
  }
  m = block_max_u32(m, smem);
  if (threadIdx.x == 0) {
    const float amax = fp8_block_amax_clamped(f32_from_bits(m));
    scale_inv[bi * nbk + bj] = fp8_block_scale_inv(amax);
    s_mult = fp8_block_quant_mult(amax);
  }
  __syncthreads();
  const float mult = s_mult;
  for (int64_t e = threadIdx.x; e < n; e += kThreads) {
    const int64_t r = e / cols, c = e % cols;
    const int64_t idx = (r0 + r) * K + c0 + c;
    out[idx] = fp8e4m3_from_f32_sat(fmul_rn(L::load(w[idx]), mult));
  }
}

template <typename OutT, int Kind>
__device__ OutT store_as(float v);
template <>
__device__ float store_as<float, 0>(float v) { return v; }
template <>
__device__ uint16_t store_as<uint16_t, 1>(float v) { return f32_to_bf16_rne(v); }
template <>
__device__ uint16_t store_as<uint16_t, 2>(float v) { return f32_to_f16_rne(v); }

template <typename OutT, int Kind>
__global__ void __launch_bounds__(kThreads)
    fp8_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int64_t N,
                          int64_t K, int64_t bn, int64_t bk, OutT* __restrict__ out) {
  const int64_t nbk = (K + bk - 1) / bk;
  const int64_t total = N * K;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / K, c = i % K;
    const float s = scale_inv[(r / bn) * nbk + c / bk];
    out[i] = store_as<OutT, Kind>(fmul_rn(fp8e4m3_to_f32(q[i]), s));
  }
}

__global__ void __launch_bounds__(kThreads) spec_exp_kernel(const float* __restrict__ x, float* __restrict__ out,
                                                            int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    out[i] = spec_expf(x[i]);
  }
}

unsigned int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

cudaError_t launch_fp8_block_quantize(const void* w, FloatKind kind, int64_t N, int64_t K, int64_t bn,
                                      int64_t bk, uint8_t* out, float* scale_inv, cudaStream_t stream) {
  if (N == 0 || K == 0) return cudaSuccess;
  const int64_t nbn = (N + bn - 1) / bn, nbk = (K + bk - 1) / bk;
  if (nbn > 65535 || nbk > 2147483647LL) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>(nbk), static_cast<unsigned int>(nbn));
  switch (kind) {
    case FloatKind::kF32:
      fp8_quantize_kernel<F32Load><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(w), N, K, bn, bk,
                                                                   out, scale_inv);
      break;
    case FloatKind::kBF16:
      fp8_quantize_kernel<BF16Load><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(w), N, K, bn,
                                                                    bk, out, scale_inv);
      break;
    case FloatKind::kF16:
      fp8_quantize_kernel<F16Load><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(w), N, K, bn,
                                                                   bk, out, scale_inv);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_fp8_block_dequantize(const uint8_t* q, const float* scale_inv, int64_t N, int64_t K,
                                        int64_t bn, int64_t bk, FloatKind out_kind, void* out,
                                        cudaStream_t stream) {
  if (N == 0 || K == 0) return cudaSuccess;
  const unsigned int grid = grid_for(N * K);
  switch (out_kind) {
    case FloatKind::kF32:
      fp8_dequantize_kernel<float, 0><<<grid, kThreads, 0, stream>>>(q, scale_inv, N, K, bn, bk,
                                                                      static_cast<float*>(out));
      break;
    case FloatKind::kBF16:
      fp8_dequantize_kernel<uint16_t, 1><<<grid, kThreads, 0, stream>>>(q, scale_inv, N, K, bn, bk,
                                                                         static_cast<uint16_t*>(out));
      break;
    case FloatKind::kF16:
      fp8_dequantize_kernel<uint16_t, 2><<<grid, kThreads, 0, stream>>>(q, scale_inv, N, K, bn, bk,
                                                                         static_cast<uint16_t*>(out));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_spec_exp(const float* x, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  spec_exp_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, out, n);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megatron_spec
