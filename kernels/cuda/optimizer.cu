// Multi-tensor AdamW on CUDA: fp32 master weights and moments, optional bf16 copy of the updated
// weights, many tensors per launch. The tensor table travels in the kernel arguments: up to
// kMaxTensors tensors and the first block of each; block b finds its tensor by binary search and
// updates one chunk of kChunk values of it (float4 loads when the tensor's pointers allow). Every
// block of a launch is independent, so a launch fills the GPU however the tensors are sized.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

constexpr int kMaxTensors = 60;
constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 4 * 8;  // values per block: 8 float4 per thread

struct TensorTable {
  AdamWTensor t[kMaxTensors];
  int32_t first_block[kMaxTensors + 1];  // tensor i: blocks [first_block[i], first_block[i + 1])
  int32_t n;
};
static_assert(sizeof(TensorTable) + 64 < 4096, "kernel argument space");

struct AdamWArgs {
  float lr, b1, b2, eps, bc1, bc2, grad_scale;
};

// The update of one value; the same expression in the scalar and vector paths.
__device__ __forceinline__ void Update(const AdamWArgs& a, float wd, float g, float& p, float& m,
                                       float& v) {
  g *= a.grad_scale;
  m = a.b1 * m + (1.0f - a.b1) * g;
  v = a.b2 * v + (1.0f - a.b2) * g * g;
  const float mhat = m / a.bc1, vhat = v / a.bc2;
  p -= a.lr * (wd * p + mhat / (sqrtf(vhat) + a.eps));
}

__global__ void __launch_bounds__(kThreads) AdamWKernel(TensorTable table, AdamWArgs a) {
  const int b = static_cast<int>(blockIdx.x);
  int lo = 0, hi = table.n - 1;  // last tensor with first_block <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table.first_block[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const AdamWTensor& T = table.t[lo];
  const int64_t begin = static_cast<int64_t>(b - table.first_block[lo]) * kChunk;
  const int64_t end = std::min(begin + kChunk, T.n);
  auto* pb = static_cast<__nv_bfloat16*>(T.p_bf16);
  const float wd = T.weight_decay;
  const bool vec = ((reinterpret_cast<uintptr_t>(T.p) | reinterpret_cast<uintptr_t>(T.g) |
                     reinterpret_cast<uintptr_t>(T.m) | reinterpret_cast<uintptr_t>(T.v)) &
                    15u) == 0 &&
                   (reinterpret_cast<uintptr_t>(pb) & 7u) == 0;
  int64_t scalar_begin = begin;
  if (vec) {
    // begin is a multiple of kChunk, so every i below is a multiple of 4: aligned.
    const int64_t vec_end = begin + ((end - begin) & ~int64_t{3});
    for (int64_t i = begin + 4 * threadIdx.x; i < vec_end; i += 4 * kThreads) {
      const float4 g = *reinterpret_cast<const float4*>(T.g + i);
      float4 p = *reinterpret_cast<const float4*>(T.p + i);
      float4 m = *reinterpret_cast<const float4*>(T.m + i);
      float4 v = *reinterpret_cast<const float4*>(T.v + i);
      Update(a, wd, g.x, p.x, m.x, v.x);
      Update(a, wd, g.y, p.y, m.y, v.y);
      Update(a, wd, g.z, p.z, m.z, v.z);
      Update(a, wd, g.w, p.w, m.w, v.w);
      *reinterpret_cast<float4*>(T.m + i) = m;
      *reinterpret_cast<float4*>(T.v + i) = v;
      *reinterpret_cast<float4*>(T.p + i) = p;
      if (pb != nullptr) {
        const __nv_bfloat162 lo2 = __floats2bfloat162_rn(p.x, p.y);
        const __nv_bfloat162 hi2 = __floats2bfloat162_rn(p.z, p.w);
        uint2 packed;
        packed.x = static_cast<uint32_t>(__bfloat16_as_ushort(lo2.x)) |
                   (static_cast<uint32_t>(__bfloat16_as_ushort(lo2.y)) << 16);
        packed.y = static_cast<uint32_t>(__bfloat16_as_ushort(hi2.x)) |
                   (static_cast<uint32_t>(__bfloat16_as_ushort(hi2.y)) << 16);
        *reinterpret_cast<uint2*>(pb + i) = packed;
      }
    }
    scalar_begin = vec_end;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) {
    float p = T.p[i], m = T.m[i], v = T.v[i];
    Update(a, wd, T.g[i], p, m, v);
    T.m[i] = m;
    T.v[i] = v;
    T.p[i] = p;
    if (pb != nullptr) pb[i] = __float2bfloat16(p);
  }
}

}  // namespace

Status AdamWMultiTensor(const AdamWTensor* tensors, int64_t n_tensors, const AdamWHyper& hp,
                        cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n_tensors >= 0 && hp.step >= 1, "AdamWMultiTensor: bad arguments");
  const float bc1 = 1.0f - std::pow(hp.beta1, static_cast<float>(hp.step));
  const float bc2 = 1.0f - std::pow(hp.beta2, static_cast<float>(hp.step));
  const AdamWArgs args{hp.lr, hp.beta1, hp.beta2, hp.eps, bc1, bc2, hp.grad_scale};
  constexpr int64_t kMaxBlocksPerLaunch = int64_t{1} << 30;
  TensorTable table{};
  int n_t = 0;
  int64_t n_b = 0;
  auto flush = [&]() -> Status {
    if (n_t > 0) {
      table.n = n_t;
      table.first_block[n_t] = static_cast<int32_t>(n_b);
      AdamWKernel<<<static_cast<unsigned>(n_b), kThreads, 0, stream>>>(table, args);
      SPINDLE_CUDA_CHECK_LAUNCH();
    }
    n_t = 0, n_b = 0;
    return Status::Ok();
  };
  for (int64_t i = 0; i < n_tensors; ++i) {
    const AdamWTensor& t = tensors[i];
    SPINDLE_CHECK_ARG(t.n >= 0 && internal::CeilDiv(t.n, kChunk) < kMaxBlocksPerLaunch,
                      "AdamWMultiTensor: bad size");
    if (t.n == 0) continue;
    const int64_t chunks = internal::CeilDiv(t.n, kChunk);
    if (n_t == kMaxTensors || n_b + chunks > kMaxBlocksPerLaunch) SPINDLE_RETURN_IF_ERROR(flush());
    table.t[n_t] = t;
    table.first_block[n_t] = static_cast<int32_t>(n_b);
    ++n_t;
    n_b += chunks;
  }
  return flush();
}

}  // namespace spindle::kernels::cuda
