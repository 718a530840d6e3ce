// The bf16 linear kernel on AMX tiles (csrc/linear_amx_cpu.cpp) and whether it runs here (csrc/cpu/dispatch.cpp).
// Raw pointers only, as kernels.h: the op glue (csrc/linear_bf16_cpu.cpp) checks, allocates and pads.
#pragma once

#include <stdint.h>

namespace megatron_spec {
namespace cpu {

// y [M, N] bf16 = x W^T (+ bias fp32) on AMX tiles. xpad: x as bf16, rows of ldx = 2 C values (K padded with a
// zero to even), ceil(M / 16) * 16 rows (zeros past M); packed: linear_pack_bf16's [panels, C, 16, 2] panels.
void linear_bf16_amx(const uint16_t* xpad, int64_t ldx, int64_t M, int64_t C, const uint16_t* packed, int64_t panels,
                     const float* bias, uint16_t* y, int64_t N);

// Whether linear_small_bf16 runs on AMX tiles: the CPU has AMX-TILE and AMX-BF16, Linux granted this process the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once), the AVX512-BF16 kernels are active (so
// MEGATRON_SPEC_NO_NATIVE_BF16=1 turns it off too), MEGATRON_SPEC_NO_AMX is not set and set_amx_enabled(false)
// was not called.
bool amx_bf16_active();
bool amx_bf16_supported();  // the CPU and the OS allow it (before the switches)
void set_amx_enabled(bool on);  // the tests' hook; throws std::invalid_argument for on where it is not supported

}  // namespace cpu
}  // namespace megatron_spec
