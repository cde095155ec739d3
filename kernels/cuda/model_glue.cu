// Small kernels the model needs between the big ones: strided row copies (MLA's key assembly and
// latent split; a copy engine moves rows of a few hundred bytes slowly), the per-head sum of MLA's
// shared rotary key gradient, a fixed-order squared norm (gradient clipping) and the fp32 ->
// storage dtype conversion of weights.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::ToFloat;

template <typename T>
__global__ void SumHeadsKernel(const T* x, int64_t T_, int64_t H, int64_t d, int64_t ts,
                               int64_t hs, T* out, int64_t os) {
  const int64_t n = T_ * d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    float s = 0.0f;
    for (int64_t h = 0; h < H; ++h) s += ToFloat(x[t * ts + h * hs + j]);
    out[t * os + j] = FromFloat<T>(s);
  }
}

// One thread per 16-byte vector (8 bf16) of a row when every stride, width and pointer allows it,
// else per element.
template <typename V>
__global__ void CopyRowsKernel(V* dst, int64_t dts, int64_t dhs, const V* src, int64_t sts,
                               int64_t shs, int64_t T, int64_t H, int64_t width) {
  const int64_t n = T * H * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % width, r = i / width, h = r % H, t = r / H;
    dst[t * dts + h * dhs + j] = src[t * sts + h * shs + j];
  }
}

constexpr int kNormBlocks = 1024;
constexpr int kNormThreads = 256;

// Block b sums squares of the elements b, b + blocks*threads, ... in a fixed order.
__global__ void SquaredNormPartialKernel(const float* x, int64_t n, double* partial) {
  __shared__ double part[kNormThreads];
  double s = 0.0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kNormThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(kNormBlocks) * kNormThreads) {
    const double v = x[i];
    s += v * v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kNormThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = part[0];
}

__global__ void SumPartialsKernel(const double* partial, double* out) {
  __shared__ double part[kNormBlocks];
  part[threadIdx.x] = partial[threadIdx.x];
  __syncthreads();
  for (int w = kNormBlocks / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

template <typename T>
__global__ void ConvertKernel(const float* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = FromFloat<T>(x[i]);
}

int64_t Blocks(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>(internal::CeilDiv(n, 256), 132 * 16)); }

}  // namespace

Status SumHeads(const void* x, int64_t T, int64_t H, int64_t d, int64_t token_stride,
                int64_t head_stride, void* out, int64_t out_stride, DType dtype,
                cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && d > 0, "SumHeads: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SumHeads", {
    SumHeadsKernel<scalar_t><<<Blocks(T * d), 256, 0, stream>>>(
        static_cast<const scalar_t*>(x), T, H, d, token_stride, head_stride,
        static_cast<scalar_t*>(out), out_stride);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status CopyRows(void* dst, int64_t dst_token_stride, int64_t dst_head_stride, const void* src,
                int64_t src_token_stride, int64_t src_head_stride, int64_t T, int64_t H,
                int64_t width, DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && width >= 0, "CopyRows: bad sizes");
  if (T == 0 || width == 0) return Status::Ok();
  const int64_t es = DTypeSize(dtype);
  const auto fits = [&](int64_t x) { return (x * es) % 16 == 0; };
  const bool vec = fits(dst_token_stride) && fits(dst_head_stride) && fits(src_token_stride) &&
                   fits(src_head_stride) && fits(width) &&
                   (reinterpret_cast<uintptr_t>(dst) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec) {
    const int64_t k = 16 / es;  // elements per vector
    const int64_t n = T * H * width / k;
    CopyRowsKernel<uint4><<<Blocks(n), 256, 0, stream>>>(
        static_cast<uint4*>(dst), dst_token_stride / k, dst_head_stride / k,
        static_cast<const uint4*>(src), src_token_stride / k, src_head_stride / k, T, H,
        width / k);
  } else if (es == 2) {
    CopyRowsKernel<uint16_t><<<Blocks(T * H * width), 256, 0, stream>>>(
        static_cast<uint16_t*>(dst), dst_token_stride, dst_head_stride,
        static_cast<const uint16_t*>(src), src_token_stride, src_head_stride, T, H, width);
  } else {
    CopyRowsKernel<uint32_t><<<Blocks(T * H * width), 256, 0, stream>>>(
        static_cast<uint32_t*>(dst), dst_token_stride, dst_head_stride,
        static_cast<const uint32_t*>(src), src_token_stride, src_head_stride, T, H, width);
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t SquaredNormWorkspaceBytes() { return kNormBlocks * sizeof(double); }

Status SquaredNorm(const float* x, int64_t n, double* out, Workspace ws, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "SquaredNorm: negative size");
  SPINDLE_CHECK_ARG(ws.bytes >= SquaredNormWorkspaceBytes(), "SquaredNorm: workspace too small");
  auto* partial = static_cast<double*>(ws.data);
  SquaredNormPartialKernel<<<kNormBlocks, kNormThreads, 0, stream>>>(x, n, partial);
  SPINDLE_CUDA_CHECK_LAUNCH();
  SumPartialsKernel<<<1, kNormBlocks, 0, stream>>>(partial, out);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status ConvertFromFloat(const float* x, void* y, int64_t n, DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "ConvertFromFloat: negative size");
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "ConvertFromFloat", {
    ConvertKernel<scalar_t><<<Blocks(n), 256, 0, stream>>>(x, static_cast<scalar_t*>(y), n);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
