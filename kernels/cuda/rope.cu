// Rotate-half RoPE on a strided [T, H, d] view, in place, on CUDA (see cpu::RopeApply).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::ToFloat;

// One thread per (t, h, j < d/2) pair; the grid's x covers pairs of all heads of one token block.
template <typename T>
__global__ void RopeKernel(T* x, const int32_t* pos, int64_t T_, int64_t H, int64_t d,
                           int64_t token_stride, int64_t head_stride, float theta, float sign) {
  const int64_t half = d / 2;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= T_ * H * half) return;
  const int64_t j = i % half, h = (i / half) % H, t = i / (half * H);
  float c, s;
  internal::RopeCosSin(pos[t], static_cast<int>(j), static_cast<int>(d), theta, &c, &s);
  s *= sign;
  T* lo = x + t * token_stride + h * head_stride + j;
  const float a = ToFloat(lo[0]), b = ToFloat(lo[half]);
  lo[0] = FromFloat<T>(a * c - b * s);
  lo[half] = FromFloat<T>(b * c + a * s);
}

}  // namespace

Status RopeApply(void* x, const int32_t* pos, int64_t T, int64_t H, int64_t d,
                 int64_t token_stride, int64_t head_stride, float theta, bool inverse, DType dtype,
                 cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && d > 0 && d % 2 == 0, "RopeApply: d must be even");
  const int64_t n = T * H * (d / 2);
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RopeApply", {
    RopeKernel<scalar_t><<<internal::CeilDiv(n, 256), 256, 0, stream>>>(
        static_cast<scalar_t*>(x), pos, T, H, d, token_stride, head_stride, theta,
        inverse ? -1.0f : 1.0f);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
