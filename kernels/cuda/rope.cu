// Rotate-half RoPE on a strided [T, H, d] view, in place, on CUDA (see cpu::RopeApply).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::ToFloat;

// Most frequencies per head of the table kernel (its shared memory: 24 bytes per frequency).
constexpr int kMaxTableHalf = 2048;
constexpr int64_t kMaxTableBlocks = 4096;

// Tokens loop over the grid. inv_freq is computed once per block (fp64, shared memory); per token,
// cos/sin of every frequency once (double-buffered table: one barrier per token), then the block
// rotates the pairs of all heads of the token.
template <typename T>
__global__ void RopeTableKernel(T* x, const int32_t* pos, int64_t T_, int H, int d,
                                int64_t token_stride, int64_t head_stride, float theta,
                                float sign) {
  extern __shared__ double rope_smem[];
  const int half = d / 2;
  double* inv = rope_smem;                                       // [half]
  float2* tab = reinterpret_cast<float2*>(rope_smem + half);     // [2][half]
  // Thread j % blockDim writes and later reads inv[j]: no barrier needed.
  for (int j = threadIdx.x; j < half; j += blockDim.x) inv[j] = internal::RopeInvFreq(j, d, theta);
  const int n = H * half;
  int buf = 0;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x, buf ^= 1) {
    float2* tb = tab + buf * half;
    const double p = static_cast<double>(pos[t]);
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      float c, s;
      internal::RopeCosSinOfAngle(p * inv[j], &c, &s);
      tb[j] = make_float2(c, s * sign);
    }
    // Also orders this token's reads of tab[buf ^ 1] (previous token) before the next token's
    // writes of it.
    __syncthreads();
    T* xt = x + t * token_stride;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int h = i / half, j = i - h * half;
      const float2 cs = tb[j];
      T* lo = xt + h * head_stride + j;
      const float a = ToFloat(lo[0]), b = ToFloat(lo[half]);
      lo[0] = FromFloat<T>(a * cs.x - b * cs.y);
      lo[half] = FromFloat<T>(b * cs.x + a * cs.y);
    }
  }
}

// Fallback for very wide heads: one thread per (t, h, j < d/2) pair, angle per element.
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
  const float sign = inverse ? -1.0f : 1.0f;
  const int64_t half = d / 2;
  if (half <= kMaxTableHalf && H * half <= (int64_t{1} << 30)) {
    const int threads = static_cast<int>(
        std::clamp<int64_t>(internal::RoundUp(std::max(H * half, half), 32), 32, 256));
    const int64_t blocks = std::min(T, kMaxTableBlocks);
    const size_t smem = static_cast<size_t>(half) * 24;
    SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RopeApply", {
      RopeTableKernel<scalar_t><<<blocks, threads, smem, stream>>>(
          static_cast<scalar_t*>(x), pos, T, static_cast<int>(H), static_cast<int>(d),
          token_stride, head_stride, theta, sign);
    });
  } else {
    SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RopeApply", {
      RopeKernel<scalar_t><<<internal::CeilDiv(n, 256), 256, 0, stream>>>(
          static_cast<scalar_t*>(x), pos, T, H, d, token_stride, head_stride, theta, sign);
    });
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
