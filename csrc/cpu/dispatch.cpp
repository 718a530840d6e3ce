// Picks the CPU kernel variant (kernels.h) once per process: the highest one this CPU runs (cpuid,
// through GCC's __builtin_cpu_supports, which also checks that the OS saves the AVX / AVX-512 state),
// capped by the environment as megatron_spec.isa and PyTorch cap their own code:
//
//   MEGATRON_SPEC_NO_NATIVE_BF16=1   -> at most avx2 (run this machine as an AVX2 CPU);
//   ATEN_CPU_CAPABILITY=avx2|default -> at most avx2|default (PyTorch's switch for its own kernels).
//
// The package sets ATEN_CPU_CAPABILITY=avx2 itself when the first switch is set (megatron_spec/__init__.py);
// both are read here too so the kernels follow the switch however the process was started.
// set_active_isa() is the tests' hook for running every variant in one process. AMX (amx.h) is a switch of its
// own above the AVX-512 variant: MEGATRON_SPEC_NO_AMX=1, or set_amx_enabled(false), keeps the vdpbf16ps kernel.
// So is the fp32 linear kernel's tile under the AVX-512 variant (fp32_avx512_tiles_active()): its AVX-512 tiles,
// or its AVX2 tiles (the same bits) on a CPU that runs 512-bit vectors as two 256-bit halves.
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cpu/amx.h"
#include "cpu/kernels.h"

#if defined(MS_CPU_DISPATCH_X86) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace megatron_spec {
namespace cpu {
namespace {

bool env_truthy(const char* name) {
  const char* v = getenv(name);
  if (v == nullptr) return false;
  std::string s(v);
  for (auto& ch : s) ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  s = b == std::string::npos ? "" : s.substr(b, e - b + 1);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

Isa detect() {
#if defined(MS_CPU_DISPATCH_X86) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                    __builtin_cpu_supports("popcnt");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 ? Isa::kAvx512 : (avx2 ? Isa::kAvx2 : Isa::kDefault);
#else
  return Isa::kDefault;
#endif
}

Isa env_cap() {
  Isa cap = Isa::kAvx512;
  if (env_truthy("MEGATRON_SPEC_NO_NATIVE_BF16")) cap = Isa::kAvx2;
  if (const char* aten = getenv("ATEN_CPU_CAPABILITY")) {
    Isa parsed;
    if (parse_isa(aten, &parsed) && parsed < cap) cap = parsed;
  }
  return cap;
}

const KernelTable* table_for(Isa isa) {
#if defined(MS_CPU_DISPATCH_X86)
  if (isa == Isa::kAvx512) return &kAvx512Kernels;
  if (isa == Isa::kAvx2) return &kAvx2Kernels;
#endif
  (void)isa;
  return &kDefaultKernels;
}

Isa initial_isa() {
  const Isa best = best_supported_isa(), cap = env_cap();
  return cap < best ? cap : best;
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(initial_isa())};
  return isa;
}

}  // namespace

Isa best_supported_isa() {
  static const Isa best = detect();
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kDefault: break;
  }
  return "default";
}

bool parse_isa(const char* name, Isa* out) {
  std::string s(name);
  for (auto& ch : s) ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  if (s == "default") {
    *out = Isa::kDefault;
  } else if (s == "avx2") {
    *out = Isa::kAvx2;
  } else if (s == "avx512") {
    *out = Isa::kAvx512;
  } else {
    return false;  // e.g. ATEN_CPU_CAPABILITY=zvector: no cap on x86 kernels
  }
  return true;
}

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

const KernelTable& kernels() { return *table_for(active_isa()); }

bool avx2_fma_active() {
#ifdef MS_CPU_DISPATCH_X86
  static const bool fma = __builtin_cpu_supports("fma");
  return fma && active_isa() >= Isa::kAvx2;
#else
  return false;
#endif
}

bool avx512_bf16_active() {
#ifdef MS_CPU_DISPATCH_X86
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  return bf16 && active_isa() >= Isa::kAvx512;
#else
  return false;
#endif
}

bool amx_bf16_supported() {
#if defined(MS_CPU_DISPATCH_X86) && defined(__linux__)
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    // Linux hands a process the AMX tile state only when asked (kernel 5.16+); asking twice is harmless
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

namespace {
std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> on{!env_truthy("MEGATRON_SPEC_NO_AMX")};
  return on;
}
}  // namespace

bool amx_bf16_active() {
  return amx_enabled().load(std::memory_order_relaxed) && avx512_bf16_active() && amx_bf16_supported();
}

void set_amx_enabled(bool on) {
  if (on && !amx_bf16_supported())
    throw std::invalid_argument("megatron_spec kernels: this CPU (or its OS) does not run AMX-BF16 tiles");
  amx_enabled().store(on, std::memory_order_relaxed);
}

namespace {
// False where 512-bit vectors run as two 256-bit halves (AMD Zen 4): the fp32 linear kernel's default tiles.
bool avx512_full_width() {
#if defined(MS_CPU_DISPATCH_X86) && defined(__GNUC__)
  // AMD family 0x19 with AVX-512 (Zen 4) splits every 512-bit operation into two 256-bit halves: there the fp32
  // linear kernel's AVX2 tiles (one broadcast feeding two ymm FMAs, up to 6 rows) ran SmolLM2's projections in
  // 0.90-0.97x the AVX-512 tiles' time at 1-16 rows, and its decode forward 0.97x (benchmarks/bench_linear_rows.py,
  // docs/benchmark_log.md, 2026-12-07). Intel's AVX-512 CPUs (Ice Lake, Sapphire Rapids) run full-width vectors:
  // 1.2-1.5x there.
  static const bool full = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
    const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return true;
    const unsigned family = ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
    return family != 0x19;
  }();
  return full;
#else
  return false;
#endif
}

std::atomic<bool>& fp32_avx512_tiles() {
  // MEGATRON_SPEC_FP32_TILES=avx512|avx2 overrides what the CPU suggests (benchmarks compare both)
  static std::atomic<bool> on{[] {
    const char* v = getenv("MEGATRON_SPEC_FP32_TILES");
    Isa forced;
    if (v != nullptr && parse_isa(v, &forced)) return forced == Isa::kAvx512;
    return avx512_full_width();
  }()};
  return on;
}
}  // namespace

bool fp32_avx512_tiles_active() {
  return fp32_avx512_tiles().load(std::memory_order_relaxed) && active_isa() >= Isa::kAvx512;
}

void set_fp32_avx512_tiles(bool on) {
  if (on && best_supported_isa() < Isa::kAvx512)
    throw std::invalid_argument("megatron_spec kernels: this CPU runs no AVX-512 tiles");
  fp32_avx512_tiles().store(on, std::memory_order_relaxed);
}

void set_active_isa(Isa isa) {
  if (isa > best_supported_isa())
    throw std::invalid_argument(std::string("megatron_spec kernels: this CPU cannot run the ") + isa_name(isa) +
                                " variant (it runs up to " + isa_name(best_supported_isa()) + ")");
  active().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace cpu
}  // namespace megatron_spec
