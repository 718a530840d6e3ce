// bf16 bits widened to fp32 (exact: the bits shifted into the high half), one value or eight, for the CPU
// kernels that read bf16 weights or activations (linear_cpu.cpp, linear_bf16_cpu.cpp, attention_cpu.cpp,
// norm_rope_cpu.cpp). One value goes through c10::BFloat16's own conversion.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace megatron_spec {
namespace cpu {

inline float widen_bf16(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) inline __m256 widen8_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace cpu
}  // namespace megatron_spec
