// Torch binding of the CUDA kernels: TORCH_LIBRARY_IMPL(megatron_spec, CUDA, ...).
//
// Built only when torch has CUDA (setup.py); the kernels themselves are torch-free in
// csrc/cuda/*.cu behind csrc/cuda/launchers.h. This file checks arguments exactly as the CPU
// kernels do, runs on the current stream of the input's device, and turns the kernels' status words
// into the same Python exceptions (one small device-to-host copy per verify call, after the kernel).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/launchers.h"
#include "ms_math.h"

namespace megatron_spec {
namespace {

cuda::FloatKind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::FloatKind::kF32;
    case at::kBFloat16: return cuda::FloatKind::kBF16;
    case at::kHalf: return cuda::FloatKind::kF16;
    default:
      TORCH_CHECK_VALUE(false, "megatron_spec fp8 ops support float32, bfloat16 and float16, got ", t);
  }
}

// FP8 data crosses the op boundary as e4m3 bytes (uint8); float8_e4m3fn views are accepted too.
bool is_fp8_bytes(const at::Tensor& t) {
  return t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e4m3fn;
}

// Every tensor argument on the first one's device: the dispatcher picks this kernel when any argument is
// on a GPU, and a host tensor beside it would reach the kernel as a host pointer (an illegal-address error
// that kills the process) instead of an exception naming it.
void check_device(const char* op, const char* name, const at::Tensor& t, const char* first, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), ", ", first, " on ", device,
                    "; every tensor argument must be on one device");
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "megatron_spec ", what, " launch failed: ", cudaGetErrorString(err));
}

void fp8_block_quantize_out_cuda(const at::Tensor& w, int64_t block_n, int64_t block_k, at::Tensor& out,
                                 at::Tensor& scale_inv) {
  TORCH_CHECK_VALUE(block_n > 0 && block_k > 0, "megatron_spec fp8 block size must be positive, got [", block_n,
                    ", ", block_k, "]");
  TORCH_CHECK_VALUE(w.dim() == 2, "fp8_block_quantize expects a 2-D weight [N, K], got shape ", w.sizes());
  check_device("fp8_block_quantize", "out", out, "w", w.device());
  check_device("fp8_block_quantize", "scale_inv", scale_inv, "w", w.device());
  const cuda::FloatKind kind = kind_of(w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t sn = (N + block_n - 1) / block_n, sk = (K + block_k - 1) / block_k;
  TORCH_CHECK_VALUE(is_fp8_bytes(out) && out.dim() == 2 && out.size(0) == N &&
                        out.size(1) == K && out.is_contiguous() && out.device() == w.device(),
                    "fp8_block_quantize: out must be a contiguous uint8 / float8_e4m3fn [", N, ", ", K, "] on ", w.device());
  TORCH_CHECK_VALUE(scale_inv.scalar_type() == at::kFloat && scale_inv.dim() == 2 && scale_inv.size(0) == sn &&
                        scale_inv.size(1) == sk && scale_inv.is_contiguous() && scale_inv.device() == w.device(),
                    "fp8_block_quantize: scale_inv must be a contiguous float32 [", sn, ", ", sk, "] on ",
                    w.device());
  TORCH_CHECK_VALUE(sn <= 65535, "fp8_block_quantize: too many block rows for one grid");
  const c10::cuda::CUDAGuard guard(w.device());
  if (N == 0 || K == 0) {
    scale_inv.zero_();
    return;
  }
  const at::Tensor wc = w.contiguous();
  check_cuda(cuda::launch_fp8_block_quantize(wc.data_ptr(), kind, N, K, block_n, block_k,
                                             reinterpret_cast<uint8_t*>(out.data_ptr()), scale_inv.data_ptr<float>(),
                                             c10::cuda::getCurrentCUDAStream()),
             "fp8_block_quantize");
}

std::tuple<at::Tensor, at::Tensor> fp8_block_quantize_cuda(const at::Tensor& w, int64_t block_n, int64_t block_k) {
  TORCH_CHECK_VALUE(block_n > 0 && block_k > 0, "megatron_spec fp8 block size must be positive, got [", block_n,
                    ", ", block_k, "]");
  TORCH_CHECK_VALUE(w.dim() == 2, "fp8_block_quantize expects a 2-D weight [N, K], got shape ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kByte));  // e4m3 bytes
  at::Tensor scale = at::empty({(N + block_n - 1) / block_n, (K + block_k - 1) / block_k},
                               w.options().dtype(at::kFloat));
  fp8_block_quantize_out_cuda(w, block_n, block_k, out, scale);
  return {out, scale};
}

at::Tensor fp8_block_dequantize_cuda(const at::Tensor& w_fp8, const at::Tensor& scale_inv, int64_t block_n,
                                     int64_t block_k, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(block_n > 0 && block_k > 0, "megatron_spec fp8 block size must be positive, got [", block_n,
                    ", ", block_k, "]");
  TORCH_CHECK_VALUE(w_fp8.dim() == 2 && is_fp8_bytes(w_fp8),
                    "fp8_block_dequantize expects a 2-D uint8 / float8_e4m3fn weight, got ", w_fp8.scalar_type(),
                    " of shape ", w_fp8.sizes());
  const int64_t N = w_fp8.size(0), K = w_fp8.size(1);
  const int64_t sn = (N + block_n - 1) / block_n, sk = (K + block_k - 1) / block_k;
  TORCH_CHECK_VALUE(scale_inv.dim() == 2 && scale_inv.size(0) == sn && scale_inv.size(1) == sk &&
                        scale_inv.scalar_type() == at::kFloat,
                    "fp8_block_dequantize expects float32 weight_scale_inv of shape [", sn, ", ", sk, "], got ",
                    scale_inv.scalar_type(), " of shape ", scale_inv.sizes());
  check_device("fp8_block_dequantize", "scale_inv", scale_inv, "w_fp8", w_fp8.device());
  const cuda::FloatKind kind = kind_of(dtype);
  const c10::cuda::CUDAGuard guard(w_fp8.device());
  const at::Tensor qc = w_fp8.contiguous();
  const at::Tensor sc = scale_inv.contiguous();
  at::Tensor out = at::empty({N, K}, qc.options().dtype(dtype));
  check_cuda(cuda::launch_fp8_block_dequantize(reinterpret_cast<const uint8_t*>(qc.data_ptr()),
                                               sc.data_ptr<float>(), N, K, block_n, block_k, kind, out.data_ptr(),
                                               c10::cuda::getCurrentCUDAStream()),
             "fp8_block_dequantize");
  return out;
}

at::Tensor spec_exp_cuda(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "spec_exp expects float32, got ", x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  check_cuda(cuda::launch_spec_exp(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel(),
                                   c10::cuda::getCurrentCUDAStream()),
             "spec_exp");
  return out;
}

std::tuple<at::Tensor, at::Tensor> verify_chain_cuda(const at::Tensor& target_logprobs, const at::Tensor& draft_tokens,
                                                     const c10::optional<at::Tensor>& draft_probs,
                                                     const c10::optional<at::Tensor>& d2t, const at::Tensor& greedy,
                                                     const at::Tensor& u_accept, const at::Tensor& u_sample) {
  TORCH_CHECK_VALUE(target_logprobs.dim() == 3 && target_logprobs.scalar_type() == at::kFloat,
                    "verify_chain: target_logprobs must be float32 [B, k+1, V], got ", target_logprobs.scalar_type(),
                    " of shape ", target_logprobs.sizes());
  const int64_t B = target_logprobs.size(0), K1 = target_logprobs.size(1), V = target_logprobs.size(2);
  TORCH_CHECK_VALUE(K1 >= 1, "verify_chain: target_logprobs needs k+1 >= 1 positions, got ", K1);
  const int64_t k = K1 - 1;
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(0) == B && draft_tokens.size(1) == k &&
                        draft_tokens.scalar_type() == at::kLong,
                    "verify_chain: draft_tokens must be int64 [", B, ", ", k, "], got ", draft_tokens.scalar_type(),
                    " of shape ", draft_tokens.sizes());
  TORCH_CHECK_VALUE(greedy.dim() == 1 && greedy.size(0) == B && greedy.scalar_type() == at::kBool,
                    "verify_chain: greedy must be bool [", B, "]");
  TORCH_CHECK_VALUE(u_accept.dim() == 2 && u_accept.size(0) == B && u_accept.size(1) == k &&
                        u_accept.scalar_type() == at::kDouble,
                    "verify_chain: u_accept must be float64 [", B, ", ", k, "]");
  TORCH_CHECK_VALUE(u_sample.dim() == 1 && u_sample.size(0) == B && u_sample.scalar_type() == at::kDouble,
                    "verify_chain: u_sample must be float64 [", B, "]");
  const bool has_q = draft_probs.has_value(), has_map = d2t.has_value();
  TORCH_CHECK_VALUE(!has_map || has_q, "verify_chain: d2t given without draft_probs");
  int64_t Vd = V;
  if (has_map) {
    TORCH_CHECK_VALUE(d2t->dim() == 1 && d2t->scalar_type() == at::kLong, "verify_chain: d2t must be int64 [Vd]");
    Vd = d2t->size(0);
  }
  if (has_q) {
    TORCH_CHECK_VALUE(draft_probs->dim() == 3 && draft_probs->size(0) == B && draft_probs->size(1) == k &&
                          draft_probs->size(2) == Vd && draft_probs->scalar_type() == at::kFloat,
                      "verify_chain: draft_probs must be float32 [", B, ", ", k, ", ", Vd, "], got ",
                      draft_probs->scalar_type(), " of shape ", draft_probs->sizes());
  }
  const at::Device dev = target_logprobs.device();
  check_device("verify_chain", "draft_tokens", draft_tokens, "target_logprobs", dev);
  check_device("verify_chain", "greedy", greedy, "target_logprobs", dev);
  check_device("verify_chain", "u_accept", u_accept, "target_logprobs", dev);
  check_device("verify_chain", "u_sample", u_sample, "target_logprobs", dev);
  if (has_q) check_device("verify_chain", "draft_probs", *draft_probs, "target_logprobs", dev);
  if (has_map) check_device("verify_chain", "d2t", *d2t, "target_logprobs", dev);
  const c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor tokens = at::full({B, K1}, -1, draft_tokens.options());
  at::Tensor num_accepted = at::zeros({B}, draft_tokens.options());
  if (B == 0) return {tokens, num_accepted};
  TORCH_CHECK_VALUE(V > 0, "verify_chain: empty vocabulary (V = 0) with ", B, " rows");
  TORCH_CHECK_VALUE(B * k + B < cuda::kNoError, "verify_chain: batch too large for int32 status words");

  const at::Tensor lp = target_logprobs.contiguous();
  const at::Tensor dt = draft_tokens.contiguous();
  const at::Tensor g = greedy.contiguous();
  const at::Tensor ua = u_accept.contiguous();
  const at::Tensor us = u_sample.contiguous();
  const at::Tensor q = has_q ? draft_probs->contiguous() : at::Tensor();
  at::Tensor status = at::full({cuda::kNumStatus}, cuda::kNoError, lp.options().dtype(at::kInt));
  at::Tensor t2d;
  check_cuda(cuda::launch_verify_validate(dt.data_ptr<int64_t>(), ua.data_ptr<double>(), us.data_ptr<double>(), B, k,
                                          V, status.data_ptr<int32_t>(), stream),
             "verify_chain validation");
  if (has_map) {
    const at::Tensor m = d2t->contiguous();
    t2d = at::full({V}, -1, lp.options().dtype(at::kInt));
    check_cuda(cuda::launch_build_t2d(m.data_ptr<int64_t>(), Vd, V, t2d.data_ptr<int32_t>(),
                                      status.data_ptr<int32_t>(), stream),
               "verify_chain d2t");
  }
  // Validation must finish before the kernel reads tokens through them: copy the status words now.
  at::Tensor st = status.cpu();
  const int32_t* s = st.data_ptr<int32_t>();
  TORCH_CHECK_INDEX(s[cuda::kBadToken] == cuda::kNoError, "verify_chain: draft_tokens[",
                    s[cuda::kBadToken] / (k > 0 ? k : 1), ", ", s[cuda::kBadToken] % (k > 0 ? k : 1),
                    "] is outside the target vocabulary [0, ", V, ")");
  TORCH_CHECK_VALUE(s[cuda::kBadUAccept] == cuda::kNoError, "verify_chain: u_accept must lie in [0, 1) (flat index ",
                    s[cuda::kBadUAccept], ")");
  TORCH_CHECK_VALUE(s[cuda::kBadUSample] == cuda::kNoError, "verify_chain: u_sample must lie in [0, 1) (row ",
                    s[cuda::kBadUSample], ")");
  TORCH_CHECK_VALUE(s[cuda::kBadD2tRange] == cuda::kNoError, "verify_chain: d2t maps draft id ",
                    s[cuda::kBadD2tRange], " outside the target vocabulary [0, ", V, ")");
  TORCH_CHECK_VALUE(s[cuda::kD2tCollision] == cuda::kNoError, "verify_chain: d2t maps two draft ids to target id ",
                    s[cuda::kD2tCollision]);

  const int64_t nC = (V + kSampleChunk - 1) / kSampleChunk;
  at::Tensor scratch = at::empty({B, 2 * nC}, lp.options().dtype(at::kDouble));
  at::Tensor row_err = at::empty({B, 4}, lp.options().dtype(at::kDouble));
  check_cuda(cuda::launch_verify_chain(lp.data_ptr<float>(), dt.data_ptr<int64_t>(),
                                       has_q ? q.data_ptr<float>() : nullptr,
                                       has_map ? t2d.data_ptr<int32_t>() : nullptr, Vd, g.data_ptr<bool>(),
                                       ua.data_ptr<double>(), us.data_ptr<double>(), B, k, V,
                                       scratch.data_ptr<double>(), tokens.data_ptr<int64_t>(),
                                       num_accepted.data_ptr<int64_t>(), status.data_ptr<int32_t>(),
                                       row_err.data_ptr<double>(), stream),
             "verify_chain");
  // One host sync for the status words; the row_err of the first bad row only when there is one. The
  // messages are the CPU kernel's (csrc/verify_cpu.cpp), so both devices fail the same way.
  const at::Tensor st2 = status.cpu();
  const int32_t no_mass = st2.data_ptr<int32_t>()[cuda::kNoMass];
  const int32_t bad = st2.data_ptr<int32_t>()[cuda::kBadInput];
  if (bad != cuda::kNoError && bad < no_mass) {
    const at::Tensor e = row_err[bad].cpu();
    const double* ep = e.data_ptr<double>();
    const int kind = static_cast<int>(ep[0]);
    const int64_t i = static_cast<int64_t>(ep[1]), tok = static_cast<int64_t>(ep[2]);
    const double val = ep[3];
    TORCH_CHECK_VALUE(kind != cuda::kRowGreedyNaN, "verify_chain: target_logprobs[", bad, ", ", i,
                      "] contains NaN (greedy row); log-probs must be finite or -inf");
    TORCH_CHECK_VALUE(kind != cuda::kRowBadDraftP, "verify_chain: target_logprobs[", bad, ", ", i, ", ", tok, "] = ",
                      val, " is not a log-probability (NaN, or above 0); pass normalised log-probs "
                      "(process_logits / log_softmax), not raw logits");
    TORCH_CHECK_VALUE(kind != cuda::kRowBadGreedyMax, "verify_chain: target_logprobs[", bad, ", ", i,
                      "] is not normalised: its largest probability is ", val, ", outside [1/V, 1] (V = ", V,
                      ", tolerance ", kMassTol, "); pass log-probs (process_logits / log_softmax), not raw logits");
    TORCH_CHECK_VALUE(val == val, "verify_chain: target_logprobs[", bad, ", ", i, "] contains NaN");
    TORCH_CHECK_VALUE(val != 0.0, "verify_chain: target_logprobs[", bad, ", ", i,
                      "] has no probability mass (every log-prob is -inf)");
    TORCH_CHECK_VALUE(false, "verify_chain: target_logprobs[", bad, ", ", i, "] is not normalised: its probabilities sum to ",
                      val, ", not 1 (tolerance ", kMassTol, "); pass log-probs (process_logits / log_softmax), not raw logits");
  }
  TORCH_CHECK_VALUE(no_mass == cuda::kNoError, "verify_chain: row ", no_mass,
                    " has no probability mass at its sampled position (every log-prob is -inf or NaN)");
  return {tokens, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_spec, CUDA, m) {
  m.impl("fp8_block_quantize", &fp8_block_quantize_cuda);
  m.impl("fp8_block_quantize_out", &fp8_block_quantize_out_cuda);
  m.impl("fp8_block_dequantize", &fp8_block_dequantize_cuda);
  m.impl("spec_exp", &spec_exp_cuda);
  m.impl("verify_chain", &verify_chain_cuda);
}

}  // namespace megatron_spec
