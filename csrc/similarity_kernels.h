// Fused softmax stages of the masked log-sum-exp over similarity chunks, forward and backward.
//
//   lse[i] = log sum_{j < M, j not in excl[i]} exp(inv_temp * <q_i, k_j>)
//
// The binding (similarity_ops.cpp) streams k in column chunks of C rows: cuBLAS computes the fp32 score
// chunk S = q k_c^T (tensor cores for fp16/bf16, fp32 accumulation), and these kernels do everything
// else in one pass over S each:
//   * chunk_lse: exclusions, scaling, a per-row online (max, sum) and the merge into the running lse;
//   * chunk_grad: P = coef[i] * exp(inv_temp * s - lse[i]) (0 on excluded entries), written in the
//     operand dtype, which cuBLAS then multiplies into dq (P k_c) and dk (P^T q).
// Memory is O(N*D + N*C), never O(N*M). Pure CUDA: no torch headers, so the kernels compile-check
// without a CUDA torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace pretrain_cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// lse_N[i] <- logaddexp(lse_N[i], log sum_{c < C, col0 + c not in excl[i]} exp(inv_temp * S[i][c])).
// S is (N, C) fp32 with row stride ld_s; excl_N2 holds two excluded column indices per row (-1 = none,
// global column numbers); lse_N starts at -inf and stays -inf for a row without a live column.
cudaError_t launch_chunk_lse(const float* S, int64_t N, int64_t C, int64_t ld_s, const int64_t* excl_N2,
                             int64_t col0, float inv_temp, float* lse_N, cudaStream_t stream);

// P[i][c] = coef_N[i] * exp(inv_temp * S[i][c] - lse_N[i]) for live entries, 0 for excluded ones; P is
// (N, C) contiguous in `dtype`. lse_N must be finite (the caller zeroes lse and coef of dead rows).
cudaError_t launch_chunk_grad(DType dtype, const float* S, int64_t N, int64_t C, int64_t ld_s,
                              const int64_t* excl_N2, int64_t col0, float inv_temp, const float* lse_N,
                              const float* coef_N, void* P, cudaStream_t stream);

}  // namespace pretrain_cuda
