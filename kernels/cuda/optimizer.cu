// Multi-tensor AdamW on CUDA: fp32 master weights and moments, optional bf16 copy of the updated
// weights, many tensors per launch (the tensor table travels in the kernel arguments).
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 32768;  // elements per block
constexpr int kThreads = 256;

struct TensorTable {
  AdamWTensor t[kMaxTensors];
  int32_t block_chunk[kMaxBlocks];
  uint8_t block_tensor[kMaxBlocks];
};
static_assert(sizeof(TensorTable) + 64 < 4096, "kernel argument space");

__global__ void AdamWKernel(TensorTable table, float lr, float b1, float b2, float eps, float bc1,
                            float bc2, float grad_scale) {
  const AdamWTensor& T = table.t[table.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = std::min(begin + kChunk, T.n);
  auto* pb = static_cast<__nv_bfloat16*>(T.p_bf16);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float g = T.g[i] * grad_scale;
    const float m = b1 * T.m[i] + (1.0f - b1) * g;
    const float v = b2 * T.v[i] + (1.0f - b2) * g * g;
    T.m[i] = m;
    T.v[i] = v;
    const float mhat = m / bc1, vhat = v / bc2;
    float p = T.p[i];
    p -= lr * (T.weight_decay * p + mhat / (sqrtf(vhat) + eps));
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
  TensorTable table{};
  int n_t = 0, n_b = 0;
  auto flush = [&]() -> Status {
    if (n_b > 0) {
      AdamWKernel<<<n_b, kThreads, 0, stream>>>(table, hp.lr, hp.beta1, hp.beta2, hp.eps, bc1, bc2,
                                                hp.grad_scale);
      SPINDLE_CUDA_CHECK_LAUNCH();
    }
    n_t = 0, n_b = 0;
    return Status::Ok();
  };
  for (int64_t i = 0; i < n_tensors; ++i) {
    const AdamWTensor& t = tensors[i];
    SPINDLE_CHECK_ARG(t.n >= 0 && t.n / kChunk < (int64_t{1} << 31), "AdamWMultiTensor: bad size");
    if (t.n == 0) continue;
    const int64_t chunks = internal::CeilDiv(t.n, kChunk);
    for (int64_t c = 0; c < chunks; ++c) {
      if (n_b == kMaxBlocks || (c == 0 && n_t == kMaxTensors)) SPINDLE_RETURN_IF_ERROR(flush());
      if (c == 0 || n_b == 0) {
        table.t[n_t++] = t;
      }
      table.block_tensor[n_b] = static_cast<uint8_t>(n_t - 1);
      table.block_chunk[n_b] = static_cast<int32_t>(c);
      ++n_b;
    }
  }
  return flush();
}

}  // namespace spindle::kernels::cuda
