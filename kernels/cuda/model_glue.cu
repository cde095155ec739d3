// Small kernels the model needs between the big ones: strided row copies (MLA's key assembly and
// latent split; a copy engine moves rows of a few hundred bytes slowly), the per-head sum of MLA's
// shared rotary key gradient, a fixed-order squared norm (gradient clipping), the fp32 -> storage
// dtype conversion of weights, strided row adds and casts, and the log-sum-exp merge of two
// attention pieces (MLA's AllGather context parallelism).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::ToFloat;

// O: T (written) or float (added to).
template <typename T, typename O>
__global__ void SumHeadsKernel(const T* x, int64_t T_, int64_t H, int64_t d, int64_t ts, int64_t hs,
                               O* out, int64_t os) {
  const int64_t n = T_ * d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    float s = 0.0f;
    for (int64_t h = 0; h < H; ++h) s += ToFloat(x[t * ts + h * hs + j]);
    if constexpr (std::is_same_v<O, float>) {
      out[t * os + j] += s;
    } else {
      out[t * os + j] = FromFloat<T>(s);
    }
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

// dst[r, j] = (kAdd ? dst[r, j] : 0) + src[r, j] over strided rows, in fp32, rounded once.
template <typename D, typename S, bool kAdd>
__global__ void RowsKernel(D* dst, int64_t ds, const S* src, int64_t ss, int64_t rows,
                           int64_t width) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, j = i % width;
    const float x = ToFloat(src[r * ss + j]);
    dst[r * ds + j] = FromFloat<D>(kAdd ? ToFloat(dst[r * ds + j]) + x : x);
  }
}

// One warp per (token, head): lane 0 reads both statistics, the merged weights reach every lane
// by shuffle, and lane 0 writes the merged statistic after the lanes have their values.
template <typename A, typename Bt>
__global__ void AttentionMergeKernel(A* oa, int64_t tsa, float* la, int64_t lsa, const Bt* ob,
                                     int64_t tsb, const float* lb, int64_t lsb, int64_t n,
                                     int64_t H, int64_t Dv) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; w < n * H;
       w += warps) {
    const int64_t t = w / H, h = w % H;
    float wa = 0.0f, wb = 0.0f, l = 0.0f;
    if (lane == 0) {
      const float a = la[h * lsa + t], b = lb[h * lsb + t];
      const float m = fmaxf(a, b);
      if (m == -INFINITY) {  // no key on either side: keep a's (empty) result
        wa = 1.0f, wb = 0.0f, l = a;
      } else {
        const float ea = expf(a - m), eb = expf(b - m), z = ea + eb;
        wa = ea / z, wb = eb / z, l = m + logf(z);
      }
    }
    wa = __shfl_sync(0xffffffffu, wa, 0);
    wb = __shfl_sync(0xffffffffu, wb, 0);
    A* o = oa + t * tsa + h * Dv;
    const Bt* x = ob + t * tsb + h * Dv;
    for (int64_t j = lane; j < Dv; j += 32)
      o[j] = FromFloat<A>(wa * ToFloat(o[j]) + wb * ToFloat(x[j]));
    if (lane == 0) la[h * lsa + t] = l;
  }
}

int64_t Blocks(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>(internal::CeilDiv(n, 256), 132 * 16)); }

}  // namespace

Status SumHeads(const void* x, int64_t T, int64_t H, int64_t d, int64_t token_stride,
                int64_t head_stride, void* out, int64_t out_stride, DType dtype,
                cudaStream_t stream, bool add_f32) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && d > 0, "SumHeads: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SumHeads", {
    if (add_f32) {
      SumHeadsKernel<scalar_t, float><<<Blocks(T * d), 256, 0, stream>>>(
          static_cast<const scalar_t*>(x), T, H, d, token_stride, head_stride,
          static_cast<float*>(out), out_stride);
    } else {
      SumHeadsKernel<scalar_t, scalar_t><<<Blocks(T * d), 256, 0, stream>>>(
          static_cast<const scalar_t*>(x), T, H, d, token_stride, head_stride,
          static_cast<scalar_t*>(out), out_stride);
    }
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

Status AddRows(void* dst, int64_t dst_stride, const void* src, int64_t src_stride, int64_t rows,
               int64_t width, DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && width >= 0 && dst_stride >= width && src_stride >= width,
                    "AddRows: bad sizes");
  if (rows == 0 || width == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "AddRows", {
    RowsKernel<scalar_t, scalar_t, true><<<Blocks(rows * width), 256, 0, stream>>>(
        static_cast<scalar_t*>(dst), dst_stride, static_cast<const scalar_t*>(src), src_stride,
        rows, width);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

namespace {
template <typename D>
Status CastRowsFrom(D* dst, int64_t dst_stride, const void* src, DType src_dtype,
                    int64_t src_stride, int64_t rows, int64_t width, bool accumulate,
                    cudaStream_t stream) {
  SPINDLE_DISPATCH_FLOAT_BF16(src_dtype, "CastRows", {
    const auto* s = static_cast<const scalar_t*>(src);
    if (accumulate) {
      RowsKernel<D, scalar_t, true>
          <<<Blocks(rows * width), 256, 0, stream>>>(dst, dst_stride, s, src_stride, rows, width);
    } else {
      RowsKernel<D, scalar_t, false>
          <<<Blocks(rows * width), 256, 0, stream>>>(dst, dst_stride, s, src_stride, rows, width);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <typename A>
Status MergeInto(A* o_a, int64_t tsa, float* lse_a, int64_t lsa, const void* o_b, DType b_dtype,
                 int64_t tsb, const float* lse_b, int64_t lsb, int64_t n, int64_t H, int64_t Dv,
                 cudaStream_t stream) {
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>(internal::CeilDiv(n * H, 8), 132 * 16));
  SPINDLE_DISPATCH_FLOAT_BF16(b_dtype, "AttentionMerge", {
    AttentionMergeKernel<A, scalar_t><<<blocks, 256, 0, stream>>>(
        o_a, tsa, lse_a, lsa, static_cast<const scalar_t*>(o_b), tsb, lse_b, lsb, n, H, Dv);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}
}  // namespace

Status CastRows(void* dst, DType dst_dtype, int64_t dst_stride, const void* src, DType src_dtype,
                int64_t src_stride, int64_t rows, int64_t width, cudaStream_t stream,
                bool accumulate) {
  SPINDLE_CHECK_ARG(rows >= 0 && width >= 0 && dst_stride >= width && src_stride >= width,
                    "CastRows: bad sizes");
  if (rows == 0 || width == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dst_dtype, "CastRows", {
    return CastRowsFrom(static_cast<scalar_t*>(dst), dst_stride, src, src_dtype, src_stride, rows,
                        width, accumulate, stream);
  });
  return Status::Ok();
}

Status AttentionMerge(void* o_a, DType a_dtype, int64_t o_a_token_stride, float* lse_a,
                      int64_t lse_a_stride, const void* o_b, DType b_dtype,
                      int64_t o_b_token_stride, const float* lse_b, int64_t lse_b_stride, int64_t n,
                      int64_t H, int64_t Dv, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0 && H > 0 && Dv > 0 && o_a_token_stride >= H * Dv &&
                        o_b_token_stride >= H * Dv && lse_a_stride >= n && lse_b_stride >= n,
                    "AttentionMerge: bad sizes or strides");
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(a_dtype, "AttentionMerge", {
    return MergeInto(static_cast<scalar_t*>(o_a), o_a_token_stride, lse_a, lse_a_stride, o_b,
                     b_dtype, o_b_token_stride, lse_b, lse_b_stride, n, H, Dv, stream);
  });
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
