// The panel layout of the linear kernels (csrc/linear_cpu.cpp, csrc/linear_bf16_cpu.cpp, csrc/linear_amx_cpu.cpp),
// written straight from a row-major weight: out[p, c, j] = w[16 p + j, c] for 32-bit words (an fp32 weight's
// values, or a bf16 weight's pairs along K), zero past the last row.
//
// Why: the engine re-packs every matrix after each weight sync. Built from ATen's generic strided copy (pad, then
// a transposing copy of a 4-D view of 2-byte elements) the bf16 panels of SmolLM2-135M took 0.30 s a sync on a
// 2-core Zen 4, 7x a plain copy of the same bytes; one pass over the words, threaded over panels, is bound by
// memory like the copy.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace megatron_spec {
namespace cpu {

// w: [N, C] words (row stride C); out: [ceil(N / P), C, P] words.
template <int64_t P, typename Word>
void pack_panels_words(const Word* w, int64_t N, int64_t C, Word* out) {
  const int64_t panels = (N + P - 1) / P;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      Word* dst = out + p * C * P;
      const int64_t rows = N - p * P < P ? N - p * P : P;
      const Word* src = w + p * P * C;
      if (rows < P) std::memset(dst, 0, sizeof(Word) * C * P);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < rows; ++j) dst[c * P + j] = src[j * C + c];
    }
  });
}

}  // namespace cpu
}  // namespace megatron_spec
