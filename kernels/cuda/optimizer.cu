// Multi-tensor optimizers on CUDA (AdamW, SGD with or without momentum): fp32 master weights and
// optimizer state, optional bf16 copy of the updated weights, many tensors per launch. The tensor
// table travels in the kernel arguments: up to kMaxTensors tensors and the first block of each;
// block b finds its tensor by binary search and updates one chunk of kChunk values of it (float4
// loads when the tensor's pointers allow). Every block of a launch is independent, so a launch
// fills the GPU however the tensors are sized.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

constexpr int kMaxTensors = 60;
constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 4 * 8;  // values per block: 8 float4 per thread

struct TensorTable {
  OptimizerTensor t[kMaxTensors];
  int32_t first_block[kMaxTensors + 1];  // tensor i: blocks [first_block[i], first_block[i + 1])
  int32_t n;
};
static_assert(sizeof(TensorTable) + 64 < 4096, "kernel argument space");

// Update rules: the same expression in the scalar and vector paths. kM / kV: whether the rule
// reads and writes the tensor's m / v.
struct AdamWRule {
  static constexpr bool kM = true, kV = true;
  float lr, b1, b2, eps, bc1, bc2, grad_scale;
  __device__ __forceinline__ void operator()(float wd, float g, float& p, float& m,
                                             float& v) const {
    g *= grad_scale;
    m = b1 * m + (1.0f - b1) * g;
    v = b2 * v + (1.0f - b2) * g * g;
    const float mhat = m / bc1, vhat = v / bc2;
    p -= lr * (wd * p + mhat / (sqrtf(vhat) + eps));
  }
};
template <bool kMomentum>
struct SgdRule {
  static constexpr bool kM = kMomentum, kV = false;
  float lr, momentum, grad_scale;
  __device__ __forceinline__ void operator()(float wd, float g, float& p, float& m,
                                             float& /*v*/) const {
    const float d = g * grad_scale + wd * p;
    if constexpr (kMomentum) {
      m = momentum * m + d;
      p -= lr * m;
    } else {
      p -= lr * d;
    }
  }
};

template <class Rule>
__global__ void __launch_bounds__(kThreads) MultiTensorKernel(TensorTable table, Rule rule) {
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
  const OptimizerTensor& T = table.t[lo];
  const int64_t begin = static_cast<int64_t>(b - table.first_block[lo]) * kChunk;
  const int64_t end = std::min(begin + kChunk, T.n);
  auto* pb = static_cast<__nv_bfloat16*>(T.p_bf16);
  const float wd = T.weight_decay;
  float* const m = Rule::kM ? T.m : nullptr;
  float* const v = Rule::kV ? T.v : nullptr;
  const bool vec = ((reinterpret_cast<uintptr_t>(T.p) | reinterpret_cast<uintptr_t>(T.g) |
                     reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v)) &
                    15u) == 0 &&
                   (reinterpret_cast<uintptr_t>(pb) & 7u) == 0;
  int64_t scalar_begin = begin;
  if (vec) {
    // begin is a multiple of kChunk, so every i below is a multiple of 4: aligned.
    const int64_t vec_end = begin + ((end - begin) & ~int64_t{3});
    for (int64_t i = begin + 4 * threadIdx.x; i < vec_end; i += 4 * kThreads) {
      const float4 g = *reinterpret_cast<const float4*>(T.g + i);
      float4 p = *reinterpret_cast<const float4*>(T.p + i);
      float4 mv = make_float4(0, 0, 0, 0), vv = make_float4(0, 0, 0, 0);
      if constexpr (Rule::kM) mv = *reinterpret_cast<const float4*>(m + i);
      if constexpr (Rule::kV) vv = *reinterpret_cast<const float4*>(v + i);
      rule(wd, g.x, p.x, mv.x, vv.x);
      rule(wd, g.y, p.y, mv.y, vv.y);
      rule(wd, g.z, p.z, mv.z, vv.z);
      rule(wd, g.w, p.w, mv.w, vv.w);
      if constexpr (Rule::kM) *reinterpret_cast<float4*>(m + i) = mv;
      if constexpr (Rule::kV) *reinterpret_cast<float4*>(v + i) = vv;
      *reinterpret_cast<float4*>(T.p + i) = p;
      if (pb != nullptr)
        *reinterpret_cast<uint2*>(pb + i) =
            make_uint2(internal::PackBf16x2(p.x, p.y), internal::PackBf16x2(p.z, p.w));
    }
    scalar_begin = vec_end;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) {
    float p = T.p[i], mi = 0.0f, vi = 0.0f;
    if constexpr (Rule::kM) mi = m[i];
    if constexpr (Rule::kV) vi = v[i];
    rule(wd, T.g[i], p, mi, vi);
    if constexpr (Rule::kM) m[i] = mi;
    if constexpr (Rule::kV) v[i] = vi;
    T.p[i] = p;
    if (pb != nullptr) pb[i] = __float2bfloat16(p);
  }
}

// Runs `rule` over every tensor in as few launches as the table allows.
template <class Rule>
Status LaunchMultiTensor(const OptimizerTensor* tensors, int64_t n_tensors, const Rule& rule,
                         const char* op, cudaStream_t stream) {
  constexpr int64_t kMaxBlocksPerLaunch = int64_t{1} << 30;
  TensorTable table{};
  int n_t = 0;
  int64_t n_b = 0;
  auto flush = [&]() -> Status {
    if (n_t > 0) {
      table.n = n_t;
      table.first_block[n_t] = static_cast<int32_t>(n_b);
      MultiTensorKernel<Rule><<<static_cast<unsigned>(n_b), kThreads, 0, stream>>>(table, rule);
      SPINDLE_CUDA_CHECK_LAUNCH();
    }
    n_t = 0, n_b = 0;
    return Status::Ok();
  };
  for (int64_t i = 0; i < n_tensors; ++i) {
    const OptimizerTensor& t = tensors[i];
    if (t.n < 0 || internal::CeilDiv(t.n, kChunk) >= kMaxBlocksPerLaunch ||
        (t.n > 0 && ((Rule::kM && t.m == nullptr) || (Rule::kV && t.v == nullptr)))) {
      return {StatusCode::kInvalidArgument,
              std::string(op) + ": tensor " + std::to_string(i) +
                  " has a bad size or lacks the optimizer state the rule needs"};
    }
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

}  // namespace

Status AdamWMultiTensor(const OptimizerTensor* tensors, int64_t n_tensors, const AdamWHyper& hp,
                        cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n_tensors >= 0 && hp.step >= 1, "AdamWMultiTensor: bad arguments");
  const float bc1 = 1.0f - std::pow(hp.beta1, static_cast<float>(hp.step));
  const float bc2 = 1.0f - std::pow(hp.beta2, static_cast<float>(hp.step));
  const AdamWRule rule{hp.lr, hp.beta1, hp.beta2, hp.eps, bc1, bc2, hp.grad_scale};
  return LaunchMultiTensor(tensors, n_tensors, rule, "AdamWMultiTensor", stream);
}

Status SgdMultiTensor(const OptimizerTensor* tensors, int64_t n_tensors, const SgdHyper& hp,
                      cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n_tensors >= 0, "SgdMultiTensor: bad arguments");
  if (hp.momentum == 0.0f) {
    return LaunchMultiTensor(tensors, n_tensors, SgdRule<false>{hp.lr, 0.0f, hp.grad_scale},
                             "SgdMultiTensor", stream);
  }
  return LaunchMultiTensor(tensors, n_tensors, SgdRule<true>{hp.lr, hp.momentum, hp.grad_scale},
                           "SgdMultiTensor", stream);
}

}  // namespace spindle::kernels::cuda
