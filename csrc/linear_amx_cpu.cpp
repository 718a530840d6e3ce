// The bf16 engine's linear layer at decode and verify sizes on CPUs with AMX (Intel Sapphire Rapids and
// later: AMX-TILE + AMX-BF16): y [M, N] bf16 = x [M, K] bf16 W^T (+ bias), fp32 accumulation in tiles,
// each output rounded to bf16 once (round to nearest even).
//
// Why: on an AMX CPU oneDNN's bf16 matmul runs AMX tiles (brg_matmul:avx10_1_512_amx) and vLLM's CPU build
// decoded SmolLM2 at 16 rows 1.4x faster than the AVX512-BF16 kernel (csrc/linear_bf16_cpu.cpp), which
// issues one vdpbf16ps per 16 outputs and row pair of K; a TDPBF16PS does 16 rows x 16 outputs x 32 of K
// at once. oneDNN picks other kernels for other row counts, and a row's result moves with them; this
// kernel keeps the rule the engine's kernels keep: a row is computed by the same tile instructions in the
// same order whatever M is (rows are padded to tiles of 16 with zeros, and a tile's rows never mix), so a
// verify of k + 1 tokens gives the logits k + 1 decode steps would.
//
// Layout: the panels of linear_pack_bf16 unchanged, [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16: the pairs
// of one panel are exactly the VNNI rows an AMX B tile takes (16 pairs of K a tile, 64 bytes a row), so
// one packed copy serves both kernels. Each thread takes pairs of panels; for each 16-row block of x it
// accumulates two C tiles (the pair's 32 outputs) over K in chunks of 32, sharing the A tile; a last
// chunk of fewer than 16 pairs has tail tiles of its own. Tile state is per thread: configured at the
// start of a thread's share, released at its end. Linux gives a process the AMX tile state only once
// asked (arch_prctl ARCH_REQ_XCOMP_PERM): cpu::amx_bf16_supported() asks once.
//
// Arithmetic: TDPBF16PS's own (products of bf16 pairs summed in fp32, denormals flushed); the order over K
// is fixed by the chunks, not by M, so the results are deterministic and batch-invariant, but not the bits of
// the AVX512-BF16 kernel: the tests hold both to the fp32 reference within bf16's rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "cpu/amx.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MS_LINAMX_X86 1
#endif

namespace megatron_spec {
namespace {

constexpr int64_t kPanel = 16;  // outputs a panel (a C tile's columns)
constexpr int64_t kRows = 16;   // rows of x a tile
constexpr int64_t kPairs = 16;  // pairs of K a chunk (a B tile's rows; 32 bf16 of K)

#ifdef MS_LINAMX_X86
#define MS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: C of the pair's two panels; tmm2: A; tmm3, tmm4: B of the two panels; tmm5-7: the tail chunk's
// A and Bs (rem pairs of K).
TileConfig make_config(int64_t rem) {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4}) {
    c.rows[t] = kRows;
    c.colsb[t] = 64;
  }
  if (rem) {
    c.rows[5] = kRows;
    c.colsb[5] = static_cast<uint16_t>(4 * rem);
    c.rows[6] = c.rows[7] = static_cast<uint8_t>(rem);
    c.colsb[6] = c.colsb[7] = 64;
  }
  return c;
}

// The 16 x 16 fp32 tile `acc` (+ bias) as bf16 into `rows` rows of y (row stride N), `cols` outputs.
MS_AMX_TARGET void store_tile(const float* acc, const float* bias, at::BFloat16* y, int64_t N, int64_t rows,
                              int64_t cols) {
  const __mmask16 keep = cols == kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + m * kPanel), b));
    _mm256_mask_storeu_epi16(y + m * N, keep, (__m256i)r);
  }
}

// Chunk ch of K (16 pairs; fewer in the tail tiles) into the C tiles 0 and 1: A from the row block `a`, B from
// the two panels. A macro: the intrinsics take the tile numbers as literals (GCC spells them into the asm).
#define MS_AMX_CHUNK(TA, TB0, TB1, ch)                      \
  do {                                                     \
    _tile_loadd(TA, a + (ch) * 2 * kPairs, ldx * 2);       \
    _tile_loadd(TB0, b0 + (ch) * kPairs * kPanel, 64);     \
    _tile_dpbf16ps(0, TA, TB0);                            \
    if (two) {                                             \
      _tile_loadd(TB1, b1 + (ch) * kPairs * kPanel, 64);   \
      _tile_dpbf16ps(1, TA, TB1);                          \
    }                                                      \
  } while (0)

// Panels [q0, q1) of W (in pairs: panel 2q and 2q + 1, the second possibly absent) times every row block.
MS_AMX_TARGET void amx_panels(const uint16_t* xpad, int64_t ldx, int64_t M, int64_t C, const uint16_t* wp,
                              int64_t panels, const float* bias, at::BFloat16* y, int64_t N, int64_t q0, int64_t q1) {
  const int64_t full = C / kPairs, rem = C % kPairs, panel_words = C * kPanel;  // a panel: C pairs x 16 outputs
  const TileConfig cfg = make_config(rem);
  _tile_loadconfig(&cfg);
  alignas(64) float acc[2][kRows * kPanel];
  const int64_t blocks = (M + kRows - 1) / kRows;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t p = 2 * q;
    const bool two = p + 1 < panels;
    const uint32_t* b0 = reinterpret_cast<const uint32_t*>(wp) + p * panel_words;
    const uint32_t* b1 = two ? b0 + panel_words : b0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint16_t* a = xpad + blk * kRows * ldx;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t ch = 0; ch < full; ++ch) MS_AMX_CHUNK(2, 3, 4, ch);
      if (rem) MS_AMX_CHUNK(5, 6, 7, full);  // the tail tiles: rem pairs of K
      _tile_stored(0, acc[0], 64);
      if (two) _tile_stored(1, acc[1], 64);
      const int64_t rows = std::min(kRows, M - blk * kRows);
      at::BFloat16* yb = y + blk * kRows * N + p * kPanel;
      store_tile(acc[0], bias ? bias + p * kPanel : nullptr, yb, N, rows, std::min(kPanel, N - p * kPanel));
      if (two)
        store_tile(acc[1], bias ? bias + (p + 1) * kPanel : nullptr, yb + kPanel, N, rows,
                   std::min(kPanel, N - (p + 1) * kPanel));
    }
  }
  _tile_release();
}
#endif

}  // namespace

namespace cpu {

void linear_bf16_amx(const uint16_t* xpad, int64_t ldx, int64_t M, int64_t C, const uint16_t* packed, int64_t panels,
                     const float* bias, uint16_t* y, int64_t N) {
#ifdef MS_LINAMX_X86
  auto* yb = reinterpret_cast<at::BFloat16*>(y);
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
    amx_panels(xpad, ldx, M, C, packed, panels, bias, yb, N, q0, q1);
  });
#else
  (void)xpad, (void)ldx, (void)M, (void)C, (void)packed, (void)panels, (void)bias, (void)y, (void)N;
  TORCH_CHECK(false, "linear_bf16_amx: not an x86 build");
#endif
}

}  // namespace cpu
}  // namespace megatron_spec

