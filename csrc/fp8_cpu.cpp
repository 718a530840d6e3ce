// CPU kernels for FP8 E4M3 block quantisation / dequantisation (128x128 blocks by default).
//
// Layout: w [N, K] row-major; weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32 = amax/448 per
// block (the dequantisation multiplier SGLang loads). The per-element math is in ms_math.h and is the
// same code the CUDA kernels run; this file only decides the loop order and the threading.
//
// Loop order: a work unit is one block-row (bn rows) times a run of column blocks. Pass 1 sweeps
// its rows left to right keeping a running column-wise max of |x| bits (vertical max: no horizontal
// reductions in the hot loop, one contiguous stream per row for the prefetcher); pass 2 sweeps the
// same rows again (now in L2) and writes the quantised bytes. GCC vectorises both inner loops from
// the scalar functions of ms_math.h (-O3 -march=native). Units are spread over at::parallel_for
// (OpenMP in the CPU wheel).
//
// Reference: megatron_spec/ops/fp8_reference.py (the oracle; tests compare bytes and scales).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ms_math.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on _mm512_undefined_*() (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace megatron_spec {
namespace {

// Columns per work unit: 16 blocks of 128 -> bn x 2048 elements (512 KiB of bf16 for bn = 128).
constexpr int64_t kUnitCols = 2048;

// Input traits. Pass 1 takes the max of |x| as ordered integer bits in the input's own width
// (u16 for 16-bit floats: twice the lanes), then converts that one value to float32.
struct F32In {
  using T = float;
  using Bits = uint32_t;
  static inline uint32_t abs_bits(float x) { return f32_abs_bits(x); }
  static inline float amax_f32(uint32_t m) { return f32_from_bits(m); }
  static inline float load(float x) { return x; }
#if defined(MS_HAVE_AVX512)
  static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif
};
struct BF16In {
  using T = uint16_t;
  using Bits = uint16_t;
  static inline uint16_t abs_bits(uint16_t x) { return static_cast<uint16_t>(x & 0x7FFFu); }
  static inline float amax_f32(uint16_t m) { return bf16_to_f32(m); }
  static inline float load(uint16_t x) { return bf16_to_f32(x); }
#if defined(MS_HAVE_AVX512)
  static inline __m512 load16(const uint16_t* p) { return bf16x16_to_f32(p); }
#endif
};
struct F16In {
  using T = uint16_t;
  using Bits = uint16_t;
  static inline uint16_t abs_bits(uint16_t x) { return static_cast<uint16_t>(x & 0x7FFFu); }
  static inline float amax_f32(uint16_t m) { return f16_to_f32(m); }
  static inline float load(uint16_t x) { return f16_to_f32(x); }
#if defined(MS_HAVE_AVX512)
  static inline __m512 load16(const uint16_t* p) { return f16x16_to_f32(p); }
#endif
};

// Quantise row[a, b) of one block with multiplier s into orow[a, b).
template <typename In>
inline void quantize_run(const typename In::T* __restrict row, uint8_t* __restrict orow, int64_t a, int64_t b,
                         float s, bool finite) {
  int64_t c = a;
#if defined(MS_HAVE_AVX512)
  if (finite) {
    const __m512 vs = _mm512_set1_ps(s);
    for (; c + 16 <= b; c += 16) {
      const __m128i q = fp8e4m3_from_f32_finite_x16(_mm512_mul_ps(In::load16(row + c), vs));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + c), q);
    }
  }
#else
  (void)finite;
#endif
  for (; c < b; ++c) orow[c] = fp8e4m3_from_f32_sat(fmul_rn(In::load(row[c]), s));
}

template <typename In>
void quantize_impl(const typename In::T* __restrict w, int64_t N, int64_t K, int64_t bn, int64_t bk,
                   uint8_t* __restrict out, float* __restrict scale_inv) {
  using T = typename In::T;
  using Bits = typename In::Bits;
  const int64_t nbn = (N + bn - 1) / bn;
  const int64_t nbk = (K + bk - 1) / bk;
  // A unit spans whole column blocks: at least one, about kUnitCols columns.
  const int64_t blocks_per_unit = std::max<int64_t>(1, kUnitCols / bk);
  const int64_t units_per_row = (nbk + blocks_per_unit - 1) / blocks_per_unit;
  const int64_t num_units = nbn * units_per_row;
  at::parallel_for(0, num_units, 1, [&](int64_t begin, int64_t end) {
    std::vector<Bits> colmax;     // running max of |x| bits per column of the unit
    std::vector<float> mult;      // quantisation multiplier per column block of the unit
    std::vector<uint8_t> finite;  // whether the block's amax is finite (vector fast path)
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t bi = unit / units_per_row;
      const int64_t bj0 = (unit % units_per_row) * blocks_per_unit;
      const int64_t bj1 = std::min(nbk, bj0 + blocks_per_unit);
      const int64_t r0 = bi * bn, r1 = std::min(N, r0 + bn);
      const int64_t c0 = bj0 * bk, c1 = std::min(K, bj1 * bk);
      const int64_t nc = c1 - c0;
      colmax.assign(static_cast<size_t>(nc), Bits{0});
      Bits* __restrict cm = colmax.data();
      // Pass 1: column-wise max of |x| over the block-row (integer max: NaN/inf propagate).
      for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict row = w + r * K + c0;
        for (int64_t c = 0; c < nc; ++c) {
          const Bits v = In::abs_bits(row[c]);
          cm[c] = v > cm[c] ? v : cm[c];
        }
      }
      const size_t nb = static_cast<size_t>(bj1 - bj0);
      mult.resize(nb);
      finite.resize(nb);
      for (int64_t bj = bj0; bj < bj1; ++bj) {
        const int64_t a = (bj - bj0) * bk, b = std::min(nc, a + bk);
        Bits m = 0;
        for (int64_t c = a; c < b; ++c) m = cm[c] > m ? cm[c] : m;
        const float raw = In::amax_f32(m);
        const float amax = fp8_block_amax_clamped(raw);
        scale_inv[bi * nbk + bj] = fp8_block_scale_inv(amax);
        mult[static_cast<size_t>(bj - bj0)] = fp8_block_quant_mult(amax);
        finite[static_cast<size_t>(bj - bj0)] = f32_abs_bits(raw) < 0x7F800000u;
      }
      // Pass 2: quantise, one column block at a time so the multiplier is a loop constant.
      for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict row = w + r * K + c0;
        uint8_t* __restrict orow = out + r * K + c0;
        for (int64_t bj = bj0; bj < bj1; ++bj) {
          const int64_t a = (bj - bj0) * bk, b = std::min(nc, a + bk);
          const size_t ib = static_cast<size_t>(bj - bj0);
          quantize_run<In>(row, orow, a, b, mult[ib], finite[ib] != 0);
        }
      }
    }
  });
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
void dequantize_impl(const uint8_t* __restrict q, const float* __restrict scale_inv, int64_t N,
                     int64_t K, int64_t bn, int64_t bk, typename Out::T* __restrict out) {
  const int64_t nbk = (K + bk - 1) / bk;
  // Rows are independent: split them over threads, a few hundred KiB per task.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* __restrict qrow = q + r * K;
      typename Out::T* __restrict orow = out + r * K;
      const float* __restrict srow = scale_inv + (r / bn) * nbk;
      for (int64_t bj = 0; bj < nbk; ++bj) {
        const int64_t a = bj * bk, b = std::min(K, a + bk);
        const float s = srow[bj];
        for (int64_t c = a; c < b; ++c) orow[c] = Out::store(fmul_rn(fp8e4m3_to_f32(qrow[c]), s));
      }
    }
  });
}

// A freshly allocated large output is untouched mmap memory: faulting it in 4 KiB pages costs about
// as much as quantising into it. Ask for transparent huge pages before the first write (what torch's
// own allocator does under THP_MEM_ALLOC_ENABLE=1); purely advisory, results are unaffected.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.nbytes());
  const uintptr_t a = (begin + kHuge - 1) & ~(kHuge - 1), b = end & ~(kHuge - 1);
  if (b > a) (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// FP8 data crosses the op boundary as e4m3 bytes (uint8); float8_e4m3fn views are accepted too.
bool is_fp8_bytes(const at::Tensor& t) {
  return t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e4m3fn;
}

void check_blocks(int64_t block_n, int64_t block_k) {
  TORCH_CHECK_VALUE(block_n > 0 && block_k > 0, "megatron_spec fp8 block size must be positive, got [",
                    block_n, ", ", block_k, "]");
}

void fp8_block_quantize_out_cpu(const at::Tensor& w, int64_t block_n, int64_t block_k, at::Tensor& out,
                                at::Tensor& scale_inv) {
  check_blocks(block_n, block_k);
  TORCH_CHECK_VALUE(w.dim() == 2, "fp8_block_quantize expects a 2-D weight [N, K], got shape ", w.sizes());
  const auto dt = w.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                    "fp8_block_quantize expects float32, bfloat16 or float16 weights, got ", dt);
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t sn = (N + block_n - 1) / block_n, sk = (K + block_k - 1) / block_k;
  TORCH_CHECK_VALUE(is_fp8_bytes(out) && out.dim() == 2 && out.size(0) == N &&
                        out.size(1) == K && out.is_contiguous(),
                    "fp8_block_quantize: out must be a contiguous uint8 / float8_e4m3fn [", N, ", ", K, "], got ",
                    out.scalar_type(), " of shape ", out.sizes());
  TORCH_CHECK_VALUE(scale_inv.scalar_type() == at::kFloat && scale_inv.dim() == 2 && scale_inv.size(0) == sn &&
                        scale_inv.size(1) == sk && scale_inv.is_contiguous(),
                    "fp8_block_quantize: scale_inv must be a contiguous float32 [", sn, ", ", sk, "], got ",
                    scale_inv.scalar_type(), " of shape ", scale_inv.sizes());
  if (N == 0 || K == 0) {
    scale_inv.zero_();
    return;
  }
  const at::Tensor wc = w.contiguous();
  auto* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  float* s = scale_inv.data_ptr<float>();
  if (dt == at::kFloat) {
    quantize_impl<F32In>(wc.data_ptr<float>(), N, K, block_n, block_k, o, s);
  } else if (dt == at::kBFloat16) {
    quantize_impl<BF16In>(reinterpret_cast<const uint16_t*>(wc.data_ptr()), N, K, block_n, block_k, o, s);
  } else {
    quantize_impl<F16In>(reinterpret_cast<const uint16_t*>(wc.data_ptr()), N, K, block_n, block_k, o, s);
  }
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_cpu(const at::Tensor& w, int64_t block_n,
                                                          int64_t block_k) {
  check_blocks(block_n, block_k);
  TORCH_CHECK_VALUE(w.dim() == 2, "fp8_block_quantize expects a 2-D weight [N, K], got shape ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kByte));  // e4m3 bytes
  advise_huge_pages(out);
  at::Tensor scale =
      at::empty({(N + block_n - 1) / block_n, (K + block_k - 1) / block_k}, w.options().dtype(at::kFloat));
  fp8_block_quantize_out_cpu(w, block_n, block_k, out, scale);
  return {out, scale};
}

at::Tensor fp8_block_dequantize_cpu(const at::Tensor& w_fp8, const at::Tensor& scale_inv,
                                    int64_t block_n, int64_t block_k, at::ScalarType dtype) {
  check_blocks(block_n, block_k);
  TORCH_CHECK_VALUE(w_fp8.dim() == 2 && is_fp8_bytes(w_fp8),
                    "fp8_block_dequantize expects a 2-D uint8 / float8_e4m3fn weight, got ", w_fp8.scalar_type(),
                    " of shape ", w_fp8.sizes());
  const int64_t N = w_fp8.size(0), K = w_fp8.size(1);
  const int64_t sn = (N + block_n - 1) / block_n, sk = (K + block_k - 1) / block_k;
  TORCH_CHECK_VALUE(scale_inv.dim() == 2 && scale_inv.size(0) == sn && scale_inv.size(1) == sk &&
                        scale_inv.scalar_type() == at::kFloat,
                    "fp8_block_dequantize expects float32 weight_scale_inv of shape [", sn, ", ", sk,
                    "] for weight [", N, ", ", K, "] and blocks [", block_n, ", ", block_k, "], got ",
                    scale_inv.scalar_type(), " of shape ", scale_inv.sizes());
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "fp8_block_dequantize output dtype must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor qc = w_fp8.contiguous();
  const at::Tensor sc = scale_inv.contiguous();
  at::Tensor out = at::empty({N, K}, qc.options().dtype(dtype));
  if (N == 0 || K == 0) return out;
  advise_huge_pages(out);
  const auto* q = reinterpret_cast<const uint8_t*>(qc.data_ptr());
  const float* s = sc.data_ptr<float>();
  if (dtype == at::kFloat) {
    dequantize_impl<F32Out>(q, s, N, K, block_n, block_k, out.data_ptr<float>());
  } else if (dtype == at::kBFloat16) {
    dequantize_impl<BF16Out>(q, s, N, K, block_n, block_k, reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    dequantize_impl<F16Out>(q, s, N, K, block_n, block_k, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("fp8_block_quantize", &fp8_block_quantize_cpu);
  m.impl("fp8_block_quantize_out", &fp8_block_quantize_out_cpu);
  m.impl("fp8_block_dequantize", &fp8_block_dequantize_cpu);
}

}  // namespace megatron_spec
