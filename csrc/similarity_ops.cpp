// torch binding of the fused masked log-sum-exp (cuBLAS score chunks + the fused softmax kernels): ops `pretrain_cuda::masked_lse_fwd/_bwd`.
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
#include <torch/version.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "similarity_kernels.h"

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 8)
#error "pretrain's CUDA extension needs torch >= 2.8 (at::mm with an fp32 out_dtype for fp16/bf16 inputs)"
#endif

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

// Column chunk of the streamed k: wide enough that each cuBLAS product runs near its peak (C >= 1024 and
// >= 4*D, so the (N, C) score chunk costs about as much to write as to compute), small enough that the
// fp32 scores plus the P chunk (N*C*(4 + elem) bytes) stay within a few O(N*D) buffers.
int64_t chunk_cols(int64_t M, int64_t D) {
  const int64_t c = (std::max<int64_t>(1024, 4 * D) + 7) / 8 * 8;
  return std::min(c, M);
}

// fp32 scores q k_c^T: tensor cores with fp32 accumulation and an fp32 result for fp16/bf16 (cuBLAS'
// mixed-precision GEMM); plain fp32 GEMM (TF32 only if the user enabled it) for fp32.
at::Tensor scores(const at::Tensor& q, const at::Tensor& kc) {
  if (q.scalar_type() == at::kFloat) return at::mm(q, kc.t());
  return at::mm(q, kc.t(), at::kFloat);
}

at::Tensor mm_f32(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat) return at::mm(a, b);
  return at::mm(a, b, at::kFloat);
}

at::Tensor masked_lse_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& excl_in, double inv_temp) {
  check_inputs(q_in, k_in, excl_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), excl = excl_in.to(at::kLong).contiguous();
  const int64_t N = q.size(0), M = k.size(0), D = q.size(1);
  at::Tensor lse = at::full({N}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat));
  if (N == 0 || M == 0) return lse;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t C = chunk_cols(M, D);
  for (int64_t col0 = 0; col0 < M; col0 += C) {
    const int64_t c = std::min(C, M - col0);
    const at::Tensor s = scores(q, k.narrow(0, col0, c));
    C10_CUDA_CHECK(launch_chunk_lse(s.data_ptr<float>(), N, c, s.stride(0), excl.data_ptr<int64_t>(), col0,
                                    static_cast<float>(inv_temp), lse.data_ptr<float>(), stream));
  }
  return lse;
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
  // P = coef * softmax is rounded to fp16/bf16 before the tensor-core products; normalising coef by its
  // max keeps P in [-1, 1] (no fp16 underflow for mean-reduced losses). Device-side, no host sync.
  const at::Tensor coef_scale = coef_raw.abs().max().clamp_min(1e-30);
  const at::Tensor coef = (coef_raw / coef_scale).contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor dq = at::zeros({N, D}, f32);
  at::Tensor dk = at::empty({M, D}, f32);
  const int64_t C = chunk_cols(M, D);
  at::Tensor p_buf = at::empty({N * C}, q.options());
  for (int64_t col0 = 0; col0 < M; col0 += C) {
    const int64_t c = std::min(C, M - col0);
    const at::Tensor kc = k.narrow(0, col0, c);
    const at::Tensor s = scores(q, kc);
    const at::Tensor p = p_buf.narrow(0, 0, N * c).view({N, c});
    C10_CUDA_CHECK(launch_chunk_grad(dtype_of(q), s.data_ptr<float>(), N, c, s.stride(0), excl.data_ptr<int64_t>(),
                                     col0, static_cast<float>(inv_temp), safe_lse.data_ptr<float>(),
                                     coef.data_ptr<float>(), p.data_ptr(), stream));
    dq.add_(mm_f32(p, kc));
    dk.narrow(0, col0, c).copy_(mm_f32(p.t(), q));
  }
  return {(dq * coef_scale).to(q.scalar_type()), (dk * coef_scale).to(k.scalar_type())};
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
