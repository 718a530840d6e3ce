// CPU ops for FP8 E4M3 block quantisation / dequantisation (128x128 blocks by default).
//
// Layout: w [N, K] row-major; weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32 = amax/448 per
// block (the dequantisation multiplier SGLang loads). The per-element math is in ms_math.h and is the
// same code the CUDA kernels run; the loops are in csrc/cpu/kernels_impl.h, compiled per ISA and
// chosen at run time (csrc/cpu/kernels.h). This file checks arguments, allocates, and splits the
// work over threads.
//
// Work unit of the quantiser: one block row (bn rows) times a run of column blocks, sized to half of
// this CPU's L2 (at most 2048 columns), so that the unit's rows are still in L2 when the kernel's
// second pass reads them again: 512 KiB of bf16 on a 1 MiB L2 (Zen 4), 256 KiB on a 512 KiB one
// (Zen 3). Threads (at::parallel_for: OpenMP in the CPU wheel) take units from a shared counter.
//
// Reference: megatron_spec/ops/fp8_reference.py (the oracle; tests compare bytes and scales).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "cpu/kernels.h"

namespace megatron_spec {
namespace {

// Columns per work unit at most: 16 blocks of 128.
constexpr int64_t kUnitColsMax = 2048;

int64_t l2_bytes() {
  static const int64_t bytes = [] {
    int64_t b = 0;
#if defined(__linux__) && defined(_SC_LEVEL2_CACHE_SIZE)
    b = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return b >= (int64_t{128} << 10) ? b : (int64_t{512} << 10);  // unknown: assume 512 KiB
  }();
  return bytes;
}

// Whole column blocks per unit: at least one, the unit's input at most half of L2.
int64_t blocks_per_unit(int64_t bn, int64_t bk, int64_t itemsize) {
  const int64_t cols = std::min(kUnitColsMax, l2_bytes() / 2 / std::max<int64_t>(1, bn * itemsize));
  return std::max<int64_t>(1, cols / bk);
}

template <typename T>
void quantize_impl(cpu::QuantizeUnitFn<T> unit, const T* w, int64_t N, int64_t K, int64_t bn, int64_t bk,
                   uint8_t* out, float* scale_inv) {
  const int64_t nbn = (N + bn - 1) / bn;
  const int64_t nbk = (K + bk - 1) / bk;
  const int64_t bpu = blocks_per_unit(bn, bk, sizeof(T));
  const int64_t units_per_row = (nbk + bpu - 1) / bpu;
  const int64_t num_units = nbn * units_per_row;
  // Threads take units from a shared counter rather than a fixed share each: when another process
  // takes a core from one thread (a shared machine, a trainer's own threads), the others finish its
  // units instead of waiting for it at the end.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_units));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> colmax;  // running max of |x| bits per column of the unit
    std::vector<float> mult;       // quantisation multiplier per column block of the unit
    std::vector<uint8_t> finite;   // whether the block's amax is finite (vector fast path)
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
      const int64_t bi = u / units_per_row;
      const int64_t bj0 = (u % units_per_row) * bpu;
      const int64_t bj1 = std::min(nbk, bj0 + bpu);
      const int64_t r0 = bi * bn, r1 = std::min(N, r0 + bn);
      const int64_t c0 = bj0 * bk, c1 = std::min(K, bj1 * bk);
      colmax.resize(static_cast<size_t>(c1 - c0));
      mult.resize(static_cast<size_t>(bj1 - bj0));
      finite.resize(static_cast<size_t>(bj1 - bj0));
      unit(w + r0 * K + c0, out + r0 * K + c0, K, r1 - r0, c1 - c0, bk, scale_inv + bi * nbk + bj0, colmax.data(),
           mult.data(), finite.data());
    }
  });
}

template <typename T>
void dequantize_impl(cpu::DequantizeRowFn<T> row, const uint8_t* q, const float* scale_inv, int64_t N, int64_t K,
                     int64_t bn, int64_t bk, T* out) {
  const int64_t nbk = (K + bk - 1) / bk;
  // Rows are independent: split them over threads, a few hundred KiB per task.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(q + r * K, scale_inv + (r / bn) * nbk, K, bk, out + r * K);
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
  const cpu::KernelTable& k = cpu::kernels();
  if (dt == at::kFloat) {
    quantize_impl(k.quantize_unit_f32, wc.data_ptr<float>(), N, K, block_n, block_k, o, s);
  } else {
    const auto* w16 = reinterpret_cast<const uint16_t*>(wc.data_ptr());
    quantize_impl(dt == at::kBFloat16 ? k.quantize_unit_bf16 : k.quantize_unit_f16, w16, N, K, block_n, block_k,
                  o, s);
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
  const cpu::KernelTable& k = cpu::kernels();
  if (dtype == at::kFloat) {
    dequantize_impl(k.dequantize_row_f32, q, s, N, K, block_n, block_k, out.data_ptr<float>());
  } else {
    dequantize_impl(dtype == at::kBFloat16 ? k.dequantize_row_bf16 : k.dequantize_row_f16, q, s, N, K, block_n,
                    block_k, reinterpret_cast<uint16_t*>(out.data_ptr()));
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
