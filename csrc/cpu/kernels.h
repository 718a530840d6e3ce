// The CPU hot loops, compiled once per instruction set and chosen at run time (one binary for every
// x86-64 CPU, as PyTorch's own CPU kernels are: aten/src/ATen/native/DispatchStub.h).
//
// csrc/cpu/kernels_impl.h holds the loops; csrc/cpu/kernels_{default,avx2,avx512}.cpp compile it under
// `#pragma GCC target(...)` into one `KernelTable` each, in its own namespace (so no inline function
// compiled for AVX-512 can be merged with, and then run in place of, the baseline one). The op glue
// (csrc/fp8_cpu.cpp, csrc/verify_cpu.cpp) checks arguments, allocates and threads, then calls through
// `cpu::kernels()`, the table csrc/cpu/dispatch.cpp picked from cpuid, capped by the environment:
//
//   * MEGATRON_SPEC_NO_NATIVE_BF16=1 (megatron_spec.isa: run this machine as an AVX2 CPU) -> avx2;
//   * ATEN_CPU_CAPABILITY=avx2 / default (PyTorch's own cap, honoured the same way)   -> avx2 / default.
//
// Every variant computes the same bits (ms_math.h; the tests run each one against the references).
// This header knows nothing about tensors or threads: raw pointers, lengths and scratch buffers only.
#pragma once

#include <stdint.h>

namespace megatron_spec {
namespace cpu {

// Ordered: a variant runs on every CPU that runs a higher one.
enum class Isa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// ---- FP8 block quantisation -------------------------------------------------------------------
// One work unit: `rows` rows (one block row) times `nc` columns (whole column blocks of width bk,
// the last one possibly short). w and out point at the unit's first element, ld is the row stride
// (K) of both; scale_out at the unit's first scale of its block row. Scratch: colmax holds nc
// values (of the input's bit width), mult and finite ceil(nc / bk).
template <typename T>
using QuantizeUnitFn = void (*)(const T* w, uint8_t* out, int64_t ld, int64_t rows, int64_t nc, int64_t bk,
                                float* scale_out, uint32_t* colmax, float* mult, uint8_t* finite);
// One row of K dequantised values: out[c] = fp8(q[c]) * srow[c / bk] in the output format.
template <typename T>
using DequantizeRowFn = void (*)(const uint8_t* q, const float* srow, int64_t K, int64_t bk, T* out);

// ---- Chain verification -----------------------------------------------------------------------
constexpr int64_t kTileChunks = 8;  // chunk sums of 8 chunks run as 8 independent add chains

// Where the draft distribution q of one position comes from (verify_cpu.cpp).
struct QSource {
  const float* q = nullptr;      // [Vd] draft probabilities at this position (dense / mapped)
  const int32_t* t2d = nullptr;  // [V] target id -> draft id or -1 (mapped)
  int64_t x = -1;                // the drafted token (point mass)
};

// Inverse-CDF draw of a token from max(0, p - q) (q = 0: from p). prefix holds ceil(V / 256)
// doubles, rbuf kTileChunks * 256 doubles, pbuf kTileChunks * 256 floats. Returns -1 when the
// residual has no mass; writes the mass of p itself (sum of exp(lp), the input check) to *mass.
using SampleResidualFn = int64_t (*)(const float* lp, const QSource& s, int64_t V, double u, double* prefix,
                                     double* rbuf, float* pbuf, double* mass);

template <typename T>
using BitsSumsFn = void (*)(const T* b, int64_t n, uint64_t* out);
template <typename T>
using BitsSumsCopyFn = void (*)(const T* b, T* dst, int64_t n, uint64_t* out);  // also dst[i] = b[i]

struct KernelTable {
  const char* name;  // "default", "avx2", "avx512" (ATEN_CPU_CAPABILITY's words)
  QuantizeUnitFn<float> quantize_unit_f32;
  QuantizeUnitFn<uint16_t> quantize_unit_bf16;
  QuantizeUnitFn<uint16_t> quantize_unit_f16;
  DequantizeRowFn<float> dequantize_row_f32;
  DequantizeRowFn<uint16_t> dequantize_row_bf16;
  DequantizeRowFn<uint16_t> dequantize_row_f16;
  SampleResidualFn sample_p;       // q = 0: sample p itself
  SampleResidualFn sample_dense;   // q dense over the target vocabulary
  SampleResidualFn sample_mapped;  // q over a draft vocabulary, reached through t2d
  SampleResidualFn sample_point;   // q a point mass at x
  int64_t (*argmax_first)(const float* x, int64_t V);  // lowest index of the max; -1 if x has a NaN
  void (*spec_exp)(const float* x, float* out, int64_t n);
  // ---- Weight-sync fingerprint (fingerprint_cpu.cpp): out[0] += sum(b), out[1] += sum(b * b), mod 2**64
  BitsSumsFn<int8_t> bits_sums_i8;
  BitsSumsFn<int16_t> bits_sums_i16;
  BitsSumsFn<int32_t> bits_sums_i32;
  BitsSumsFn<int64_t> bits_sums_i64;
  // the same sums while copying the bits to dst (one pass: a sync's load or pack and its fingerprint)
  BitsSumsCopyFn<int8_t> bits_sums_copy_i8;
  BitsSumsCopyFn<int16_t> bits_sums_copy_i16;
  BitsSumsCopyFn<int32_t> bits_sums_copy_i32;
  BitsSumsCopyFn<int64_t> bits_sums_copy_i64;
  // ---- The linear kernels' 16-row panels of 32-bit words (csrc/cpu/panels.h's layout: out[p, c, j] = w[16 p + j, c],
  // zero past N) written from w [N, C] with the fingerprint's sums of w's words added to out_sums, in one pass
  // (linear_cpu.cpp's linear_pack_into_sums: an engine's re-pack of lent weights and their checksum)
  void (*pack_panels16_sums_u32)(const uint32_t* w, int64_t N, int64_t C, uint32_t* out, uint64_t* out_sums);
};

extern const KernelTable kDefaultKernels;
#if defined(__x86_64__) || defined(_M_X64)
#define MS_CPU_DISPATCH_X86 1
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
#endif

// The table in use (chosen on first call, see dispatch.cpp) and the test hooks behind
// megatron_spec._ext.kernel_isa / set_kernel_isa.
const KernelTable& kernels();
Isa active_isa();
Isa best_supported_isa();  // what this CPU runs, before any environment cap
const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* out);
void set_active_isa(Isa isa);  // throws std::invalid_argument above best_supported_isa()
// The hand-written AVX2 kernels outside the table (linear_cpu.cpp, attention_cpu.cpp) also need FMA
// (every AVX2 CPU made has it; checked anyway) and follow the same cap as the table.
bool avx2_fma_active();
// bf16 dot products (AVX512-BF16's vdpbf16ps: linear_bf16_cpu.cpp) where the CPU has them and the AVX-512
// variant is active (MEGATRON_SPEC_NO_NATIVE_BF16=1 caps the kernels at AVX2, and so turns this off).
bool avx512_bf16_active();
bool fp32_avx512_tiles_active();   // the fp32 linear kernel's AVX-512 tiles (else its AVX2 tiles, the same bits)
void set_fp32_avx512_tiles(bool on);  // the tests' and benchmarks' hook; throws where there is no AVX-512

}  // namespace cpu
}  // namespace megatron_spec
