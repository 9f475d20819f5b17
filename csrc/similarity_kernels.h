// Fused masked log-sum-exp over similarity tiles (flash-style), forward and backward.
//
//   lse[i] = log sum_{j < M, j not in excl[i]} exp(inv_temp * <q_i, k_j>)
//
// Column tiles of k are streamed through shared memory against a block of q rows, keeping a running
// max and sum per row; the backward recomputes each tile. Inputs fp32 / fp16 / bf16, accumulation in
// fp32 (fp16/bf16 tiles use tensor cores through WMMA, sm_80+). Pure CUDA: no torch headers here,
// so these kernels can be compile-checked without a CUDA torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace pretrain_cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

constexpr int kTileRows = 64;  // rows of the block-owned operand per CTA (and columns per tile)

// Partial log-sum-exps: lse_part_SN[s, i] covers split s of the column tiles (combine with
// logsumexp over s). excl_N2 holds two excluded column indices per row (-1 = none).
cudaError_t launch_masked_lse_fwd(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                  int64_t D, const int64_t* excl_N2, float inv_temp, int num_splits,
                                  float* lse_part_SN, cudaStream_t stream);

// dq_part_SND[s] += sum over split s's column tiles of coef[i] * exp(inv_temp*<q_i,k_j> - lse[i]) * k_j.
// lse_N must be finite (the caller zeroes coef and lse of rows whose lse is -inf); dq_part pre-zeroed.
cudaError_t launch_masked_lse_bwd_q(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                    int64_t D, const int64_t* excl_N2, float inv_temp, const float* lse_N,
                                    const float* coef_N, int num_splits, float* dq_part_SND,
                                    cudaStream_t stream);

// dk_part_SMD[s] += sum over split s's row tiles of coef[i] * exp(inv_temp*<q_i,k_j> - lse[i]) * q_i.
cudaError_t launch_masked_lse_bwd_k(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                    int64_t D, const int64_t* excl_N2, float inv_temp, const float* lse_N,
                                    const float* coef_N, int num_splits, float* dk_part_SMD,
                                    cudaStream_t stream);

}  // namespace pretrain_cuda
