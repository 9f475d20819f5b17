// Fused masked log-sum-exp kernels; see similarity_kernels.h for the contract.
//
// One kernel template covers the three passes. A CTA owns kTileRows rows of operand A and streams
// 64-row tiles of operand B:
//   FWD    A = q, B = k: online (max, sum) per q row            -> partial lse per split
//   BWD_Q  A = q, B = k: P = coef_a * exp(s - lse_a); dA += P B  -> dq
//   BWD_K  A = k, B = q: P = coef_b * exp(s - lse_b); dA += P B  -> dk  (P^T of BWD_Q)
// The score tile S = A_tile B_tile^T (64 x 64, fp32) is accumulated over D in chunks of kDepth.
// Each CTA owns its output rows exclusively within a split, so there are no atomics and results are
// deterministic. Shapes in comments: [rows][cols], row-major, "ld" = padded row length in smem.
#include "similarity_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "pretrain similarity kernels need sm_80 or newer (bf16 tensor cores); set TORCH_CUDA_ARCH_LIST=8.0;9.0"
#endif

namespace pretrain_cuda {
namespace {

constexpr int kRows = kTileRows;  // A rows per CTA and B rows per tile
constexpr int kDepth = 32;        // D chunk of the score product
constexpr int kThreads = 128;     // 4 warps
constexpr int kWarpRows = 16;     // rows per warp in the WMMA layout
enum Mode { kFwd = 0, kBwdQ = 1, kBwdK = 2 };

template <typename T>
struct Traits {
  // fp16 / bf16: WMMA 16x16x16 with fp32 accumulators; padding keeps 32-byte fragment alignment.
  static constexpr bool kWmma = true;
  static constexpr int kLd = kDepth + 8;  // As/Bs row length
  static constexpr int kSLd = kRows + 4;  // S row length (fp32, multiple of 4 for store_matrix_sync)
  static constexpr int kOutCols = 64;     // D chunk of the output product
  static constexpr int kPLd = kRows + 8;  // P row length (T)
  static constexpr int kDLd = kOutCols + 8;
};
template <>
struct Traits<float> {
  // fp32: SIMT register tiles (exact fp32, no TF32); odd padding avoids bank conflicts.
  static constexpr bool kWmma = false;
  static constexpr int kLd = kDepth + 1;
  static constexpr int kSLd = kRows + 1;
  static constexpr int kOutCols = 32;
  static constexpr int kPLd = 1;  // P lives in S (fp32) on this path
  static constexpr int kDLd = kOutCols + 1;
};

__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// dst[r][c] = src[row0 + r][col0 + c] for r < kRows, c < width; zero outside [num_rows) x [D).
template <typename T>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* __restrict__ src, int64_t row0,
                                          int64_t num_rows, int64_t D, int64_t col0, int width) {
  for (int idx = threadIdx.x; idx < kRows * width; idx += kThreads) {
    const int r = idx / width;
    const int c = idx - r * width;
    const int64_t gr = row0 + r;
    const int64_t gc = col0 + c;
    dst[r * ld + c] = (gr < num_rows && gc < D) ? src[gr * D + gc] : from_float<T>(0.f);
  }
}

// S[a][b] = <A[a0 + a], B[b0 + b]> in fp32 for the 64 x 64 tile; ends with a barrier.
template <typename T>
__device__ void score_tile(const T* __restrict__ A, int64_t a0, int64_t num_a, const T* __restrict__ B,
                           int64_t b0, int64_t num_b, int64_t D, T* As, T* Bs, float* S) {
  using Tr = Traits<T>;
  if constexpr (Tr::kWmma) {
    namespace wmma = nvcuda::wmma;
    const int warp = threadIdx.x / 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kRows / 16];
#pragma unroll
    for (int f = 0; f < kRows / 16; ++f) wmma::fill_fragment(acc[f], 0.f);
    for (int64_t d0 = 0; d0 < D; d0 += kDepth) {
      load_tile(As, Tr::kLd, A, a0, num_a, D, d0, kDepth);
      load_tile(Bs, Tr::kLd, B, b0, num_b, D, d0, kDepth);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kDepth; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        wmma::load_matrix_sync(a_frag, As + warp * kWarpRows * Tr::kLd + kk, Tr::kLd);
#pragma unroll
        for (int f = 0; f < kRows / 16; ++f) {
          // B^T as a (depth x cols) matrix is Bs read column-major.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
          wmma::load_matrix_sync(b_frag, Bs + f * 16 * Tr::kLd + kk, Tr::kLd);
          wmma::mma_sync(acc[f], a_frag, b_frag, acc[f]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int f = 0; f < kRows / 16; ++f)
      wmma::store_matrix_sync(S + warp * kWarpRows * Tr::kSLd + f * 16, acc[f], Tr::kSLd, wmma::mem_row_major);
  } else {
    const int ty = threadIdx.x / 16;  // rows ty*8 .. ty*8+7
    const int tx = threadIdx.x % 16;  // cols tx + 16*j
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int64_t d0 = 0; d0 < D; d0 += kDepth) {
      load_tile(As, Tr::kLd, A, a0, num_a, D, d0, kDepth);
      load_tile(Bs, Tr::kLd, B, b0, num_b, D, d0, kDepth);
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kDepth; ++kk) {
        float av[8], bv[4];
#pragma unroll
        for (int i = 0; i < 8; ++i) av[i] = to_float(As[(ty * 8 + i) * Tr::kLd + kk]);
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = to_float(Bs[(tx + 16 * j) * Tr::kLd + kk]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) S[(ty * 8 + i) * Tr::kSLd + tx + 16 * j] = acc[i][j];
  }
  __syncthreads();
}

// out[a0 + a][:] += sum_b P[a][b] * B[b0 + b][:], streaming D in chunks of kOutCols.
// P is in Ps (T, WMMA path) or S (fp32, SIMT path). Ends with a barrier.
template <typename T>
__device__ void accumulate_out(const T* __restrict__ B, int64_t b0, int64_t num_b, int64_t D, int64_t a0,
                               int64_t num_a, const T* Ps, float* S, T* Bd, float* __restrict__ out) {
  using Tr = Traits<T>;
  for (int64_t d0 = 0; d0 < D; d0 += Tr::kOutCols) {
    load_tile(Bd, Tr::kDLd, B, b0, num_b, D, d0, Tr::kOutCols);
    __syncthreads();
    if constexpr (Tr::kWmma) {
      namespace wmma = nvcuda::wmma;
      const int warp = threadIdx.x / 32;
      const int lane = threadIdx.x % 32;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[Tr::kOutCols / 16];
#pragma unroll
      for (int f = 0; f < Tr::kOutCols / 16; ++f) wmma::fill_fragment(acc[f], 0.f);
#pragma unroll
      for (int kk = 0; kk < kRows; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_frag;
        wmma::load_matrix_sync(p_frag, Ps + warp * kWarpRows * Tr::kPLd + kk, Tr::kPLd);
#pragma unroll
        for (int f = 0; f < Tr::kOutCols / 16; ++f) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_frag;
          wmma::load_matrix_sync(b_frag, Bd + kk * Tr::kDLd + f * 16, Tr::kDLd);
          wmma::mma_sync(acc[f], p_frag, b_frag, acc[f]);
        }
      }
      // S is free once P is formed: use this warp's 16 rows of it as fp32 staging.
      float* stage = S + warp * kWarpRows * Tr::kSLd;
#pragma unroll
      for (int f = 0; f < Tr::kOutCols / 16; ++f)
        wmma::store_matrix_sync(stage + f * 16, acc[f], Tr::kSLd, wmma::mem_row_major);
      __syncwarp();
      for (int idx = lane; idx < kWarpRows * Tr::kOutCols; idx += 32) {
        const int r = idx / Tr::kOutCols;
        const int c = idx - r * Tr::kOutCols;
        const int64_t ga = a0 + warp * kWarpRows + r;
        const int64_t gd = d0 + c;
        if (ga < num_a && gd < D) out[ga * D + gd] += stage[r * Tr::kSLd + c];
      }
    } else {
      const int ty = threadIdx.x / 16;
      const int tx = threadIdx.x % 16;
      float acc[8][Tr::kOutCols / 16];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kOutCols / 16; ++j) acc[i][j] = 0.f;
#pragma unroll 4
      for (int b = 0; b < kRows; ++b) {
        float bv[Tr::kOutCols / 16];
#pragma unroll
        for (int j = 0; j < Tr::kOutCols / 16; ++j) bv[j] = to_float(Bd[b * Tr::kDLd + tx + 16 * j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float p = S[(ty * 8 + i) * Tr::kSLd + b];
#pragma unroll
          for (int j = 0; j < Tr::kOutCols / 16; ++j) acc[i][j] = fmaf(p, bv[j], acc[i][j]);
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t ga = a0 + ty * 8 + i;
#pragma unroll
        for (int j = 0; j < Tr::kOutCols / 16; ++j) {
          const int64_t gd = d0 + tx + 16 * j;
          if (ga < num_a && gd < D) out[ga * D + gd] += acc[i][j];
        }
      }
    }
    __syncthreads();
  }
}

template <typename T, int kMode>
__global__ void __launch_bounds__(kThreads)
masked_lse_kernel(const T* __restrict__ A, int64_t num_a, const T* __restrict__ B, int64_t num_b, int64_t D,
                  const int64_t* __restrict__ excl_N2, float inv_temp, const float* __restrict__ lse_N,
                  const float* __restrict__ coef_N, int tiles_per_split, float* __restrict__ out) {
  using Tr = Traits<T>;
  constexpr bool kBwd = kMode != kFwd;
  constexpr int kPsSize = (kBwd && Tr::kWmma) ? kRows * Tr::kPLd : 1;
  constexpr int kBdSize = kBwd ? kRows * Tr::kDLd : 1;
  constexpr int kStats = kMode == kBwdK ? kRows : 1;
  __shared__ __align__(128) T As[kRows * Tr::kLd];
  __shared__ __align__(128) T Bs[kRows * Tr::kLd];
  __shared__ __align__(128) float S[kRows * Tr::kSLd];
  __shared__ __align__(128) T Ps[kPsSize];
  __shared__ __align__(128) T Bd[kBdSize];
  // Per-B-row statistics (BWD_K: the B side is q, whose rows carry lse / coef / exclusions).
  __shared__ float b_lse[kStats];
  __shared__ float b_coef[kStats];
  __shared__ int64_t b_ex0[kStats];
  __shared__ int64_t b_ex1[kStats];

  const int64_t a0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t num_tiles = (num_b + kRows - 1) / kRows;
  const int64_t tile_begin = static_cast<int64_t>(split) * tiles_per_split;
  const int64_t tile_end = min(num_tiles, tile_begin + tiles_per_split);

  // The epilogue gives each A row to two adjacent threads, 32 columns each.
  const int row = threadIdx.x >> 1;
  const int side = threadIdx.x & 1;
  const int64_t ga = a0 + row;
  const bool row_ok = ga < num_a;
  int64_t ex0 = -1, ex1 = -1;
  float row_lse = 0.f, row_coef = 0.f;
  if (kMode != kBwdK && row_ok) {
    ex0 = excl_N2[2 * ga];
    ex1 = excl_N2[2 * ga + 1];
    if (kMode == kBwdQ) {
      row_lse = lse_N[ga];
      row_coef = coef_N[ga];
    }
  }
  float run_max = -INFINITY, run_sum = 0.f;

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t b0 = tile * kRows;
    if (kMode == kBwdK) {
      for (int b = threadIdx.x; b < kRows; b += kThreads) {
        const int64_t gb = b0 + b;
        const bool ok = gb < num_b;
        b_lse[b] = ok ? lse_N[gb] : 0.f;
        b_coef[b] = ok ? coef_N[gb] : 0.f;
        b_ex0[b] = ok ? excl_N2[2 * gb] : -1;
        b_ex1[b] = ok ? excl_N2[2 * gb + 1] : -1;
      }
    }
    score_tile<T>(A, a0, num_a, B, b0, num_b, D, As, Bs, S);  // barriers publish b_* too

    const float* s_row = S + row * Tr::kSLd + side * 32;
    if constexpr (kMode == kFwd) {
      float tile_max = -INFINITY;
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int64_t gb = b0 + side * 32 + c;
        if (gb < num_b && gb != ex0 && gb != ex1) tile_max = fmaxf(tile_max, s_row[c] * inv_temp);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float new_max = fmaxf(run_max, tile_max);
      const bool live = new_max != -INFINITY;  // same for both threads of a row
      float tile_sum = 0.f;
      if (live) {
#pragma unroll 8
        for (int c = 0; c < 32; ++c) {
          const int64_t gb = b0 + side * 32 + c;
          if (gb < num_b && gb != ex0 && gb != ex1) tile_sum += __expf(s_row[c] * inv_temp - new_max);
        }
      }
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);  // all lanes, outside the branch
      if (live) {
        run_sum = run_sum * __expf(run_max - new_max) + tile_sum;
        run_max = new_max;
      }
    } else {
      // P[a][b] = coef * exp(s/T - lse) for live entries, 0 for excluded / padding ones.
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int b = side * 32 + c;
        const int64_t gb = b0 + b;
        float p = 0.f;
        if (row_ok && gb < num_b) {
          if (kMode == kBwdQ) {
            if (gb != ex0 && gb != ex1) p = row_coef * __expf(s_row[c] * inv_temp - row_lse);
          } else if (ga != b_ex0[b] && ga != b_ex1[b]) {
            p = b_coef[b] * __expf(s_row[c] * inv_temp - b_lse[b]);
          }
        }
        if constexpr (Tr::kWmma) {
          Ps[row * Tr::kPLd + b] = from_float<T>(p);
        } else {
          S[row * Tr::kSLd + b] = p;  // each thread rewrites only the entries it read
        }
      }
      __syncthreads();
      float* out_split = out + static_cast<int64_t>(split) * num_a * D;
      accumulate_out<T>(B, b0, num_b, D, a0, num_a, Ps, S, Bd, out_split);
    }
  }

  if constexpr (kMode == kFwd) {
    if (row_ok && side == 0)
      out[static_cast<int64_t>(split) * num_a + ga] = run_sum > 0.f ? run_max + logf(run_sum) : -INFINITY;
  }
}

int tiles_per_split(int64_t num_b, int num_splits) {
  const int64_t tiles = (num_b + kRows - 1) / kRows;
  return static_cast<int>((tiles + num_splits - 1) / num_splits);
}

template <int kMode>
cudaError_t launch(DType dtype, const void* A, int64_t num_a, const void* B, int64_t num_b, int64_t D,
                   const int64_t* excl_N2, float inv_temp, const float* lse_N, const float* coef_N,
                   int num_splits, float* out, cudaStream_t stream) {
  if (num_a == 0 || num_b == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((num_a + kRows - 1) / kRows), static_cast<unsigned>(num_splits));
  const int per = tiles_per_split(num_b, num_splits);
  switch (dtype) {
    case DType::kFloat32:
      masked_lse_kernel<float, kMode><<<grid, kThreads, 0, stream>>>(
          static_cast<const float*>(A), num_a, static_cast<const float*>(B), num_b, D, excl_N2, inv_temp, lse_N,
          coef_N, per, out);
      break;
    case DType::kFloat16:
      masked_lse_kernel<__half, kMode><<<grid, kThreads, 0, stream>>>(
          static_cast<const __half*>(A), num_a, static_cast<const __half*>(B), num_b, D, excl_N2, inv_temp,
          lse_N, coef_N, per, out);
      break;
    case DType::kBFloat16:
      masked_lse_kernel<__nv_bfloat16, kMode><<<grid, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(A), num_a, static_cast<const __nv_bfloat16*>(B), num_b, D, excl_N2,
          inv_temp, lse_N, coef_N, per, out);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_masked_lse_fwd(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                  int64_t D, const int64_t* excl_N2, float inv_temp, int num_splits,
                                  float* lse_part_SN, cudaStream_t stream) {
  return launch<kFwd>(dtype, q_ND, N, k_MD, M, D, excl_N2, inv_temp, nullptr, nullptr, num_splits, lse_part_SN,
                      stream);
}

cudaError_t launch_masked_lse_bwd_q(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                    int64_t D, const int64_t* excl_N2, float inv_temp, const float* lse_N,
                                    const float* coef_N, int num_splits, float* dq_part_SND,
                                    cudaStream_t stream) {
  return launch<kBwdQ>(dtype, q_ND, N, k_MD, M, D, excl_N2, inv_temp, lse_N, coef_N, num_splits, dq_part_SND,
                       stream);
}

cudaError_t launch_masked_lse_bwd_k(DType dtype, const void* q_ND, const void* k_MD, int64_t N, int64_t M,
                                    int64_t D, const int64_t* excl_N2, float inv_temp, const float* lse_N,
                                    const float* coef_N, int num_splits, float* dk_part_SMD,
                                    cudaStream_t stream) {
  // A = k (rows owned), B = q (streamed): the row statistics belong to B.
  return launch<kBwdK>(dtype, k_MD, M, q_ND, N, D, excl_N2, inv_temp, lse_N, coef_N, num_splits, dk_part_SMD,
                       stream);
}

}  // namespace pretrain_cuda
