// Private device helpers of kernels/cuda: dtype dispatch, conversions, warp reductions, launch
// arithmetic. Included by the .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda::internal {

using bf16 = __nv_bfloat16;

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float ToFloat<bf16>(bf16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 FromFloat<bf16>(float x) {
  return __float2bfloat16(x);
}

// The last of n ascending firsts (first[0] <= b) that is <= b: which tensor of a batched launch
// (its first block or tile at first[i]) block b belongs to.
__device__ __forceinline__ int FindTensor(const int32_t* first, int n, int b) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// RMSNorm's first half for one warp over row `row` of x ([rows, D]): with kResidual, h = x + res
// stored in T (h's rounded values are what is normed); returns the warp-wide sum of squares and
// the row the second half reads (h's or x's). Every lane gets the same sum.
template <typename T, bool kResidual>
__device__ __forceinline__ float RmsRowSumSquares(const T* x, const T* res, T* h, int64_t row,
                                                  int64_t D, int lane, const T** src) {
  const T* xr = x + row * D;
  float ss = 0.0f;
  for (int64_t j = lane; j < D; j += 32) {
    float v = ToFloat(xr[j]);
    if constexpr (kResidual) {
      const T hv = FromFloat<T>(v + ToFloat(res[row * D + j]));
      h[row * D + j] = hv;
      v = ToFloat(hv);
    }
    ss += v * v;
  }
  *src = kResidual ? h + row * D : xr;
  return WarpSum(ss);
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline Status UnsupportedDType(DType t, const char* op) {
  return {StatusCode::kUnsupported,
          std::string(op) + ": unsupported dtype '" + DTypeName(t) + "'"};
}

}  // namespace spindle::kernels::cuda::internal

// Runs the statement block with `scalar_t` bound to the storage type of `dtype` (float or
// __nv_bfloat16); any other dtype returns kUnsupported naming it and the op.
#define SPINDLE_DISPATCH_FLOAT_BF16(dtype, op, ...)                                  \
  do {                                                                               \
    switch (dtype) {                                                                 \
      case ::spindle::kernels::cuda::DType::kFloat32: {                              \
        using scalar_t = float;                                                      \
        __VA_ARGS__;                                                                 \
        break;                                                                       \
      }                                                                              \
      case ::spindle::kernels::cuda::DType::kBFloat16: {                             \
        using scalar_t = __nv_bfloat16;                                              \
        __VA_ARGS__;                                                                 \
        break;                                                                       \
      }                                                                              \
      default:                                                                       \
        return ::spindle::kernels::cuda::internal::UnsupportedDType(dtype, op);      \
    }                                                                                \
  } while (0)
