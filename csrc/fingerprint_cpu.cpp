// The weight-sync fingerprint's sums (megatron_spec/sync/fingerprint.py) in one pass over the bits.
//
// bits [n] int8/int16/int32/int64 (the bit patterns of a tensor's elements, read as signed integers of their
// width) -> [2] int64: s1 = sum(b) and s2 = sum(b * b), both mod 2**64 (unsigned wrap-around, stored in the
// int64's bits). Integer sums are exact and order-free, so the threads' partial sums may be added in any order:
// the result equals the reference (numpy, a chunk at a time) bit for bit. The loop is compiled per instruction set
// (csrc/cpu/kernels_impl.h): built for the baseline alone it summed SmolLM2's 269 MB of bf16 bits in 0.067 s on a
// 2-core Zen 4, the AVX-512 variant in 0.011 s (the same bytes as int32 bits: 0.020 -> 0.009 s).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu/kernels.h"

namespace megatron_spec {
namespace {

// The sums of n elements a chunk at a time on torch's threads: run(begin, end, part) adds the sums of elements
// [begin, end) into part[0..1]; the chunks' partial sums are added in order (integer sums: any order is the same).
template <typename Run>
void chunked_sums(int64_t n, Run run, uint64_t* out) {
  // 64K elements a chunk: a sync's mid-sized tensors (a 576 x 576 projection is 331K) still split evenly
  // over the threads (chunks of 256K left one thread the last 69K of it)
  const int64_t grain = 1 << 16;
  const int64_t chunks = (n + grain - 1) / grain;
  std::vector<uint64_t> part(2 * chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * grain;
      run(begin, std::min(n, begin + grain), &part[2 * c]);
    }
  });
  out[0] = out[1] = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    out[0] += part[2 * c];
    out[1] += part[2 * c + 1];
  }
}

// One dtype's sums, copying the bits into dst on the way when it is given (a sync writes each tensor once: the
// trainer into its bucket, the engine into its parameters; the sums of what was written then cost no second pass).
template <typename T>
void sums(const at::Tensor& b, at::Tensor* dst, cpu::BitsSumsFn<T> run, cpu::BitsSumsCopyFn<T> run_copy,
          uint64_t* out) {
  const T* x = b.data_ptr<T>();
  if (dst == nullptr) {
    chunked_sums(b.numel(), [&](int64_t begin, int64_t end, uint64_t* part) { run(x + begin, end - begin, part); },
                 out);
  } else {
    T* y = dst->data_ptr<T>();
    chunked_sums(
        b.numel(),
        [&](int64_t begin, int64_t end, uint64_t* part) { run_copy(x + begin, y + begin, end - begin, part); }, out);
  }
}

at::Tensor sums_of(const at::Tensor& bits, at::Tensor* dst, const char* op) {
  const at::Tensor b = bits.contiguous();
  at::Tensor out = at::empty({2}, b.options().dtype(at::kLong));
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const cpu::KernelTable& k = cpu::kernels();
  switch (b.scalar_type()) {
    case at::kChar: sums<int8_t>(b, dst, k.bits_sums_i8, k.bits_sums_copy_i8, o); break;
    case at::kShort: sums<int16_t>(b, dst, k.bits_sums_i16, k.bits_sums_copy_i16, o); break;
    case at::kInt: sums<int32_t>(b, dst, k.bits_sums_i32, k.bits_sums_copy_i32, o); break;
    case at::kLong: sums<int64_t>(b, dst, k.bits_sums_i64, k.bits_sums_copy_i64, o); break;
    default: TORCH_CHECK_VALUE(false, op, " expects int8, int16, int32 or int64 bits, got ", b.scalar_type());
  }
  return out;
}

at::Tensor bits_sums_cpu(const at::Tensor& bits) {
  TORCH_CHECK_VALUE(bits.dim() == 1, "bits_sums expects a 1-D tensor, got ", bits.dim(), " dimensions");
  return sums_of(bits, nullptr, "bits_sums");
}

at::Tensor bits_sums_copy_cpu(const at::Tensor& bits, at::Tensor& dst) {
  TORCH_CHECK_VALUE(bits.dim() == 1 && dst.dim() == 1, "bits_sums_copy expects 1-D tensors, got ", bits.dim(),
                    " and ", dst.dim(), " dimensions");
  TORCH_CHECK_VALUE(bits.scalar_type() == dst.scalar_type() && bits.numel() == dst.numel(),
                    "bits_sums_copy: dst must match bits (", bits.scalar_type(), " [", bits.numel(), "]), got ",
                    dst.scalar_type(), " [", dst.numel(), "]");
  TORCH_CHECK_VALUE(dst.is_contiguous(), "bits_sums_copy: dst must be contiguous");
  return sums_of(bits, &dst, "bits_sums_copy");
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("bits_sums", &bits_sums_cpu);
  m.impl("bits_sums_copy", &bits_sums_copy_cpu);
}

}  // namespace megatron_spec
