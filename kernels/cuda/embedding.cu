// Embedding gather and its deterministic backward on CUDA. The backward sorts (id, token) pairs
// with CUB's radix sort, then one block per run of equal ids sums that id's rows in token order
// and adds the sum into the fp32 table gradient: no atomics, so repeated ids give the same bits
// on every run.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

using internal::CeilDiv;
using internal::FromFloat;
using internal::ToFloat;

template <typename T>
__global__ void EmbeddingFwdKernel(const int32_t* ids, const T* table, T* out, int64_t D) {
  const int64_t t = blockIdx.x;
  const T* src = table + static_cast<int64_t>(ids[t]) * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) out[t * D + j] = src[j];
}

__global__ void IotaKernel(int32_t* x, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<int32_t>(i);
}

// Block b handles sorted position b when it starts a run of equal ids.
template <typename T>
__global__ void EmbeddingBwdKernel(const int32_t* sorted_ids, const int32_t* sorted_tokens,
                                   const T* dout, float* dtable, int64_t T_, int64_t D) {
  const int64_t p = blockIdx.x;
  const int32_t id = sorted_ids[p];
  if (p > 0 && sorted_ids[p - 1] == id) return;
  int64_t end = p + 1;
  while (end < T_ && sorted_ids[end] == id) ++end;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    float s = 0.0f;
    for (int64_t q = p; q < end; ++q) s += ToFloat(dout[static_cast<int64_t>(sorted_tokens[q]) * D + j]);
    dtable[static_cast<int64_t>(id) * D + j] += s;
  }
}

// Workspace layout: ids_out, tokens_in, tokens_out (T int32 each, 256-byte aligned), CUB scratch.
size_t Align(size_t n) { return (n + 255) / 256 * 256; }
size_t CubBytes(int64_t T) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(T));
  return bytes;
}

}  // namespace

Status EmbeddingForward(const int32_t* ids, const void* table, void* out, int64_t T, int64_t D,
                        DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && D > 0, "EmbeddingForward: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "EmbeddingForward", {
    EmbeddingFwdKernel<scalar_t><<<T, 256, 0, stream>>>(
        ids, static_cast<const scalar_t*>(table), static_cast<scalar_t*>(out), D);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t EmbeddingBackwardWorkspaceBytes(int64_t T) {
  return 3 * Align(static_cast<size_t>(T) * 4) + Align(CubBytes(T));
}

Status EmbeddingBackward(const int32_t* ids, const void* dout, float* dtable, int64_t T, int64_t D,
                         int64_t vocab, DType dtype, Workspace ws, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && D > 0 && vocab > 0 && T < (int64_t{1} << 31),
                    "EmbeddingBackward: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= EmbeddingBackwardWorkspaceBytes(T),
                    "EmbeddingBackward: workspace too small");
  char* base = static_cast<char*>(ws.data);
  const size_t slot = Align(static_cast<size_t>(T) * 4);
  auto* ids_out = reinterpret_cast<int32_t*>(base);
  auto* tok_in = reinterpret_cast<int32_t*>(base + slot);
  auto* tok_out = reinterpret_cast<int32_t*>(base + 2 * slot);
  void* cub_tmp = base + 3 * slot;
  size_t cub_bytes = ws.bytes - 3 * slot;
  IotaKernel<<<CeilDiv(T, 256), 256, 0, stream>>>(tok_in, T);
  SPINDLE_CUDA_CHECK_LAUNCH();
  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) < vocab) ++end_bit;
  SPINDLE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, ids, ids_out, tok_in,
                                                     tok_out, static_cast<int>(T), 0, end_bit,
                                                     stream));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "EmbeddingBackward", {
    EmbeddingBwdKernel<scalar_t><<<T, 256, 0, stream>>>(
        ids_out, tok_out, static_cast<const scalar_t*>(dout), dtable, T, D);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
