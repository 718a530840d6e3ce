// The weight-sync fingerprint's sums (megatron_spec/sync/fingerprint.py) in one pass over the bits.
//
// bits [n] int8/int16/int32/int64 (the bit patterns of a tensor's elements, read as signed integers of their
// width) -> [2] int64: s1 = sum(b) and s2 = sum(b * b), both mod 2**64 (unsigned wrap-around, stored in the
// int64's bits). Integer sums are exact and order-free, so the threads' partial sums may be added in any order:
// the result equals the reference (numpy, a chunk at a time) bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace megatron_spec {
namespace {

template <typename T>
void sums(const T* b, int64_t n, uint64_t* out) {
  const int64_t grain = 1 << 18;
  const int64_t chunks = (n + grain - 1) / grain;
  std::vector<uint64_t> part(2 * chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * grain, end = std::min(n, begin + grain);
      uint64_t s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(b[i]));  // two's complement: b mod 2**64
        s1 += v;
        s2 += v * v;
      }
      part[2 * c] = s1;
      part[2 * c + 1] = s2;
    }
  });
  out[0] = out[1] = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    out[0] += part[2 * c];
    out[1] += part[2 * c + 1];
  }
}

at::Tensor bits_sums_cpu(const at::Tensor& bits) {
  TORCH_CHECK_VALUE(bits.dim() == 1, "bits_sums expects a 1-D tensor, got ", bits.dim(), " dimensions");
  const at::Tensor b = bits.contiguous();
  at::Tensor out = at::empty({2}, b.options().dtype(at::kLong));
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const int64_t n = b.numel();
  switch (b.scalar_type()) {
    case at::kChar: sums(b.data_ptr<int8_t>(), n, o); break;
    case at::kShort: sums(b.data_ptr<int16_t>(), n, o); break;
    case at::kInt: sums(b.data_ptr<int32_t>(), n, o); break;
    case at::kLong: sums(b.data_ptr<int64_t>(), n, o); break;
    default: TORCH_CHECK_VALUE(false, "bits_sums expects int8, int16, int32 or int64 bits, got ", b.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) { m.impl("bits_sums", &bits_sums_cpu); }

}  // namespace megatron_spec
