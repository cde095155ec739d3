// The MoE FFN's expert inputs gathered and quantized to FP8 in one pass (GatherRowsFp8, moe.h):
// the permutation of the tokens into expert order fused with the tensorwise quantization of
// fp8.h, writing the row-major codes and the transposed codes of the whole gathered tensor.
//
// A block owns a 64 x 64 tile of the gathered [rows, D]: each thread loads 8 consecutive values
// of a gathered row (one 16-byte bf16 vector or two fp32 ones; zeros for a padding row), scales
// them with the scale every block computes from the amax (the same fp32 operations as
// Fp8QuantizeFromAmax and the CPU's QuantizeScaled: code = satfinite(value * scale), rounded to
// nearest even), stores their 8 codes as one word, and keeps them in shared memory, from which
// the transposed codes leave 8 at a time. Block 0 publishes the scale and its inverse.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::Aligned16;
using internal::CeilDiv;
using internal::Load16;
using internal::Load8;
using internal::Unpack;

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kSeg = 8;

__device__ __forceinline__ uint8_t ToFp8(float v, int e5m2) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
}

struct QuantOut {
  uint8_t* codes;
  uint8_t* codes_t;
  const float* amax;
  float* scale;
  float* inverse;
  int e5m2;
  float fmax;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    GatherQuantizeKernel(const T* in, const int32_t* src, int64_t rows, int64_t D, QuantOut out) {
  __shared__ __align__(16) uint8_t codes[kTile][kTile + 8];
  const float amax = *out.amax;
  // scale = fmax / max(amax, 1e-12), NaN kept, as cpu::TensorwiseScale.
  const float scale = __fdiv_rn(out.fmax, isnan(amax) ? amax : fmaxf(amax, 1e-12f));
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (out.scale != nullptr) *out.scale = scale;
    *out.inverse = __fdiv_rn(1.0f, scale);
  }
  const int64_t tiles_c = (D + kTile - 1) / kTile;
  const int64_t r0 = blockIdx.x / tiles_c * kTile, c0 = blockIdx.x % tiles_c * kTile;
  constexpr int kSegs = kTile / kSeg;
  for (int i = threadIdx.x; i < kTile * kSegs; i += kThreads) {
    const int r = i / kSegs, c = i % kSegs * kSeg;
    const int64_t R = r0 + r, C = c0 + c;
    if (R < rows && C < D) {
      const int32_t s = src[R];
      float v[kSeg];
      if (s >= 0) {
        Load8(in + static_cast<int64_t>(s) * D + C, v);
      } else {
#pragma unroll
        for (int k = 0; k < kSeg; ++k) v[k] = 0.0f;
      }
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int k = 0; k < kSeg; ++k) {
        w[k / 4] |= uint32_t{ToFp8(__fmul_rn(v[k], scale), out.e5m2)} << (8 * (k % 4));
      }
      if (out.codes != nullptr) {
        *reinterpret_cast<uint2*>(out.codes + R * D + C) = make_uint2(w[0], w[1]);
      }
      *reinterpret_cast<uint32_t*>(&codes[r][c]) = w[0];
      *reinterpret_cast<uint32_t*>(&codes[r][c + 4]) = w[1];
    }
  }
  if (out.codes_t == nullptr) return;  // uniform over the block
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * kSegs; i += kThreads) {
    const int c = i / kSegs, r = i % kSegs * kSeg;
    const int64_t R = r0 + r, C = c0 + c;
    if (R < rows && C < D) {
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int k = 0; k < kSeg; ++k) w[k / 4] |= uint32_t{codes[r + k][c]} << (8 * (k % 4));
      *reinterpret_cast<uint2*>(out.codes_t + C * rows + R) = make_uint2(w[0], w[1]);
    }
  }
}

inline bool Aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

}  // namespace

Status GatherRowsFp8(const void* in, const int32_t* src, int64_t rows, int64_t D, DType dtype,
                     const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && rows % 16 == 0 && D % 16 == 0,
                    "GatherRowsFp8: rows and D must be multiples of 16");
  if (!IsFp8(q.format)) return internal::UnsupportedDType(q.format, "GatherRowsFp8");
  SPINDLE_CHECK_ARG(q.amax != nullptr && q.inverse_scale != nullptr,
                    "GatherRowsFp8: amax and inverse_scale are required");
  SPINDLE_CHECK_ARG(q.codes != nullptr || q.codes_t != nullptr,
                    "GatherRowsFp8: neither codes nor codes_t given");
  SPINDLE_CHECK_ARG(Aligned16(in) && (q.codes == nullptr || Aligned8(q.codes)) &&
                        (q.codes_t == nullptr || Aligned8(q.codes_t)),
                    "GatherRowsFp8: in must be 16-byte aligned, the codes 8-byte aligned");
  const QuantOut out{static_cast<uint8_t*>(q.codes),
                     static_cast<uint8_t*>(q.codes_t),
                     q.amax,
                     q.scale,
                     q.inverse_scale,
                     q.format == DType::kFp8E5M2 ? 1 : 0,
                     Fp8MaxOf(q.format)};
  // At least one block, which publishes the scale of an empty tensor.
  const int64_t blocks = std::max<int64_t>(CeilDiv(rows, kTile) * CeilDiv(D, kTile), 1);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GatherRowsFp8", {
    GatherQuantizeKernel<scalar_t>
        <<<blocks, kThreads, 0, stream>>>(static_cast<const scalar_t*>(in), src, rows, D, out);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
