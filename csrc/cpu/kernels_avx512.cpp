// AVX-512 (F, BW, VL, DQ) variant of the CPU kernels (Skylake-X / Zen 4 and later).
//
// The loops are in kernels_impl.h; see kernels.h for how a variant is chosen. System headers and
// ms_math.h are included before the target region, so their inline functions stay baseline code
// (and are inlined into, then vectorised with, the loops below).
#include <stdint.h>

#include "cpu/kernels.h"
#include "ms_math.h"

#if defined(MS_CPU_DISPATCH_X86)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,bmi,bmi2,popcnt,lzcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,bmi,bmi2,popcnt,lzcnt")
#endif

#define MS_CPU_NS avx512
#define MS_CPU_TABLE kAvx512Kernels
#define MS_CPU_NAME "avx512"
#define MS_ISA_LEVEL 2
#include "cpu/kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // MS_CPU_DISPATCH_X86
