// Cross-entropy (with the optional z-loss) over rows of logits fused with its gradient, and a
// fixed-order sum, on CUDA.
// The fused linear + cross-entropy of the LM head runs one GEMM per block of rows into a
// [rows, V] logits buffer, then this kernel over the block: fp32 logits never exist for the whole
// sequence. One block per row. Rows of whole 16-byte vectors (V a multiple of 8 bf16 or 4 fp32
// values, aligned buffers) take the vector kernel: one pass for the row's max and sum with one
// exp per value, one that rereads the row (mostly from L2) and writes the gradient. Other rows
// take the scalar kernel (an online max / sum merge per value, then the same second pass).
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::kVec;
using internal::ToFloat;

constexpr int kThreads = 512;

// (max, sum of exp(x - max)) merge.
__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float nm = fmaxf(m, m2);
  if (nm == -INFINITY) return;
  s = s * __expf(m - nm) + s2 * __expf(m2 - nm);
  m = nm;
}

// The row's (max, sum of exp(x - max)) from every thread's pair; also writes the row's loss.
// Returns (max, (1 + 2 z_loss lse) / sum) to every thread: the factor of exp(x - max) in the
// gradient (1 / sum without z-loss).
__device__ __forceinline__ float2 RowSoftmaxStats(float m, float s, float target_logit,
                                                  float z_loss, float* loss) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  __shared__ float row_max, row_factor;
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    Merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sm[warp] = m, ss[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sm[0], bs = ss[0];
    for (int w = 1; w < kThreads / 32; ++w) Merge(bm, bs, sm[w], ss[w]);
    const float lse = bm + logf(bs);
    row_max = bm, row_factor = z_loss > 0.0f ? (1.0f + 2.0f * z_loss * lse) / bs : 1.0f / bs;
    *loss = lse - target_logit;
  }
  __syncthreads();
  return make_float2(row_max, row_factor);
}

// kVector: the row as 16-byte vectors (V % kVec<T> == 0, aligned); otherwise value by value.
template <typename T, bool kVector>
__global__ void CrossEntropyKernel(const T* logits, const int32_t* targets, int64_t V,
                                   float grad_scale, float z_loss, float* row_loss,
                                   T* dlogits) {
  constexpr int kN = kVec<T>;
  const int64_t t = blockIdx.x;
  const T* x = logits + t * V;
  T* dx = dlogits == nullptr ? nullptr : dlogits + t * V;
  const int32_t target = targets[t];
  if (target < 0) {
    if (threadIdx.x == 0) row_loss[t] = 0.0f;
    if (dx != nullptr) {
      for (int64_t j = threadIdx.x; j < V; j += kThreads) dx[j] = FromFloat<T>(0.0f);
    }
    return;
  }
  // Read before any thread overwrites the row (dlogits may be logits).
  const float target_logit = threadIdx.x == 0 ? ToFloat(x[target]) : 0.0f;
  float m = -INFINITY, s = 0.0f;
  if constexpr (kVector) {
    for (int64_t i = threadIdx.x; i < V / kN; i += kThreads) {
      float f[kN];
      internal::Unpack<T>(internal::Load16(x + i * kN), f);
      float vm = f[0];
#pragma unroll
      for (int k = 1; k < kN; ++k) vm = fmaxf(vm, f[k]);
      if (vm == -INFINITY) continue;  // adds nothing (and exp(-inf - -inf) is NaN)
      if (vm > m) s *= __expf(m - vm), m = vm;
#pragma unroll
      for (int k = 0; k < kN; ++k) s += __expf(f[k] - m);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) Merge(m, s, ToFloat(x[j]), 1.0f);
  }
  const float2 stats = RowSoftmaxStats(m, s, target_logit, z_loss, row_loss + t);
  if (dx == nullptr) return;
  const float mx = stats.x, inv = stats.y;
  if constexpr (kVector) {
    for (int64_t i = threadIdx.x; i < V / kN; i += kThreads) {
      float f[kN];
      internal::Unpack<T>(internal::Load16(x + i * kN), f);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        f[k] = grad_scale * (__expf(f[k] - mx) * inv - (i * kN + k == target ? 1.0f : 0.0f));
      }
      internal::Store16(dx + i * kN, internal::Pack<T>(f));
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const float p = __expf(ToFloat(x[j]) - mx) * inv;
      dx[j] = FromFloat<T>(grad_scale * (p - (j == target ? 1.0f : 0.0f)));
    }
  }
}

__global__ void SumRowsKernel(const float* x, int64_t n, double* out) {
  __shared__ double part[1024];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

}  // namespace

Status CrossEntropy(const void* logits, const int32_t* targets, int64_t T, int64_t V,
                    float grad_scale, float* row_loss, void* dlogits, DType dtype,
                    cudaStream_t stream, float z_loss) {
  SPINDLE_CHECK_ARG(T >= 0 && V > 0, "CrossEntropy: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "CrossEntropy", {
    const bool vector = V % kVec<scalar_t> == 0 && internal::Aligned16(logits) &&
                        (dlogits == nullptr || internal::Aligned16(dlogits));
    auto* kernel =
        vector ? CrossEntropyKernel<scalar_t, true> : CrossEntropyKernel<scalar_t, false>;
    kernel<<<T, kThreads, 0, stream>>>(static_cast<const scalar_t*>(logits), targets, V, grad_scale,
                                       z_loss, row_loss, static_cast<scalar_t*>(dlogits));
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status SumRows(const float* x, int64_t n, double* sum, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0, "SumRows: negative size");
  SumRowsKernel<<<1, 1024, 0, stream>>>(x, n, sum);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
