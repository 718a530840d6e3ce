// Baseline variant of the CPU kernels (x86-64 SSE2, or whatever the compiler's default is on other
// architectures): what every CPU runs.
//
// The loops are in kernels_impl.h; see kernels.h for how a variant is chosen. System headers and
// ms_math.h are included before the target region, so their inline functions stay baseline code
// (and are inlined into, then vectorised with, the loops below).
#include <stdint.h>

#include "cpu/kernels.h"
#include "ms_math.h"

#define MS_CPU_NS baseline
#define MS_CPU_TABLE kDefaultKernels
#define MS_CPU_NAME "default"
#define MS_ISA_LEVEL 0
#include "cpu/kernels_impl.h"
