// Fused softmax stages over fp32 score chunks; see similarity_kernels.h for the contract.
//
// Both kernels give one warp to one row of the (N, C) chunk: the row's exclusions, lse and coefficient
// are read once, the scores stream through in 16-byte loads (float4) when the row stride allows, and
// nothing but the row's result (chunk_lse) or the P row (chunk_grad) is written. They are memory-bound
// by design: one read of S each, the fewest bytes the softmax needs once cuBLAS has written S.
#include "similarity_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

namespace pretrain_cuda {
namespace {

constexpr int kWarps = 8;  // rows per CTA
constexpr int kThreads = kWarps * 32;

// Running (max, sum of exp(x - max)) pairs; an empty pair is (-inf, 0).
__device__ __forceinline__ void merge(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = l * __expf(m - mn) + l2 * __expf(m2 - mn);
  m = mn;
}

__device__ __forceinline__ bool excluded(int64_t c, int64_t e0, int64_t e1) { return c == e0 || c == e1; }

__global__ void __launch_bounds__(kThreads)
chunk_lse_kernel(const float* __restrict__ S, int64_t N, int64_t C, int64_t ld_s, const int64_t* __restrict__ excl,
                 int64_t col0, float inv_temp, bool vec, float* __restrict__ lse) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;  // uniform per warp
  const float* s = S + row * ld_s;
  const int64_t e0 = excl[2 * row] - col0;
  const int64_t e1 = excl[2 * row + 1] - col0;
  float m = -INFINITY, l = 0.f;
  int64_t done = 0;
  if (vec) {
    const int64_t c4 = C / 4 * 4;
    for (int64_t c = 4 * lane; c < c4; c += 128) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(s + c));  // read once: stream past L2
      const float x0 = excluded(c, e0, e1) ? -INFINITY : v.x * inv_temp;
      const float x1 = excluded(c + 1, e0, e1) ? -INFINITY : v.y * inv_temp;
      const float x2 = excluded(c + 2, e0, e1) ? -INFINITY : v.z * inv_temp;
      const float x3 = excluded(c + 3, e0, e1) ? -INFINITY : v.w * inv_temp;
      const float mn = fmaxf(m, fmaxf(fmaxf(x0, x1), fmaxf(x2, x3)));
      if (mn != -INFINITY) {
        l = l * __expf(m - mn) + ((__expf(x0 - mn) + __expf(x1 - mn)) + (__expf(x2 - mn) + __expf(x3 - mn)));
        m = mn;
      }
    }
    done = c4;
  }
  for (int64_t c = done + lane; c < C; c += 32) {
    const float x = excluded(c, e0, e1) ? -INFINITY : s[c] * inv_temp;
    merge(m, l, x, 1.f);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, offset);
    merge(m, l, m2, l2);
  }
  if (lane == 0 && l > 0.f) {
    const float chunk = m + logf(l);
    const float old = lse[row];
    if (old == -INFINITY) {
      lse[row] = chunk;
    } else {
      const float hi = fmaxf(old, chunk);
      lse[row] = hi + log1pf(expf(-fabsf(old - chunk)));
    }
  }
}

template <typename T>
struct Pack4;  // four values of T in one aligned store
template <>
struct alignas(16) Pack4<float> {
  float a, b, c, d;
  __device__ Pack4(float x, float y, float z, float w) : a(x), b(y), c(z), d(w) {}
};
template <>
struct alignas(8) Pack4<__half> {
  __half2 lo, hi;
  __device__ Pack4(float x, float y, float z, float w) : lo(__floats2half2_rn(x, y)), hi(__floats2half2_rn(z, w)) {}
};
template <>
struct alignas(8) Pack4<__nv_bfloat16> {
  __nv_bfloat162 lo, hi;
  __device__ Pack4(float x, float y, float z, float w)
      : lo(__floats2bfloat162_rn(x, y)), hi(__floats2bfloat162_rn(z, w)) {}
};

template <typename T>
__device__ __forceinline__ T cast(float x);
template <>
__device__ __forceinline__ float cast<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half cast<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 cast<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
chunk_grad_kernel(const float* __restrict__ S, int64_t N, int64_t C, int64_t ld_s, const int64_t* __restrict__ excl,
                  int64_t col0, float inv_temp, const float* __restrict__ lse, const float* __restrict__ coef,
                  bool vec, T* __restrict__ P) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const float* s = S + row * ld_s;
  T* p = P + row * C;
  const int64_t e0 = excl[2 * row] - col0;
  const int64_t e1 = excl[2 * row + 1] - col0;
  const float row_lse = lse[row];
  const float row_coef = coef[row];
  int64_t done = 0;
  if (vec) {
    const int64_t c4 = C / 4 * 4;
    for (int64_t c = 4 * lane; c < c4; c += 128) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(s + c));
      const float p0 = excluded(c, e0, e1) ? 0.f : row_coef * __expf(v.x * inv_temp - row_lse);
      const float p1 = excluded(c + 1, e0, e1) ? 0.f : row_coef * __expf(v.y * inv_temp - row_lse);
      const float p2 = excluded(c + 2, e0, e1) ? 0.f : row_coef * __expf(v.z * inv_temp - row_lse);
      const float p3 = excluded(c + 3, e0, e1) ? 0.f : row_coef * __expf(v.w * inv_temp - row_lse);
      *reinterpret_cast<Pack4<T>*>(p + c) = Pack4<T>(p0, p1, p2, p3);
    }
    done = c4;
  }
  for (int64_t c = done + lane; c < C; c += 32)
    p[c] = cast<T>(excluded(c, e0, e1) ? 0.f : row_coef * __expf(s[c] * inv_temp - row_lse));
}

// 16-byte loads need every row start 16-byte aligned: base aligned and the row stride a multiple of 4.
bool can_vectorise(const void* S, int64_t ld_s, const void* P = nullptr, int64_t ld_p = 0, int p_align = 1) {
  if (reinterpret_cast<uintptr_t>(S) % 16 != 0 || ld_s % 4 != 0) return false;
  return P == nullptr || (reinterpret_cast<uintptr_t>(P) % p_align == 0 && ld_p % 4 == 0);
}

unsigned grid_for(int64_t N) { return static_cast<unsigned>((N + kWarps - 1) / kWarps); }

}  // namespace

cudaError_t launch_chunk_lse(const float* S, int64_t N, int64_t C, int64_t ld_s, const int64_t* excl_N2,
                             int64_t col0, float inv_temp, float* lse_N, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  chunk_lse_kernel<<<grid_for(N), kThreads, 0, stream>>>(S, N, C, ld_s, excl_N2, col0, inv_temp,
                                                         can_vectorise(S, ld_s), lse_N);
  return cudaGetLastError();
}

cudaError_t launch_chunk_grad(DType dtype, const float* S, int64_t N, int64_t C, int64_t ld_s,
                              const int64_t* excl_N2, int64_t col0, float inv_temp, const float* lse_N,
                              const float* coef_N, void* P, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      chunk_grad_kernel<float><<<grid_for(N), kThreads, 0, stream>>>(
          S, N, C, ld_s, excl_N2, col0, inv_temp, lse_N, coef_N, can_vectorise(S, ld_s, P, C, 16),
          static_cast<float*>(P));
      break;
    case DType::kFloat16:
      chunk_grad_kernel<__half><<<grid_for(N), kThreads, 0, stream>>>(
          S, N, C, ld_s, excl_N2, col0, inv_temp, lse_N, coef_N, can_vectorise(S, ld_s, P, C, 8),
          static_cast<__half*>(P));
      break;
    case DType::kBFloat16:
      chunk_grad_kernel<__nv_bfloat16><<<grid_for(N), kThreads, 0, stream>>>(
          S, N, C, ld_s, excl_N2, col0, inv_temp, lse_N, coef_N, can_vectorise(S, ld_s, P, C, 8),
          static_cast<__nv_bfloat16*>(P));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace pretrain_cuda
