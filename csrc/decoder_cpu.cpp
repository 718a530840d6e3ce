// The native engine's decoder layers at decode and verify sizes, run from C++ (fp32 and bf16 CPU engines):
// a stack of pre-norm Llama / Qwen2 layers (RMSNorm, fused q/k/v projection with optional bias, rotate-half
// RoPE, the KV-cache write, grouped-query attention, o projection, residual, RMSNorm, fused gate/up
// projection, SwiGLU, down projection, residual) over one segment of b x t rows, in one call.
//
// Why: with the extension's kernels a decode step of SmolLM2-135M (30 layers) spends more time between the
// ops than in most of them: ~45 tensor ops a layer called from Python (views, splits, the cache write, the
// residual adds) cost 3-4 ms of a 14 ms batch-1 decode and of a 23 ms batch-16 decode on a 2-core Zen 4
// (benchmarks/profile_engine_step.py, "between ops"). Here the same ops run in the same order from C++.
//
// The bits are those of the Python layer (megatron_spec.layers.decoder.DecoderLayer.forward_flat with one
// plan, the extension's kernels and the 16-output panels of Linear.pack): every step below is the op the
// Python layer calls, with the same arguments and layouts (a test compares the two bit for bit).
// megatron_spec.layers.fused_layers.fused_stack says when the Python layers may hand over (CausalLM._run_fused).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace megatron_spec {
namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);
using NormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using AttnFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The extension's kernels for one dtype, looked up once.
struct Kernels {
  c10::TypedOperatorHandle<LinearFn> linear;
  c10::TypedOperatorHandle<NormFn> norm;
  c10::TypedOperatorHandle<RopeFn> rope;
  c10::TypedOperatorHandle<AttnFn> attention;
};

const Kernels& kernels(at::ScalarType dtype) {
  static const Kernels f32{op<LinearFn>("megatron_spec::linear_small_f32"), op<NormFn>("megatron_spec::rms_norm_f32"),
                           op<RopeFn>("megatron_spec::rope_f32"), op<AttnFn>("megatron_spec::attention_f32")};
  static const Kernels bf16{op<LinearFn>("megatron_spec::linear_small_bf16"),
                            op<NormFn>("megatron_spec::rms_norm_bf16"), op<RopeFn>("megatron_spec::rope_bf16"),
                            op<AttnFn>("megatron_spec::attention_bf16")};
  return dtype == at::kBFloat16 ? bf16 : f32;
}

constexpr int64_t kPerLayer = 6;  // input norm, qkv panels, o panels, post-attention norm, gate/up panels, down panels

// x [b * t, H] through layers 0..n-1 of the lists; returns x after the last one and after each layer in aux.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(
    const at::Tensor& x_in, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& qkv_bias,
    at::TensorList cache_k, at::TensorList cache_v, const at::Tensor& write_index, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& mask, int64_t b, int64_t t, int64_t read_len, int64_t slot_offset,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
    at::IntArrayRef aux_layers) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decoder_layers: expects float32 or bfloat16, got ", dtype);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == b * t && x_in.device().is_cpu(),
              "decoder_layers: x must be a CPU [b * t, H] tensor, got ", x_in.sizes());
  const int64_t n = static_cast<int64_t>(cache_k.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(cache_v.size()) == n &&
                  static_cast<int64_t>(weights.size()) == kPerLayer * n && static_cast<int64_t>(qkv_bias.size()) == n,
              "decoder_layers: ", n, " layers need ", kPerLayer * n, " weights, ", n, " biases and ", n,
              " value caches; got ", weights.size(), ", ", qkv_bias.size(), ", ", cache_v.size());
  for (const int64_t a : aux_layers) TORCH_CHECK(a >= 0 && a < n, "decoder_layers: aux layer ", a, " not in 0..", n - 1);
  const int64_t H = x_in.size(1), d = head_dim, nq = num_heads, nkv = num_kv_heads;
  const Kernels& kern = kernels(dtype);
  std::vector<at::Tensor> aux;
  at::Tensor x = x_in;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    // attention block (Attention.attend)
    const at::Tensor qkv = kern.linear.call(kern.norm.call(x, w[0], eps), w[1], qkv_bias.get(i), (nq + 2 * nkv) * d)
                               .view({b, t, (nq + 2 * nkv) * d});
    const auto parts = qkv.split_with_sizes({(nq + nkv) * d, nkv * d}, -1);
    const auto qk = kern.rope.call(parts[0].view({b, t, nq + nkv, d}).transpose(1, 2), cos, sin)
                        .split_with_sizes({nq, nkv}, 1);
    const at::Tensor v = parts[1].view({b, t, nkv, d}).transpose(1, 2);
    cache_k[i].view({-1, d}).index_copy_(0, write_index, qk[1].reshape({-1, d}));  // KVCache.write
    cache_v[i].view({-1, d}).index_copy_(0, write_index, v.reshape({-1, d}));
    const at::Tensor k_all = cache_k[i].slice(0, slot_offset, slot_offset + b).slice(2, 0, read_len);
    const at::Tensor v_all = cache_v[i].slice(0, slot_offset, slot_offset + b).slice(2, 0, read_len);
    const at::Tensor o = kern.attention.call(qk[0], k_all, v_all, mask, scale).transpose(1, 2).reshape({b * t, nq * d});
    x = at::add(x, kern.linear.call(o, w[2], std::nullopt, H));
    // MLP block
    const auto gate_up = kern.linear.call(kern.norm.call(x, w[3], eps), w[4], std::nullopt, 2 * intermediate).chunk(2, -1);
    x = at::add(x, kern.linear.call(at::mul(at::silu(gate_up[0]), gate_up[1]), w[5], std::nullopt, H));
    for (const int64_t a : aux_layers)
      if (a == i) aux.push_back(x);
  }
  return {x, aux};
}

}  // namespace
}  // namespace megatron_spec

TORCH_LIBRARY_IMPL(megatron_spec, CPU, m) { m.impl("decoder_layers", &megatron_spec::decoder_layers); }
