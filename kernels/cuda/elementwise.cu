// SwiGLU forward and backward on CUDA: y = silu(g) * u, element for element. When every pointer
// is 16-byte aligned, one thread per 16-byte vector (8 bf16 or 4 fp32) plus a scalar tail;
// otherwise the scalar grid-stride kernels.
#include <algorithm>

#include "kernels/cuda/amax.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::AbsBits;
using internal::Aligned16;
using internal::BlockMaxToGlobal;
using internal::FromFloat;
using internal::kVec;
using internal::Load16;
using internal::Pack;
using internal::Sigmoid;
using internal::Store16;
using internal::ToFloat;
using internal::Unpack;

constexpr int kVecThreads = 256;

// Thread i: vector i (< n_vec), then element n_vec * V + i of the tail (< n % V).
template <typename T>
__global__ void __launch_bounds__(kVecThreads)
    SwiGluFwdVecKernel(const T* g, const T* u, T* y, int64_t n_vec, int64_t n) {
  constexpr int V = kVec<T>;
  const int64_t i = blockIdx.x * static_cast<int64_t>(kVecThreads) + threadIdx.x;
  if (i < n_vec) {
    float gv[V], uv[V], yv[V];
    Unpack<T>(Load16(g + i * V), gv);
    Unpack<T>(Load16(u + i * V), uv);
#pragma unroll
    for (int e = 0; e < V; ++e) yv[e] = gv[e] * Sigmoid(gv[e]) * uv[e];
    Store16(y + i * V, Pack<T>(yv));
  }
  if (i < n - n_vec * V) {
    const int64_t j = n_vec * V + i;
    const float gv = ToFloat(g[j]);
    y[j] = FromFloat<T>(gv * Sigmoid(gv) * ToFloat(u[j]));
  }
}

// d silu(g)/dg = sig * (1 + g * (1 - sig)). One element of SwiGLU's backward, stored; with kAmax
// the stored magnitudes are folded into mg and mu.
template <typename T, bool kAmax>
__device__ __forceinline__ void SwiGluBwdOne(const T* g, const T* u, const T* dy, T* dg, T* du,
                                             int64_t i, uint32_t& mg, uint32_t& mu) {
  const float gv = ToFloat(g[i]), uv = ToFloat(u[i]), d = ToFloat(dy[i]);
  const float sig = Sigmoid(gv);
  const T a = FromFloat<T>(d * uv * sig * (1.0f + gv * (1.0f - sig)));
  const T b = FromFloat<T>(d * gv * sig);
  dg[i] = a;
  du[i] = b;
  if constexpr (kAmax) {
    mg = max(mg, AbsBits(ToFloat(a)));
    mu = max(mu, AbsBits(ToFloat(b)));
  }
}

// The block's amaxes of dg and du into amax[0] and amax[1] (every thread calls it).
__device__ __forceinline__ void SwiGluBwdAmaxes(uint32_t mg, uint32_t mu, float* amax) {
  BlockMaxToGlobal(mg, amax);
  __syncthreads();
  BlockMaxToGlobal(mu, amax + 1);
}

// kAmax: also max |dg| and max |du| as stored (rounded to T) into amax[0] and amax[1] (the FP8
// recipe's output-gradient amax, saving the quantization a pass over each).
template <typename T, bool kAmax>
__global__ void __launch_bounds__(kVecThreads)
    SwiGluBwdVecKernel(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n_vec,
                       int64_t n, float* amax) {
  constexpr int V = kVec<T>;
  const int64_t i = blockIdx.x * static_cast<int64_t>(kVecThreads) + threadIdx.x;
  uint32_t mg = 0, mu = 0;
  if (i < n_vec) {
    float gv[V], uv[V], dv[V], dgv[V], duv[V];
    Unpack<T>(Load16(g + i * V), gv);
    Unpack<T>(Load16(u + i * V), uv);
    Unpack<T>(Load16(dy + i * V), dv);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float sig = Sigmoid(gv[e]);
      dgv[e] = dv[e] * uv[e] * sig * (1.0f + gv[e] * (1.0f - sig));
      duv[e] = dv[e] * gv[e] * sig;
      if constexpr (kAmax) {
        mg = max(mg, AbsBits(ToFloat(FromFloat<T>(dgv[e]))));
        mu = max(mu, AbsBits(ToFloat(FromFloat<T>(duv[e]))));
      }
    }
    Store16(dg + i * V, Pack<T>(dgv));  // every load above precedes both stores (aliasing)
    Store16(du + i * V, Pack<T>(duv));
  }
  if (i < n - n_vec * V) SwiGluBwdOne<T, kAmax>(g, u, dy, dg, du, n_vec * V + i, mg, mu);
  if constexpr (kAmax) SwiGluBwdAmaxes(mg, mu, amax);
}

// Blocks of the vector kernels: enough threads for the vectors and for the tail.
int64_t VecBlocks(int64_t n_vec, int vec) {
  return std::max<int64_t>(internal::CeilDiv(std::max<int64_t>(n_vec, vec), kVecThreads), 1);
}

template <typename T>
__global__ void SwiGluFwdKernel(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = ToFloat(g[i]);
    y[i] = FromFloat<T>(gv * Sigmoid(gv) * ToFloat(u[i]));
  }
}

// kAmax: as SwiGluBwdVecKernel.
template <typename T, bool kAmax>
__global__ void SwiGluBwdKernel(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n,
                                float* amax) {
  uint32_t mg = 0, mu = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    SwiGluBwdOne<T, kAmax>(g, u, dy, dg, du, i, mg, mu);
  if constexpr (kAmax) SwiGluBwdAmaxes(mg, mu, amax);
}

int64_t Blocks(int64_t n) { return std::min<int64_t>(internal::CeilDiv(n, 256), 132 * 16); }

}  // namespace

Status SwiGluForward(const void* g, const void* u, void* y, int64_t n, DType dtype,
                     cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "SwiGluForward: negative size");
  if (n == 0) return Status::Ok();
  const bool aligned = Aligned16(g) && Aligned16(u) && Aligned16(y);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluForward", {
    const auto* gt = static_cast<const scalar_t*>(g);
    const auto* ut = static_cast<const scalar_t*>(u);
    auto* yt = static_cast<scalar_t*>(y);
    constexpr int V = kVec<scalar_t>;
    if (aligned) {
      const int64_t n_vec = n / V;
      SwiGluFwdVecKernel<scalar_t><<<VecBlocks(n_vec, V), kVecThreads, 0, stream>>>(gt, ut, yt,
                                                                                    n_vec, n);
    } else {
      SwiGluFwdKernel<scalar_t><<<Blocks(n), 256, 0, stream>>>(gt, ut, yt, n);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status SwiGluBackward(const void* g, const void* u, const void* dy, void* dg, void* du, int64_t n,
                      DType dtype, cudaStream_t stream, float* amax) {
  SPINDLE_CHECK_ARG(n >= 0, "SwiGluBackward: negative size");
  if (amax != nullptr) SPINDLE_CUDA_CHECK(cudaMemsetAsync(amax, 0, 2 * sizeof(float), stream));
  if (n == 0) return Status::Ok();
  const bool aligned =
      Aligned16(g) && Aligned16(u) && Aligned16(dy) && Aligned16(dg) && Aligned16(du);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluBackward", {
    const auto* gt = static_cast<const scalar_t*>(g);
    const auto* ut = static_cast<const scalar_t*>(u);
    const auto* dyt = static_cast<const scalar_t*>(dy);
    auto* dgt = static_cast<scalar_t*>(dg);
    auto* dut = static_cast<scalar_t*>(du);
    constexpr int V = kVec<scalar_t>;
    const int64_t n_vec = n / V;
    if (aligned && amax != nullptr) {
      SwiGluBwdVecKernel<scalar_t, true><<<VecBlocks(n_vec, V), kVecThreads, 0, stream>>>(
          gt, ut, dyt, dgt, dut, n_vec, n, amax);
    } else if (aligned) {
      SwiGluBwdVecKernel<scalar_t, false><<<VecBlocks(n_vec, V), kVecThreads, 0, stream>>>(
          gt, ut, dyt, dgt, dut, n_vec, n, nullptr);
    } else if (amax != nullptr) {
      SwiGluBwdKernel<scalar_t, true><<<Blocks(n), 256, 0, stream>>>(gt, ut, dyt, dgt, dut, n,
                                                                      amax);
    } else {
      SwiGluBwdKernel<scalar_t, false><<<Blocks(n), 256, 0, stream>>>(gt, ut, dyt, dgt, dut, n,
                                                                       nullptr);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
