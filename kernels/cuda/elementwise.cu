// SwiGLU forward and backward on CUDA: y = silu(g) * u, element for element.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::Sigmoid;
using internal::ToFloat;

template <typename T>
__global__ void SwiGluFwdKernel(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = ToFloat(g[i]);
    y[i] = FromFloat<T>(gv * Sigmoid(gv) * ToFloat(u[i]));
  }
}

// d silu(g)/dg = sig * (1 + g * (1 - sig)).
template <typename T>
__global__ void SwiGluBwdKernel(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = ToFloat(g[i]), uv = ToFloat(u[i]), d = ToFloat(dy[i]);
    const float sig = Sigmoid(gv);
    dg[i] = FromFloat<T>(d * uv * sig * (1.0f + gv * (1.0f - sig)));
    du[i] = FromFloat<T>(d * gv * sig);
  }
}

int64_t Blocks(int64_t n) { return std::min<int64_t>(internal::CeilDiv(n, 256), 132 * 16); }

}  // namespace

Status SwiGluForward(const void* g, const void* u, void* y, int64_t n, DType dtype,
                     cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "SwiGluForward: negative size");
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluForward", {
    SwiGluFwdKernel<scalar_t><<<Blocks(n), 256, 0, stream>>>(
        static_cast<const scalar_t*>(g), static_cast<const scalar_t*>(u),
        static_cast<scalar_t*>(y), n);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status SwiGluBackward(const void* g, const void* u, const void* dy, void* dg, void* du, int64_t n,
                      DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "SwiGluBackward: negative size");
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluBackward", {
    SwiGluBwdKernel<scalar_t><<<Blocks(n), 256, 0, stream>>>(
        static_cast<const scalar_t*>(g), static_cast<const scalar_t*>(u),
        static_cast<const scalar_t*>(dy), static_cast<scalar_t*>(dg), static_cast<scalar_t*>(du),
        n);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
