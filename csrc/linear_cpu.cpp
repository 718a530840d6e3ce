// CPU kernel of the engine's fp32 linear layer at decode and verify sizes: y [M, N] = x [M, K] W^T
// (+ bias), M a decode or verify batch (up to 128 rows), W prepacked in column panels of 16 outputs.
//
// Why: at these row counts a decoder step is the weights read once, and the oneDNN-packed fp32 matmul
// torch uses reads them at ~12 GB/s on a 2-core AVX2 EPYC whose cores read memory at ~19 GB/s
// (benchmarks/profile_engine_step.py); with 4 rows oneDNN falls to ~7 GB/s. Here each thread streams
// whole panels of W (16 outputs x K, contiguous) once, keeping a tile of up to 6 rows x 16 outputs of
// the result in twelve AVX registers and broadcasting x from L1/L2; every further row tile of a panel
// finds it in L2 (on AVX-512 a tile is up to 12 rows x 32 outputs of two panels, one zmm register a row and
// panel: tile_avx512).
// Over SmolLM2-135M's 121 projections and its head (fp32, same machine), against
// oneDNN: 1.4-1.9x faster at 1-10 rows, 1.6x at 16, 1.2-1.3x at 32-64, 1.07x at 128, even at 256, so the
// caller (megatron_spec/layers/linear.py, SMALL_MAX_ROWS) sends up to 128 rows here and prefills to
// oneDNN. The rows are cut into balanced tiles (8 rows: 4 + 4, not 6 + 2: a 2-row tile has too few
// independent accumulators to keep both FMA pipes busy). Tiles of two rows or more prefetch the thread's
// next panel into L2 as they go (as linear_bf16_cpu.cpp does), so the weights stream while the later row
// tiles of a panel compute: on a 2-core Zen 4, SmolLM2's matrices at 16 rows 35.2 -> 25.9 ms (0.95x -> 1.31x
// oneDNN, bench_linear_rows.py).
//
// Layout: packed [ceil(N / 16), K, 16] float32, packed[p, k, j] = W[16 p + j, k] (zero past N); or the
// same in bfloat16 (linear_pack_bf16w) where every weight is a bf16 number, widened exactly in the tile:
// the same products in the same order, so the same bits, from half the bytes (1.8x at 1 row, 1.2x at 16
// over SmolLM2's matrices on the 2-core EPYC: benchmarks/bench_linear_rows.py).
// Arithmetic: every output is sum_k x[m, k] * W[n, k] accumulated in k order with fused multiply-adds
// (AVX2 + FMA), or in k order with separate multiply and add elsewhere: not the bits of torch's matmul
// (which blocks K differently), the same up to rounding; tests compare within fp32 tolerance.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_LINEAR_X86 1
#endif

#include "cpu/bf16.h"
#include "cpu/kernels.h"
#include "cpu/panels.h"

namespace megatron_spec {
namespace {

constexpr int64_t kPanel = 16;

// The weights come as float32 panels or as bfloat16 panels of weights that are bf16 values (most
// checkpoints are stored in bf16; widening is exact, so a product is the same float either way and the
// two layouts give the same bits): half the bytes to stream, which is what a decode step of a few rows
// waits for. w_at / load8 widen one weight / eight.
inline float w_at(const float* p) { return *p; }
inline float w_at(const uint16_t* p) { return cpu::widen_bf16(*p); }

// Rows m0..m0+MR-1 of x times one panel: scalar, k in order (the fallback for CPUs without AVX2).
template <int MR, typename WT>
void tile_scalar(const float* x, int64_t K, const WT* panel, float* y, int64_t N, int64_t cols, const WT*) {
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * K + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[m][j] += xv * w_at(panel + k * kPanel + j);
    }
  for (int m = 0; m < MR; ++m) std::copy(acc[m], acc[m] + cols, y + m * N);
}

#ifdef MS_LINEAR_X86
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) { return cpu::widen8_bf16(p); }

template <int MR, typename WT>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t K, const WT* panel, float* y,
                                                    int64_t N, int64_t cols, const WT* next) {
  // Every loop over m is unrolled so that lo / hi live in registers: without the pragmas GCC keeps the
  // arrays on the stack and stores all 2 MR accumulators every k (one 256-bit store a cycle: the tile
  // ran at half its FMA rate from 6 rows on).
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
    if (MR >= 2 && next) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      lo[m] = _mm256_fmadd_ps(xb, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xb, w1, hi[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    if (cols == kPanel) {
      _mm256_storeu_ps(y + m * N, lo[m]);
      _mm256_storeu_ps(y + m * N + 8, hi[m]);
    } else {
      alignas(32) float t[kPanel];
      _mm256_store_ps(t, lo[m]);
      _mm256_store_ps(t + 8, hi[m]);
      std::copy(t, t + cols, y + m * N);
    }
  }
}

// The same tile on AVX-512: one zmm accumulator holds a row's 16 outputs of a panel (two ymm above), and a tile
// computes NP = 2 consecutive panels at a time, so each broadcast of x feeds two multiply-adds and each row of x is
// read once for 32 outputs; each output is still one fused multiply-add chain over k in order, lane for lane the
// AVX2 tile's: the same bits (tests/ops/test_ops_linear.py). Why: a core with two 512-bit FMA units (Intel Xeon:
// Ice Lake, Sapphire Rapids; 163 against 67-100 GFLOP/s for 256-bit FMAs on one core of the Ice Lake measured)
// does twice the AVX2 tile's multiply-adds a cycle, and 16 rows and more of fp32 (a batch's decode, a verify)
// wait for them more than for the weights; one panel at a time, 17 loads a k for 16 multiply-adds kept the tile
// at ~1/3 of that. SmolLM2's 211 matrices on a 2-core Ice Lake Xeon, time of the AVX2 tile over this one
// (bench_linear_rows.py; paired medians of 14, alternated): 1.31 / 1.12 / 1.39 / 1.50 / 1.50x at 1 / 4 / 16 / 64
// / 128 rows from bf16 panels, 1.03 / 0.97 / 1.16 / 1.27 / 1.36x from fp32 panels (one panel at a time:
// 1.07-1.29x at 1-64 rows, 0.94x at 128).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
// GCC 12's avx512fintrin.h starts these intrinsics from _mm512_undefined_epi32() and then warns
// (-Wmaybe-uninitialized, a false positive: every lane is written) in every tile the function is inlined into.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#pragma GCC diagnostic pop

// NP panels side by side (consecutive in memory, NP x 16 outputs): each x broadcast feeds NP multiply-adds.
template <int MR, int NP, typename WT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void tile_avx512(
    const float* x, int64_t K, const WT* panel, float* y, int64_t N, int64_t cols, const WT* next) {
  __m512 acc[NP][MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) acc[q][m] = _mm512_setzero_ps();
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      w[q] = load16(panel + q * stride + k * kPanel);
      if ((MR >= 2 || NP > 1) && next)
        _mm_prefetch(reinterpret_cast<const char*>(next + q * stride + k * kPanel), _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) acc[q][m] = _mm512_fmadd_ps(xb, w[q], acc[q][m]);
    }
  }
  const __mmask16 keep = cols == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q)
      _mm512_mask_storeu_ps(y + m * N + q * kPanel, q + 1 < NP ? __mmask16(0xFFFF) : keep, acc[q][m]);
}
#endif

template <typename WT>
using TileFn = void (*)(const float*, int64_t, const WT*, float*, int64_t, int64_t, const WT*);

enum class Tile { kScalar, kAvx2, kAvx512 };

Tile tile_kind() {
  // The variant cap (MEGATRON_SPEC_NO_NATIVE_BF16, ATEN_CPU_CAPABILITY) applies as to every kernel here; under the
  // AVX-512 variant the AVX2 tiles where 512-bit vectors run as two halves (cpu::fp32_avx512_tiles_active).
  if (cpu::fp32_avx512_tiles_active()) return Tile::kAvx512;
  return cpu::avx2_fma_active() ? Tile::kAvx2 : Tile::kScalar;
}

// The AVX-512 tile's most rows over one panel (a thread's last panel when it has an odd number; the AVX2 and scalar
// tiles take up to 6): 16 accumulators and the panel's load in 17 of the 32 zmm registers (at 16 / 64 rows 1.24-1.29
// / 1.17-1.18x the AVX2 tile against 1.00-1.18 / 0.96-0.99x with 12, one panel at a time, on the Ice Lake Xeon).
constexpr int kMaxRows = 16;

// The tile of MR rows over NP panels for `kind`: two panels only on AVX-512 (nullptr elsewhere).
template <int MR, int NP, typename WT>
TileFn<WT> tile_for(Tile kind) {
#ifdef MS_LINEAR_X86
  if (kind == Tile::kAvx512) return tile_avx512<MR, NP, WT>;
  if constexpr (MR <= 6 && NP == 1) {
    if (kind == Tile::kAvx2) return tile_avx2<MR, WT>;
  }
#endif
  (void)kind;
  if constexpr (MR <= 6 && NP == 1) return tile_scalar<MR, WT>;
  return nullptr;
}

template <int NP, typename WT, int... MR>
void tile_table(Tile kind, TileFn<WT>* out, std::integer_sequence<int, MR...>) {
  ((out[MR] = MR == 0 ? nullptr : tile_for<(MR == 0 ? 1 : MR), NP, WT>(kind)), ...);
}

constexpr int kMaxRowsPair = 12;  // the two-panel AVX-512 tile's: 24 accumulators and two panel loads in registers

std::vector<int64_t> row_tiles(int64_t M, int64_t max_rows) {  // balanced: 8 rows at most 6 a tile as 4 + 4
  std::vector<int64_t> starts{0};
  for (int64_t m = 0; m < M;) {
    const int64_t rest = M - m, left = (rest + max_rows - 1) / max_rows;
    starts.push_back(m += (rest + left - 1) / left);
  }
  return starts;
}

// packed[p, k, j] = w[16 p + j, k] into `out` [ceil(N / 16), K, 16] (contiguous), zero past N, from an fp32 w: into
// fp32 panels, or into bf16 panels (the values' upper halves; refused unless every value is a bf16 number, when
// `out` is left unspecified).
void pack_panels_into(const at::Tensor& w, at::Tensor& out) {
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  if (N == 0 || K == 0) {
    out.zero_();
    return;
  }
  if (out.scalar_type() == at::kFloat) {
    cpu::pack_panels_words<kPanel>(reinterpret_cast<const uint32_t*>(wc.data_ptr()), N, K,
                                   reinterpret_cast<uint32_t*>(out.data_ptr()));
  } else {
    const uint32_t dropped = cpu::pack_panels_words<kPanel>(
        reinterpret_cast<const uint32_t*>(wc.data_ptr()), N, K, reinterpret_cast<uint16_t*>(out.data_ptr()),
        [](uint32_t v) { return static_cast<uint16_t>(v >> 16); }, 0xFFFFu);
    TORCH_CHECK(dropped == 0, "linear_pack_bf16w: the weight holds values that are not bfloat16 numbers "
                "(bf16 panels would round them; use linear_pack_f32)");
  }
}

at::Tensor pack_panels(const at::Tensor& w, at::ScalarType dtype) {
  auto out = at::empty({(w.size(0) + kPanel - 1) / kPanel, w.size(1), kPanel}, w.options().dtype(dtype));
  pack_panels_into(w, out);
  return out;
}

at::Tensor linear_pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "linear_pack_f32: expects a 2-D float32 CPU weight [N, K], got ", w.sizes(), " ", w.scalar_type());
  return pack_panels(w, at::kFloat);
}

at::Tensor linear_pack_bf16w(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "linear_pack_bf16w: expects a 2-D float32 CPU weight [N, K], got ", w.sizes(), " ", w.scalar_type());
  // every value a bf16 number (checked in the same pass), so its upper half is the value: f32 panels in bf16
  return pack_panels(w, at::kBFloat16);
}

// linear_pack_f32 / _bf16w / linear_pack_bf16 into the panels a layer already holds (`packed`'s dtype and
// rank say which), so a weight sync re-packs without allocating: a fresh copy of SmolLM2's panels cost ~55,000
// page faults a sync in fp32 (the 49152 x 576 head is above glibc's mmap threshold and comes back as new pages).
void linear_pack_into(const at::Tensor& w, at::Tensor packed) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && packed.device().is_cpu() && packed.is_contiguous(),
              "linear_pack_into: expects a 2-D CPU weight and contiguous CPU panels, got ", w.sizes(), " and ",
              packed.sizes());
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  if (packed.dim() == 4) {  // linear_pack_bf16's [panels, ceil(K / 2), 16, 2]
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                    packed.sizes() == at::IntArrayRef({panels, (K + 1) / 2, kPanel, 2}),
                "linear_pack_into: a bfloat16 weight [", N, ", ", K, "] packs into [", panels, ", ", (K + 1) / 2,
                ", 16, 2] bfloat16 panels, got ", packed.sizes(), " ", packed.scalar_type());
    cpu::pack_bf16_pairs_into(w, packed);
    return;
  }
  TORCH_CHECK(packed.dim() == 3 && packed.sizes() == at::IntArrayRef({panels, K, kPanel}) &&
                  w.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "linear_pack_into: a float32 weight [", N, ", ", K, "] packs into [", panels, ", ", K, ", 16] float32 or "
              "bfloat16 panels, got ", packed.sizes(), " ", packed.scalar_type(), " from ", w.scalar_type());
  pack_panels_into(w, packed);
}

// linear_pack_into, and the weight-sync fingerprint's sums of w's bits (csrc/fingerprint_cpu.cpp: [2] int64, sum(b)
// and sum(b * b) mod 2**64, b read as signed integers of w's width) in the same pass: the rows of a few panels are
// summed right after they are packed, from cache. Why: an engine computing with a lent bucket's weights
// (megatron_spec/rollout/native/hf_weights.py) re-packs them after every sync and must report the checksum of what
// it holds; a separate read pass for the sums cost 0.066 s of a 0.16 s SmolLM2 sync (2-core AVX2 EPYC), run while
// the trainer packed the next bucket on the other core.
at::Tensor linear_pack_into_sums(const at::Tensor& w, at::Tensor packed) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "linear_pack_into_sums: expects a contiguous 2-D float32 or bfloat16 weight, got ", w.sizes(), " ",
              w.scalar_type(), w.is_contiguous() ? "" : " (strided)");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() >= 1 && packed.size(0) == panels, "linear_pack_into_sums: a weight of ", N,
              " rows packs into ", panels, " panels, got ", packed.sizes());
  auto out = at::zeros({2}, w.options().dtype(at::kLong));
  if (N == 0 || K == 0) {
    linear_pack_into(w, packed);
    return out;
  }
  const int64_t width = w.element_size();
  // panels a task: their rows (~128 KiB) still in L2 when summed
  const int64_t per = std::max<int64_t>(1, (int64_t{1} << 17) / (kPanel * K * width));
  const int64_t tasks = (panels + per - 1) / per;
  std::vector<uint64_t> part(2 * tasks, 0);
  const cpu::KernelTable& k = cpu::kernels();
  const char* base = static_cast<const char*>(w.data_ptr());
  // fp32 panels of an fp32 weight: packed and summed from the same registers (the kernel table's, per ISA)
  const bool words = w.scalar_type() == at::kFloat && packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                     packed.sizes() == at::IntArrayRef({panels, K, kPanel}) && packed.is_contiguous();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p0 = t * per, p1 = std::min(panels, p0 + per), r0 = p0 * kPanel, r1 = std::min(N, p1 * kPanel);
      if (words) {
        k.pack_panels16_sums_u32(reinterpret_cast<const uint32_t*>(base) + r0 * K, r1 - r0, K,
                                 reinterpret_cast<uint32_t*>(packed.data_ptr<float>()) + p0 * K * kPanel,
                                 &part[2 * t]);
        continue;
      }
      linear_pack_into(w.narrow(0, r0, r1 - r0), packed.narrow(0, p0, p1 - p0));  // inline: in a parallel region
      const char* rows = base + r0 * K * width;
      if (width == 4)
        k.bits_sums_i32(reinterpret_cast<const int32_t*>(rows), (r1 - r0) * K, &part[2 * t]);
      else
        k.bits_sums_i16(reinterpret_cast<const int16_t*>(rows), (r1 - r0) * K, &part[2 * t]);
    }
  });
  uint64_t s1 = 0, s2 = 0;
  for (int64_t t = 0; t < tasks; ++t) {
    s1 += part[2 * t];
    s2 += part[2 * t + 1];
  }
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  o[0] = s1;
  o[1] = s2;
  return out;
}

template <typename WT>
void run_tiles(const float* xp, const WT* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t panels) {
  const Tile kind = tile_kind();
  const int64_t max_rows = kind == Tile::kAvx512 ? kMaxRows : 6;
  TileFn<WT> tiles[kMaxRows + 1];
  tile_table<1, WT>(kind, tiles, std::make_integer_sequence<int, kMaxRows + 1>{});
  const std::vector<int64_t> starts = row_tiles(M, max_rows);
  TileFn<WT> pairs[kMaxRowsPair + 1];
  const bool paired = kind == Tile::kAvx512;
  if (paired) tile_table<2, WT>(kind, pairs, std::make_integer_sequence<int, kMaxRowsPair + 1>{});
  const std::vector<int64_t> pair_starts = paired ? row_tiles(M, kMaxRowsPair) : std::vector<int64_t>{};
  // Threads split the panels: each panel (the weights of 16 outputs) is read from memory once, and
  // every row tile of it after the first finds it in L2. On AVX-512 two panels at a time.
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1;) {
      const int64_t np = paired && p + 1 < p1 ? 2 : 1, cols = std::min(kPanel, N - (p + np - 1) * kPanel);
      const WT* panel = wp + p * K * kPanel;
      const WT* next = p + np < p1 ? panel + np * K * kPanel : nullptr;
      const auto& st = np == 2 ? pair_starts : starts;
      for (size_t t = 0; t + 1 < st.size(); ++t) {
        const int64_t m = st[t];
        (np == 2 ? pairs : tiles)[st[t + 1] - m](xp + m * K, K, panel, yp + m * N + p * kPanel, N, cols, next);
      }
      p += np;
    }
  });
}

at::Tensor linear_small_f32(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "linear_small_f32: expects a 2-D float32 CPU input [M, K], got ", x.sizes(), " ", x.scalar_type());
  const bool bf16w = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && (packed.scalar_type() == at::kFloat || bf16w) &&
                  packed.is_contiguous(),
              "linear_small_f32: the weight must come from linear_pack_f32 or linear_pack_bf16w ([panels, K, 16] "
              "float32 or bfloat16), got ", packed.sizes(), " ", packed.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "linear_small_f32: input has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(N >= 0 && (N + kPanel - 1) / kPanel == panels,
              "linear_small_f32: out_features ", N, " does not match ", panels, " panels of 16");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "linear_small_f32: bias must be float32 [", N, "]");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->unsqueeze(0).expand({M, N})) : y.zero_();
  if (bf16w)
    run_tiles(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
              y.data_ptr<float>(), M, K, N, panels);
  else
    run_tiles(xc.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), M, K, N, panels);
  if (bias.has_value()) y.add_(bias->unsqueeze(0));
  return y;
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) {
  m.impl("linear_pack_f32", &megatron_spec::linear_pack_f32);
  m.impl("linear_small_f32", &megatron_spec::linear_small_f32);
  m.impl("linear_pack_bf16w", &megatron_spec::linear_pack_bf16w);
  m.impl("linear_pack_into", &megatron_spec::linear_pack_into);
  m.impl("linear_pack_into_sums", &megatron_spec::linear_pack_into_sums);
}
