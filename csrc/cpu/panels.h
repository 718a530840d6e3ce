// The panel layout of the linear kernels (csrc/linear_cpu.cpp, csrc/linear_bf16_cpu.cpp, csrc/linear_amx_cpu.cpp),
// written straight from a row-major weight: out[p, c, j] = w[16 p + j, c] for words (an fp32 weight's values, a bf16
// weight's values or its pairs along K, an fp32 weight's bf16 halves), zero past the last row; into a fresh tensor or,
// at a weight sync, into the one the layer already holds.
//
// Why: the engine re-packs every matrix after each weight sync. Built from ATen's generic strided copy (pad, then
// a transposing copy of a 4-D view of 2-byte elements) the bf16 panels of SmolLM2-135M took 0.30 s a sync on a
// 2-core Zen 4, 7x a plain copy of the same bytes; one pass over the words, threaded over panels, is bound by
// memory like the copy.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <xmmintrin.h>
#include <emmintrin.h>
#endif

namespace megatron_spec {
namespace cpu {

// w: [N, C] words (row stride C); out: [ceil(N / P), C, P] words, each conv(word of w). Returns the OR of
// (word & check) over w, so a caller can learn in the same pass whether a conversion dropped bits.
template <int64_t P, typename Src, typename Dst, typename Conv>
Src pack_panels_words(const Src* w, int64_t N, int64_t C, Dst* out, Conv conv, Src check = 0) {
  const int64_t panels = (N + P - 1) / P;
  Src seen = 0;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Src mine = 0;
    for (int64_t p = p0; p < p1; ++p) {
      Dst* dst = out + p * C * P;
      const int64_t rows = N - p * P < P ? N - p * P : P;
      const Src* src = w + p * P * C;
      if (rows < P) std::memset(dst, 0, sizeof(Dst) * C * P);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < rows; ++j) {
          const Src v = src[j * C + c];
          mine |= v & check;
          dst[c * P + j] = conv(v);
        }
    }
    if (mine) __atomic_fetch_or(&seen, mine, __ATOMIC_RELAXED);
  });
  return seen;
}

#if defined(__SSE2__)
// A whole panel of 32-bit words, 4 rows x 4 columns at a time through SSE2's 4 x 4 transpose (bit moves only:
// unpack and move, no arithmetic, so every word, NaN payloads included, lands as it was). Baseline x86-64, so the
// generic build has it. The scalar loop above spent ~3 cycles a word here (SmolLM2's fp32 panels: 0.13 s a sync on
// one AVX2 EPYC core).
// Where the panel is 16-byte aligned (a fresh or kept tensor's always is) the stores stream past the caches: the
// panels are read at the next decode step, after the whole re-pack, and a streaming store does not read the line
// it writes first (SmolLM2's fp32 panels, packed and summed on one AVX2 EPYC core: 0.075 -> 0.051 s). The caller
// fences (pack_panels_words).
template <int64_t P>
inline void pack_full_panel_u32(const uint32_t* src, int64_t C, uint32_t* dst) {
  static_assert(P % 4 == 0, "panel rows in fours");
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
  int64_t c = 0;
  for (; c + 4 <= C; c += 4)
    for (int64_t j = 0; j < P; j += 4) {
      __m128 r0 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 0) * C + c)));
      __m128 r1 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 1) * C + c)));
      __m128 r2 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 2) * C + c)));
      __m128 r3 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 3) * C + c)));
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      __m128i* out = reinterpret_cast<__m128i*>(dst + c * P + j);
      if (aligned) {
        _mm_stream_si128(out, _mm_castps_si128(r0));
        _mm_stream_si128(out + P / 4, _mm_castps_si128(r1));
        _mm_stream_si128(out + P / 2, _mm_castps_si128(r2));
        _mm_stream_si128(out + 3 * P / 4, _mm_castps_si128(r3));
      } else {
        _mm_storeu_si128(out, _mm_castps_si128(r0));
        _mm_storeu_si128(out + P / 4, _mm_castps_si128(r1));
        _mm_storeu_si128(out + P / 2, _mm_castps_si128(r2));
        _mm_storeu_si128(out + 3 * P / 4, _mm_castps_si128(r3));
      }
    }
  for (; c < C; ++c)
    for (int64_t j = 0; j < P; ++j) dst[c * P + j] = src[j * C + c];
}
#endif

template <int64_t P, typename Word>
void pack_panels_words(const Word* w, int64_t N, int64_t C, Word* out) {
#if defined(__SSE2__)
  if constexpr (sizeof(Word) == 4 && P % 4 == 0) {
    const auto* src = reinterpret_cast<const uint32_t*>(w);
    auto* dst = reinterpret_cast<uint32_t*>(out);
    const int64_t full = N / P;  // the last, partial panel goes through the scalar loop (zero-filled)
    at::parallel_for(0, full, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) pack_full_panel_u32<P>(src + p * P * C, C, dst + p * C * P);
      _mm_sfence();  // this thread's streaming stores are visible before the panels are used
    });
    if (full * P < N)
      pack_panels_words<P>(w + full * P * C, N - full * P, C, out + full * C * P, [](Word v) { return v; });
    return;
  }
#endif
  pack_panels_words<P>(w, N, C, out, [](Word v) { return v; });
}

// linear_pack_bf16's layout [ceil(N / 16), ceil(K / 2), 16, 2] of a bf16 weight w [N, K], written into `out`
// (contiguous, that shape), zero past N and K: one pass over the pairs where K is even, else padded to pairs first.
inline void pack_bf16_pairs_into(const at::Tensor& w, at::Tensor& out) {
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), panels = (N + 15) / 16, C = (K + 1) / 2;
  if (K % 2 == 0 && N > 0 && K > 0) {  // pairs along K are the 32-bit words of a row
    pack_panels_words<16>(reinterpret_cast<const uint32_t*>(wc.data_ptr()), N, C,
                          reinterpret_cast<uint32_t*>(out.data_ptr()));
    return;
  }
  auto padded = at::zeros({panels * 16, 2 * C}, wc.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(wc);
  out.copy_(padded.view({panels, 16, C, 2}).transpose(1, 2));  // [panels, 16, C, 2] -> [panels, C, 16, 2]
}

}  // namespace cpu
}  // namespace megatron_spec
