// Private to the FP8 quantizers (fp8.cu, fp8_blockwise.cu): the values each quantizes, as
// "sources" that give the fp32 value at (r, c) of a [rows, cols] tensor: a stored tensor, or a
// producer's result recomputed from its inputs and kept statistics (RMSNorm, SwiGLU, the group
// RMSNorm + gate) with the same fp32 operations as the producer's first pass (__fmul_rn, no
// contraction), so that both passes, and both recipes, quantize the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda::internal::fp8 {

// The vector paths: a thread loads kSeg consecutive values of a row (one 16-byte bf16 vector, two
// fp32 ones) and stores their kSeg codes as one 8-byte word, in both layouts.
constexpr int kSeg = 8;

using internal::Load8;  // kSeg values of T from p (16-byte aligned) as floats

// The fused producers' fp32 results, written once and used by both passes.
__device__ __forceinline__ float RmsValue(float x, float rstd, float w) {
  return __fmul_rn(__fmul_rn(x, rstd), w);
}
__device__ __forceinline__ float SwiGluValue(float g, float u) {
  return __fmul_rn(__fmul_rn(g, Sigmoid(g)), u);
}
__device__ __forceinline__ float GroupGateValue(float o, float rstd, float w, float gate) {
  return __fmul_rn(__fmul_rn(__fmul_rn(o, rstd), w), Sigmoid(gate));
}

// Sources of pass 2: the value at (r, c) of a [rows, cols] tensor.
// Each also loads kSeg values (r, c .. c + kSeg - 1) at once where Vec() holds (checked on the
// host: cols a multiple of kSeg, every pointer 16-byte aligned), with the same fp32 operations.
template <typename T>
struct StoredSource {
  const T* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return ToFloat(x[r * cols + c]); }
  __device__ void Load(int64_t r, int64_t c, float (&v)[kSeg]) const { Load8(x + r * cols + c, v); }
  bool Vec() const { return cols % kSeg == 0 && Aligned16(x); }
};
template <typename T>
struct RmsSource {
  const T* x;  // the normalized input (h with the residual add)
  const T* w;
  const float* rstd;
  int64_t D;
  __device__ float operator()(int64_t r, int64_t c) const {
    return RmsValue(ToFloat(x[r * D + c]), rstd[r], ToFloat(w[c]));
  }
  __device__ void Load(int64_t r, int64_t c, float (&v)[kSeg]) const {
    float wv[kSeg];
    Load8(x + r * D + c, v);
    Load8(w + c, wv);
    const float rs = rstd[r];
#pragma unroll
    for (int k = 0; k < kSeg; ++k) v[k] = RmsValue(v[k], rs, wv[k]);
  }
  bool Vec() const { return D % kSeg == 0 && Aligned16(x) && Aligned16(w); }
};
template <typename T>
struct SwiGluSource {
  const T* g;
  const T* u;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return SwiGluValue(ToFloat(g[r * cols + c]), ToFloat(u[r * cols + c]));
  }
  __device__ void Load(int64_t r, int64_t c, float (&v)[kSeg]) const {
    float uv[kSeg];
    Load8(g + r * cols + c, v);
    Load8(u + r * cols + c, uv);
#pragma unroll
    for (int k = 0; k < kSeg; ++k) v[k] = SwiGluValue(v[k], uv[k]);
  }
  bool Vec() const { return cols % kSeg == 0 && Aligned16(g) && Aligned16(u); }
};
template <typename T>
struct GroupGateSource {
  const T* o;
  const T* w;
  const T* gate;
  const float* rstd;  // [T * H]
  int64_t H, Dh;
  __device__ float operator()(int64_t t, int64_t c) const {
    const int64_t i = t * H * Dh + c;
    return GroupGateValue(ToFloat(o[i]), rstd[t * H + c / Dh], ToFloat(w[c]), ToFloat(gate[i]));
  }
  __device__ void Load(int64_t t, int64_t c, float (&v)[kSeg]) const {
    const int64_t i = t * H * Dh + c;
    float wv[kSeg], gv[kSeg];
    Load8(o + i, v);
    Load8(w + c, wv);
    Load8(gate + i, gv);
    // A segment may cross heads (Dh need not divide by kSeg). c < H Dh <= kMaxRowWidth: the head
    // in 32-bit arithmetic, and its statistic loaded once per head.
    const int dh = static_cast<int>(Dh);
    int h = static_cast<int>(c) / dh, j = static_cast<int>(c) - h * dh;
    const float* rs = rstd + t * H;
    float r = rs[h];
#pragma unroll
    for (int k = 0; k < kSeg; ++k) {
      if (j == dh) r = rs[++h], j = 0;
      v[k] = GroupGateValue(v[k], r, wv[k], gv[k]);
      ++j;
    }
  }
  bool Vec() const { return H * Dh % kSeg == 0 && Aligned16(o) && Aligned16(w) && Aligned16(gate); }
};

}  // namespace spindle::kernels::cuda::internal::fp8
