// torch binding of the fused masked log-sum-exp kernels: ops `pretrain_cuda::masked_lse_fwd/_bwd`.
//
// Registered with TORCH_LIBRARY (schema) + TORCH_LIBRARY_IMPL(CUDA). Their fake kernels, autograd and
// the device-generic op `pretrain_ops::masked_lse` that routes here live in pretrain/ops/library.py.
// Shapes: q (N, D), k (M, D), excl (N, 2) int64 (-1 = none), lse / grad (N,) fp32.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "similarity_kernels.h"

namespace pretrain_cuda {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "pretrain_cuda: q and k must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& excl) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && excl.is_cuda(), "pretrain_cuda: q, k and excl must be CUDA tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.size(1) == k.size(1), "pretrain_cuda: q and k must be (N, D) and (M, D), got ",
              q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "pretrain_cuda: q and k must share a dtype");
  TORCH_CHECK(excl.dim() == 2 && excl.size(0) == q.size(0) && excl.size(1) == 2,
              "pretrain_cuda: excl must be (N, 2), got ", excl.sizes());
}

// Split the streamed operand so that small problems still fill the GPU (about two CTAs per SM).
int choose_splits(int64_t num_owned, int64_t num_streamed) {
  const int64_t blocks = (num_owned + kTileRows - 1) / kTileRows;
  const int64_t tiles = std::max<int64_t>(1, (num_streamed + kTileRows - 1) / kTileRows);
  int device = 0, sms = 1;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = (2 * sms + blocks - 1) / blocks;
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::min<int64_t>(tiles, 16)));
}

at::Tensor masked_lse_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& excl_in, double inv_temp) {
  check_inputs(q_in, k_in, excl_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), excl = excl_in.to(at::kLong).contiguous();
  const int64_t N = q.size(0), M = k.size(0), D = q.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  if (N == 0 || M == 0) return at::full({N}, -std::numeric_limits<float>::infinity(), f32);
  const int splits = choose_splits(N, M);
  at::Tensor part = at::empty({splits, N}, f32);
  C10_CUDA_CHECK(launch_masked_lse_fwd(dtype_of(q), q.data_ptr(), k.data_ptr(), N, M, D, excl.data_ptr<int64_t>(),
                                       static_cast<float>(inv_temp), splits, part.data_ptr<float>(),
                                       c10::cuda::getCurrentCUDAStream()));
  return splits == 1 ? part.select(0, 0) : at::logsumexp(part, {0});
}

std::tuple<at::Tensor, at::Tensor> masked_lse_bwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                  const at::Tensor& excl_in, double inv_temp, const at::Tensor& lse,
                                                  const at::Tensor& grad) {
  check_inputs(q_in, k_in, excl_in);
  TORCH_CHECK(lse.numel() == q_in.size(0) && grad.numel() == q_in.size(0), "pretrain_cuda: lse and grad must be (N,)");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), excl = excl_in.to(at::kLong).contiguous();
  const int64_t N = q.size(0), M = k.size(0), D = q.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  if (N == 0 || M == 0 || D == 0) return {at::zeros_like(q), at::zeros_like(k)};
  // Rows without a live column (lse = -inf) carry no gradient; zeroing keeps exp() finite.
  const at::Tensor lse32 = lse.to(at::kFloat);
  const at::Tensor dead = at::isinf(lse32);
  const at::Tensor safe_lse = at::where(dead, at::zeros_like(lse32), lse32).contiguous();
  const at::Tensor coef_raw = at::where(dead, at::zeros_like(lse32), grad.to(at::kFloat) * inv_temp);
  // P = coef * softmax is rounded to fp16/bf16 before the tensor-core product; normalising coef by its
  // max keeps P in [-1, 1] (no fp16 underflow for mean-reduced losses). Device-side, no host sync.
  const at::Tensor coef_scale = coef_raw.abs().max().clamp_min(1e-30);
  const at::Tensor coef = (coef_raw / coef_scale).contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int q_splits = choose_splits(N, M);
  at::Tensor dq_part = at::zeros({q_splits, N, D}, f32);
  C10_CUDA_CHECK(launch_masked_lse_bwd_q(dtype_of(q), q.data_ptr(), k.data_ptr(), N, M, D, excl.data_ptr<int64_t>(),
                                         static_cast<float>(inv_temp), safe_lse.data_ptr<float>(),
                                         coef.data_ptr<float>(), q_splits, dq_part.data_ptr<float>(), stream));
  const int k_splits = choose_splits(M, N);
  at::Tensor dk_part = at::zeros({k_splits, M, D}, f32);
  C10_CUDA_CHECK(launch_masked_lse_bwd_k(dtype_of(q), q.data_ptr(), k.data_ptr(), N, M, D, excl.data_ptr<int64_t>(),
                                         static_cast<float>(inv_temp), safe_lse.data_ptr<float>(),
                                         coef.data_ptr<float>(), k_splits, dk_part.data_ptr<float>(), stream));
  at::Tensor dq = ((q_splits == 1 ? dq_part.select(0, 0) : dq_part.sum(0)) * coef_scale).to(q.scalar_type());
  at::Tensor dk = ((k_splits == 1 ? dk_part.select(0, 0) : dk_part.sum(0)) * coef_scale).to(k.scalar_type());
  return {dq, dk};
}

}  // namespace
}  // namespace pretrain_cuda

TORCH_LIBRARY(pretrain_cuda, m) {
  m.def("masked_lse_fwd(Tensor q, Tensor k, Tensor excl, float inv_temp) -> Tensor");
  m.def("masked_lse_bwd(Tensor q, Tensor k, Tensor excl, float inv_temp, Tensor lse, Tensor grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pretrain_cuda, CUDA, m) {
  m.impl("masked_lse_fwd", &pretrain_cuda::masked_lse_fwd);
  m.impl("masked_lse_bwd", &pretrain_cuda::masked_lse_bwd);
}

// `import pretrain._C` only has to load this library (the ops register statically); give Python an
// empty module to import. JIT builds (is_python_module=False) never call this.
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define PRETRAIN_STR_(x) #x
#define PRETRAIN_STR(x) PRETRAIN_STR_(x)
#define PRETRAIN_CAT_(a, b) a##b
#define PRETRAIN_CAT(a, b) PRETRAIN_CAT_(a, b)
PyMODINIT_FUNC PRETRAIN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, PRETRAIN_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
