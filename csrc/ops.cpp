// The one schema file of the megatron_spec operator library (pytorch/extension-cpp layout).
//
// Schemas only: CPU implementations live in csrc/*_cpu.cpp, CUDA ones in csrc/cuda/, fake (meta)
// kernels and the pure-PyTorch references in megatron_spec/ops/. Every op here has a reference that
// is its fallback and its test oracle.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>

#include "cpu/amx.h"
#include "cpu/kernels.h"

namespace {
namespace cpu = megatron_spec::cpu;

// The CPU kernel variant in use (csrc/cpu/kernels.h): "default", "avx2" or "avx512".
PyObject* py_kernel_isa(PyObject*, PyObject*) { return PyUnicode_FromString(cpu::isa_name(cpu::active_isa())); }

// The highest variant this CPU runs, before the environment's cap.
PyObject* py_best_kernel_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(cpu::isa_name(cpu::best_supported_isa()));
}

// Test hook: run another variant from now on (ValueError if unknown or above what the CPU runs).
PyObject* py_set_kernel_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  cpu::Isa isa;
  if (!cpu::parse_isa(name, &isa)) {
    PyErr_Format(PyExc_ValueError, "kernel ISA must be one of default, avx2, avx512, got '%s'", name);
    return nullptr;
  }
  try {
    cpu::set_active_isa(isa);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// Whether the bf16 linear kernel runs its AVX512-BF16 tiles (else its scalar loops: the layers then keep oneDNN).
PyObject* py_bf16_dot_active(PyObject*, PyObject*) { return PyBool_FromLong(cpu::avx512_bf16_active()); }

// Whether linear_small_bf16 runs on AMX tiles, whether it could here, and the tests' switch.
PyObject* py_amx_active(PyObject*, PyObject*) { return PyBool_FromLong(cpu::amx_bf16_active()); }
PyObject* py_amx_supported(PyObject*, PyObject*) { return PyBool_FromLong(cpu::amx_bf16_supported()); }

// A switch set from a Python truth value; one the CPU cannot run (std::invalid_argument) raises ValueError.
template <void (*Set)(bool)>
PyObject* py_set_switch(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  try {
    Set(on != 0);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// Whether linear_small_f32 runs its AVX-512 tiles (else its AVX2 or scalar tiles).
PyObject* py_fp32_avx512_tiles(PyObject*, PyObject*) { return PyBool_FromLong(cpu::fp32_avx512_tiles_active()); }

PyMethodDef methods[] = {
    {"kernel_isa", py_kernel_isa, METH_NOARGS, "CPU kernel variant in use: 'default', 'avx2' or 'avx512'."},
    {"best_kernel_isa", py_best_kernel_isa, METH_NOARGS, "Highest CPU kernel variant this CPU runs."},
    {"set_kernel_isa", py_set_kernel_isa, METH_O, "Run the CPU kernel variant of this name (tests)."},
    {"bf16_dot_active", py_bf16_dot_active, METH_NOARGS, "Whether linear_small_bf16 runs AVX512-BF16 dot products."},
    {"amx_active", py_amx_active, METH_NOARGS, "Whether linear_small_bf16 runs on AMX tiles."},
    {"amx_supported", py_amx_supported, METH_NOARGS, "Whether this CPU and OS run AMX-BF16 tiles."},
    {"set_amx", py_set_switch<cpu::set_amx_enabled>, METH_O,
     "Run linear_small_bf16 on AMX tiles (True) or AVX512-BF16 (False): tests."},
    {"fp32_avx512_tiles", py_fp32_avx512_tiles, METH_NOARGS, "Whether linear_small_f32 runs its AVX-512 tiles."},
    {"set_fp32_avx512_tiles", py_set_switch<cpu::set_fp32_avx512_tiles>, METH_O,
     "Run linear_small_f32 on its AVX-512 tiles (True) or its AVX2 tiles (False) under the AVX-512 variant."},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" {
// `import megatron_spec._C` loads this shared object, which runs the TORCH_LIBRARY registrations.
// The ops are reached through torch.ops.megatron_spec; the module itself only reports (and, for
// tests, sets) which CPU kernel variant runs (megatron_spec._ext.kernel_isa).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "megatron_spec compiled ops (see torch.ops.megatron_spec)", -1, methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(megatron_spec, m) {
  // FP8 E4M3 data crosses these ops as raw bytes (uint8; float8_e4m3fn views are accepted as
  // inputs): float8 tensors lack basic CPU ops (torch.allclose, mul) that torch.library.opcheck and
  // other generic tooling run on op arguments. megatron_spec.ops returns float8_e4m3fn views.
  //
  // w [N, K] float32/bfloat16/float16 -> (w_fp8 e4m3 bytes uint8 [N, K],
  //                                        weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)])
  m.def("fp8_block_quantize(Tensor w, int block_n, int block_k) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  // Same, written into preallocated contiguous outputs (e.g. views into a flattened weight bucket).
  m.def(
      "fp8_block_quantize_out(Tensor w, int block_n, int block_k, *, Tensor(a!) out, Tensor(b!) scale_inv) -> ()",
      {at::Tag::pt2_compliant_tag});
  // (w_fp8 e4m3 bytes [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)]) -> w [N, K] of `dtype`
  m.def(
      "fp8_block_dequantize(Tensor w_fp8, Tensor scale_inv, int block_n, int block_k, "
      "ScalarType dtype) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Chain verification of k drafted tokens per row, uniforms given:
  //   target_logprobs [B, k+1, V] f32, draft_tokens [B, k] i64 (target ids, <0 ends the chain),
  //   draft_probs [B, k, Vd] f32 or None (point mass), d2t [Vd] i64 or None, greedy [B] bool,
  //   u_accept [B, k] f64, u_sample [B] f64
  //   -> (tokens [B, k+1] i64 padded with -1, num_accepted [B] i64)
  m.def(
      "verify_chain(Tensor target_logprobs, Tensor draft_tokens, Tensor? draft_probs, Tensor? d2t, "
      "Tensor greedy, Tensor u_accept, Tensor u_sample) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  // The weight-sync fingerprint's sums (csrc/fingerprint_cpu.cpp): bits [n] int8/16/32/64 -> [2] int64,
  // sum(b) and sum(b * b) mod 2**64
  m.def("bits_sums(Tensor bits) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   the same sums while copying bits into dst [n] (same dtype, contiguous): one pass for a copy and its sums
  m.def("bits_sums_copy(Tensor bits, Tensor(a!) dst) -> Tensor", {at::Tag::pt2_compliant_tag});
  // The verifier's float32 exp of log-probabilities (exposed so tests can compare it bit for bit).
  m.def("spec_exp(Tensor x) -> Tensor", {at::Tag::pt2_compliant_tag});
  // The fp32 linear layer of the native engine at decode and verify sizes (csrc/linear_cpu.cpp):
  //   w [N, K] f32 -> packed [ceil(N/16), K, 16] f32 (16-output column panels, zero past N)
  m.def("linear_pack_f32(Tensor w) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   w [N, K] f32 whose values are all bf16 numbers -> the same panels stored in bf16 (exact; half the bytes)
  m.def("linear_pack_bf16w(Tensor w) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   w, packed from one of the three packs above or linear_pack_bf16 -> packed rewritten with w's panels
  m.def("linear_pack_into(Tensor w, Tensor(a!) packed) -> ()", {at::Tag::pt2_compliant_tag});
  //   the same, returning the fingerprint's sums of w's bits ([2] int64, as bits_sums) taken in the same pass
  m.def("linear_pack_into_sums(Tensor w, Tensor(a!) packed) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   x [M, K] f32, packed from linear_pack_f32 or linear_pack_bf16w, bias [N] f32 or None -> y [M, N] = x W^T + bias
  m.def("linear_small_f32(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // The bf16 linear layer at decode and verify sizes on CPUs with bf16 dot products (csrc/linear_bf16_cpu.cpp):
  //   w [N, K] bf16 -> packed [ceil(N/16), ceil(K/2), 16, 2] bf16 (16-output panels of K pairs, zero-padded)
  m.def("linear_pack_bf16(Tensor w) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   x [M, K] bf16, packed from linear_pack_bf16, bias [N] bf16/f32 or None -> y [M, N] bf16 (fp32 accumulation)
  m.def("linear_small_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // The fp32 grouped-query attention of the native engine (csrc/attention_cpu.cpp): q [b, nq, t, d],
  // k and v [b, nkv, L, d] (cache views: any strides, contiguous d), mask [b, 1, t, L] bool -> [b, nq, t, d]
  m.def("attention_f32(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  //   the same over bf16 q, k, v (fp32 arithmetic inside, each output rounded to bf16 once)
  m.def("attention_bf16(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // The engine's fp32 RMSNorm and rotate-half RoPE (csrc/norm_rope_cpu.cpp): x [..., H] (last dim
  // contiguous), w [H] -> y = x / sqrt(mean(x^2) + eps) * w, contiguous;
  m.def("rms_norm_f32(Tensor x, Tensor w, float eps) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   x [B, n, T, d] (contiguous d), cos, sin [B, 1, T, d] -> x * cos + cat(-x[d/2:], x[:d/2]) * sin, contiguous
  m.def("rope_f32(Tensor x, Tensor cos, Tensor sin) -> Tensor", {at::Tag::pt2_compliant_tag});
  //   the same two over bf16 tensors, rounding to bf16 where torch's bf16 arithmetic rounds
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("rope_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor", {at::Tag::pt2_compliant_tag});
  // A stack of the engine's decoder layers over one segment of b x t rows, the ops above called from C++
  // (csrc/decoder_cpu.cpp): x [b * t, H] f32/bf16; weights, 6 a layer: input norm [H], qkv panels, o panels,
  // post-attention norm [H], gate/up panels, down panels (linear_pack_f32 / _bf16w / _bf16); qkv_bias one a
  // layer or None; cache_k / cache_v [slots, nkv, capacity, d] a layer (written at write_index, rows of their
  // [-1, d] views); cos, sin [b, 1, t, d]; mask [b, 1, t, read_len] -> (x after the last layer, x after each
  // of aux_layers, indices into the lists)
  m.def(
      "decoder_layers(Tensor x, Tensor[] weights, Tensor?[] qkv_bias, Tensor(a!)[] cache_k, Tensor(b!)[] cache_v, "
      "Tensor write_index, Tensor cos, Tensor sin, Tensor mask, int b, int t, int read_len, int slot_offset, "
      "int num_heads, int num_kv_heads, int head_dim, int intermediate, float eps, float scale, int[] aux_layers) "
      "-> (Tensor, Tensor[])");
}
