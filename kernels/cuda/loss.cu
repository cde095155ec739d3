// Cross-entropy over rows of logits fused with its gradient, and a fixed-order sum, on CUDA.
// The fused linear + cross-entropy of the LM head runs one GEMM per block of rows into a
// [rows, V] logits buffer, then this kernel over the block: fp32 logits never exist for the whole
// sequence.
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

using internal::FromFloat;
using internal::ToFloat;

constexpr int kThreads = 512;

// (max, sum of exp(x - max)) merge.
__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float nm = fmaxf(m, m2);
  if (nm == -INFINITY) return;
  s = s * __expf(m - nm) + s2 * __expf(m2 - nm);
  m = nm;
}

template <typename T>
__global__ void CrossEntropyKernel(const T* logits, const int32_t* targets, int64_t V,
                                   float grad_scale, float* row_loss, T* dlogits) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  __shared__ float row_max, row_sum, target_logit;
  const int64_t t = blockIdx.x;
  const T* x = logits + t * V;
  const int32_t target = targets[t];
  if (target < 0) {
    if (threadIdx.x == 0) row_loss[t] = 0.0f;
    if (dlogits != nullptr) {
      for (int64_t j = threadIdx.x; j < V; j += kThreads) dlogits[t * V + j] = FromFloat<T>(0.0f);
    }
    return;
  }
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) Merge(m, s, ToFloat(x[j]), 1.0f);
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    Merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sm[warp] = m, ss[warp] = s;
  if (threadIdx.x == 0) target_logit = ToFloat(x[target]);
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sm[0], bs = ss[0];
    for (int w = 1; w < kThreads / 32; ++w) Merge(bm, bs, sm[w], ss[w]);
    row_max = bm, row_sum = bs;
    row_loss[t] = bm + logf(bs) - target_logit;
  }
  __syncthreads();
  if (dlogits == nullptr) return;
  const float mx = row_max, inv = 1.0f / row_sum;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    const float p = __expf(ToFloat(x[j]) - mx) * inv;
    dlogits[t * V + j] = FromFloat<T>(grad_scale * (p - (j == target ? 1.0f : 0.0f)));
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
                    cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && V > 0, "CrossEntropy: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "CrossEntropy", {
    CrossEntropyKernel<scalar_t><<<T, kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(logits), targets, V, grad_scale, row_loss,
        static_cast<scalar_t*>(dlogits));
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
