// CPU kernel of the bf16 engine's linear layer at decode and verify sizes, on CPUs with bf16 dot products
// (AVX512-BF16: vdpbf16ps): y [M, N] bf16 = x [M, K] bf16 W^T (+ bias), fp32 accumulation, each output
// rounded to bf16 once (round to nearest even).
//
// Why: on a 2-core Zen 4 the oneDNN-packed bf16 matmul torch uses ran SmolLM2-135M's projections at 16
// rows in 15.8 ms a decode step, ~14 GB/s of weights against the ~20 GB/s it streams at one row
// (benchmarks/profile_engine_step.py, bench_linear_rows.py). Here each thread streams whole panels of W
// (16 outputs x K, as bf16 pairs along K) once, holding a tile of up to 8 rows x 16 outputs in 16 AVX-512
// registers (two accumulators a row: even and odd pairs of K, so the dot products of one row overlap),
// broadcasting x's pairs from L1; every further row tile of a panel finds it in L2. Tiles of two rows or
// more prefetch the thread's next panel into L2 as they go, so memory streams while the tiles compute: without
// it a panel came from memory only while its first tile ran, and the second tile of 16 rows waited on nothing
// but itself (SmolLM2's 211 matrices at 16 rows, bench_linear_rows.py: 19.1 -> 14.8 ms; the 49152 x 576 head
// 3.9 -> 2.4 ms). A one-row tile is bound by memory alone and gains nothing from it.
//
// Every row is computed by the same instructions in the same order whatever M is and whichever tile it
// falls in, so a row's result does not depend on the batch: a verify of k + 1 tokens gives the logits
// that k + 1 decode steps would (oneDNN picks other kernels for other M, and its results move with M).
//
// Layout: packed [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16, packed[p, c, j, e] = W[16 p + j, 2 c + e]
// (zero past N and K). Arithmetic per output: acc_even and acc_odd, fp32, start at 0; pair c (x[2c], x[2c+1])
// goes to acc_{c % 2} as vdpbf16ps does it (acc + x[2c+1] w[2c+1], rounded, + x[2c] w[2c], rounded;
// products exact; denormal inputs and results flushed to zero); then acc_even + acc_odd, + bias (fp32),
// rounded to bf16. The scalar variant (CPUs without AVX512-BF16, and the tests' reference) does the same
// operations with fp32 adds, without the flush: the same bits where nothing is denormal. On a CPU with AMX
// (csrc/cpu/amx.h) the op runs on AMX tiles instead, from the same panels (csrc/linear_amx_cpu.cpp): other
// bits, the same batch invariance.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_LINBF_X86 1
#endif

#include "cpu/amx.h"
#include "cpu/bf16.h"
#include "cpu/kernels.h"
#include "cpu/panels.h"

namespace megatron_spec {
namespace {

constexpr int64_t kPanel = 16;
constexpr int kMaxTile = 8;

using cpu::widen_bf16;

// Rows of x (pairs along K: C = ceil(K / 2) 32-bit words a row, row stride ldx words) times one panel.
template <int MR>
void tile_scalar(const uint32_t* x, int64_t ldx, int64_t C, const uint32_t* panel, const float* bias,
                 at::BFloat16* y, int64_t N, int64_t cols, const uint32_t*) {
  float acc[MR][2][kPanel] = {};
  for (int64_t c = 0; c < C; ++c)
    for (int m = 0; m < MR; ++m) {
      const uint32_t xp = x[m * ldx + c];
      const float x0 = widen_bf16(static_cast<uint16_t>(xp & 0xFFFF)), x1 = widen_bf16(static_cast<uint16_t>(xp >> 16));
      for (int64_t j = 0; j < kPanel; ++j) {
        const uint32_t wp = panel[c * kPanel + j];
        float& a = acc[m][c & 1][j];
        a = a + x1 * widen_bf16(static_cast<uint16_t>(wp >> 16));
        a = a + x0 * widen_bf16(static_cast<uint16_t>(wp & 0xFFFF));
      }
    }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < cols; ++j)
      y[m * N + j] = at::BFloat16(acc[m][0][j] + acc[m][1][j] + (bias ? bias[j] : 0.0f));
}

#ifdef MS_LINBF_X86
#define MS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MR>
MS_BF16_TARGET void tile_avx512bf16(const uint32_t* x, int64_t ldx, int64_t C, const uint32_t* panel,
                                    const float* bias, at::BFloat16* y, int64_t N, int64_t cols, const uint32_t* next) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= C; c += 2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + c * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (c + 1) * kPanel);
    if (MR >= 2 && next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + c * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + (c + 1) * kPanel), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + c])), w0);
      a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + c + 1])), w1);
    }
  }
  if (c < C) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + c * kPanel);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
      a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + c])), w0);
  }
  const __mmask16 keep = cols == kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), b));
    _mm256_mask_storeu_epi16(y + m * N, keep, (__m256i)r);
  }
}
#endif

using TileFn = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, const float*, at::BFloat16*, int64_t,
                        int64_t, const uint32_t*);

template <int MR>
TileFn tile_for(bool native) {
#ifdef MS_LINBF_X86
  if (native) return tile_avx512bf16<MR>;
#endif
  (void)native;
  return tile_scalar<MR>;
}

at::Tensor linear_pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "linear_pack_bf16: expects a 2-D bfloat16 CPU weight [N, K], got ", w.sizes(), " ", w.scalar_type());
  auto out = at::empty({(w.size(0) + kPanel - 1) / kPanel, (w.size(1) + 1) / 2, kPanel, 2}, w.options());
  cpu::pack_bf16_pairs_into(w, out);
  return out;
}

at::Tensor linear_small_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "linear_small_bf16: expects a 2-D bfloat16 CPU input [M, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_small_bf16: the weight must come from linear_pack_bf16 ([panels, ceil(K/2), 16, 2] bfloat16), "
              "got ", packed.sizes(), " ", packed.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0), C = packed.size(1);
  TORCH_CHECK(C == (K + 1) / 2, "linear_small_bf16: input has ", K, " features, the weight ", 2 * C, " (pairs)");
  TORCH_CHECK(N >= 0 && (N + kPanel - 1) / kPanel == panels,
              "linear_small_bf16: out_features ", N, " does not match ", panels, " panels of 16");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "linear_small_bf16: bias must be bfloat16 or float32 [", N, "]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->unsqueeze(0).expand({M, N})) : y.zero_();
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  if (cpu::amx_bf16_active()) {  // AMX tiles (csrc/linear_amx_cpu.cpp): x padded to 16-row tiles, K to 2 C
    auto xpad = at::zeros({(M + 15) / 16 * 16, 2 * C}, x.options());
    xpad.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
    cpu::linear_bf16_amx(reinterpret_cast<const uint16_t*>(xpad.data_ptr<at::BFloat16>()), 2 * C, M, C,
                         reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), panels, bp,
                         reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N);
    return y;
  }
  // x as pairs of bf16 (32-bit words): contiguous rows of even length (an odd K gets a zero column)
  at::Tensor xc = x.contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1}, 0);
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const bool native = cpu::avx512_bf16_active();
  const TileFn tiles[kMaxTile + 1] = {nullptr,        tile_for<1>(native), tile_for<2>(native), tile_for<3>(native),
                                      tile_for<4>(native), tile_for<5>(native), tile_for<6>(native),
                                      tile_for<7>(native), tile_for<8>(native)};
  // Threads split the panels: each panel (the weights of 16 outputs) is read from memory once, and every
  // row tile of it after the first finds it in L2.
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      const uint32_t* panel = wp + p * C * kPanel;
      for (int64_t m = 0; m < M;) {
        const int64_t rest = M - m, left = (rest + kMaxTile - 1) / kMaxTile, mr = (rest + left - 1) / left;
        tiles[mr](xp + m * C, C, C, panel, bp ? bp + p * kPanel : nullptr, yp + m * N + p * kPanel, N, cols,
                  p + 1 < p1 ? panel + C * kPanel : nullptr);
        m += mr;
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("linear_pack_bf16", &megatron_spec::linear_pack_bf16);
  m.impl("linear_small_bf16", &megatron_spec::linear_small_bf16);
}
