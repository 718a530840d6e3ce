// AVX2 variant of the CPU kernels (Haswell / Zen 1-3 and later), with F16C for float16 inputs.
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
#pragma clang attribute push(__attribute__((target("avx2,f16c,bmi,bmi2,popcnt,lzcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,bmi,bmi2,popcnt,lzcnt")
#endif

#define MS_CPU_NS avx2
#define MS_CPU_TABLE kAvx2Kernels
#define MS_CPU_NAME "avx2"
#define MS_ISA_LEVEL 1
#include "cpu/kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // MS_CPU_DISPATCH_X86
