// FP8 quantization on CUDA (see fp8.h): the amax reduction, the tiled quantize kernel that writes
// the codes and their transposed copy, the multi-tensor cast of the master weights, and the
// RMSNorm / SwiGLU / group norm + gate producers with the quantization fused.
//
// Scheme, and why. Current scaling needs the whole tensor's amax before the first value is
// quantized, so every quantization takes two passes with a grid-wide dependency between them.
//  - Pass 1 (the producer) computes its fp32 results, writes what it must keep (rstd, the residual
//    sum h, the bf16 y when asked for) and reduces max |result| into the device amax: a per-block
//    max in registers and shared memory, then one atomicMax on the float's bits (non-negative
//    floats order as unsigned integers, and NaN's bits exceed infinity's, so a NaN propagates).
//    A max is exact in any order: the amax is bitwise reproducible.
//  - Pass 2 reads the inputs again with the saved statistics, recomputes each result with the
//    same fp32 operations (__fmul_rn, no contraction: the same bits as pass 1), and quantizes it.
//    Each block computes the scale from the amax itself (IEEE division, as the CPU's); the first
//    block writes the scale and the inverse that the GEMM reads. A block owns a 64 x 64 tile: it
//    writes the row-major codes directly and the transposed codes through shared memory, so both
//    layouts come from one read of the inputs.
//  - A recomputed forward runs pass 2 alone (the *QuantizeFp8 functions): its inputs are the first
//    forward's, so the caller keeps that forward's statistics and amax instead of a second pass 1.
// Recomputing instead of quantizing a stored bf16 y costs nothing extra where y is not needed (no
// backward reads a norm's or SwiGLU's output once its GEMMs take FP8 codes: the backward's weight
// gradient multiplies the transposed codes) and matches the CPU emulation, which quantizes the
// fp32 result before its bf16 store; quantizing the bf16 y instead would move codes by one FP8
// step where the bf16 rounding crosses an FP8 rounding boundary. An fp32 scratch copy of y would
// be exact too but doubles pass 1's writes.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/cuda/amax.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/fp8_sources.cuh"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::CeilDiv;
using internal::FromFloat;
using internal::Sigmoid;
using internal::ToFloat;
using internal::WarpSum;
using internal::AbsBits;
using internal::Aligned16;
using internal::BlockMaxToGlobal;
using internal::FindTensor;
using internal::Load16;
using internal::Unpack;
using internal::fp8::GroupGateSource;
using internal::fp8::GroupGateValue;
using internal::fp8::kSeg;
using internal::fp8::Load8;
using internal::fp8::RmsSource;
using internal::fp8::RmsValue;
using internal::fp8::StoredSource;
using internal::fp8::SwiGluSource;
using internal::fp8::SwiGluValue;

constexpr int kTile = 64;  // pass 2: a block quantizes a kTile x kTile tile
constexpr int kTileThreads = 256;
constexpr int kAmaxThreads = 256;                  // pass 1 of a stored tensor
constexpr int64_t kAmaxChunk = kAmaxThreads * 16;  // values per block
constexpr int kRowWarps = 8;                       // the norms' pass 1: one warp per row
constexpr int64_t kMaxRowWidth = 12288;
constexpr int kMaxCastTensors = 32;

// The device side of an Fp8Output.
struct Fp8Dev {
  uint8_t* codes;
  uint8_t* codes_t;
  const float* amax;
  float* scale;
  float* inverse;
  int e5m2;    // 0: E4M3, 1: E5M2
  float fmax;  // the format's largest finite value
};

__device__ __forceinline__ uint8_t ToFp8(float v, int e5m2) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
}

// scale = fmax / max(amax, 1e-12), NaN kept (fmaxf would drop it), as cpu::TensorwiseScale.
__device__ __forceinline__ float ScaleFrom(float amax, float fmax) {
  return __fdiv_rn(fmax, isnan(amax) ? amax : fmaxf(amax, 1e-12f));
}

// The kSeg codes of v * scale packed little-endian: code k in byte k.
__device__ __forceinline__ uint2 ToFp8x8(const float (&v)[kSeg], float scale, int e5m2) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < kSeg; ++k) w[k / 4] |= uint32_t{ToFp8(__fmul_rn(v[k], scale), e5m2)} << (8 * (k % 4));
  return make_uint2(w[0], w[1]);
}

inline bool Aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

// ---- Pass 2: the tiled quantize -----------------------------------------------------------------
// Its sources (the stored tensor and the producers' recomputed results) are fp8_sources.cuh's,
// shared with the blockwise quantizers.

// How a tile moves its values: kSeg at a time in the loads and the row-major stores (Source::Vec()
// and 8-byte aligned codes), and in the transposed stores (rows a multiple of kSeg and 8-byte
// aligned codes_t); one at a time otherwise.
struct TilePaths {
  bool vec, vec_t;
};

template <class Source>
TilePaths PathsOf(const Source& src, int64_t rows, const Fp8Dev& out) {
  const bool vec = src.Vec() && (out.codes == nullptr || Aligned8(out.codes));
  return {vec, vec && rows % kSeg == 0 && (out.codes_t == nullptr || Aligned8(out.codes_t))};
}

// Quantizes tile `tile` (row-major over the tiles of [rows, cols]) with `scale`. The row-major
// codes go straight out; the transposed ones through shared memory (rows of kTile + 4 bytes: the
// column reads of the transposed pass meet at most two to a bank).
template <class Source>
__device__ void QuantizeTile(const Source& src, int64_t rows, int64_t cols, int64_t tile,
                             float scale, const Fp8Dev& out, TilePaths paths) {
  __shared__ __align__(16) uint8_t codes[kTile][kTile + 4];
  const int64_t tiles_c = cols > 0 ? (cols + kTile - 1) / kTile : 1;
  const int64_t r0 = tile / tiles_c * kTile, c0 = tile % tiles_c * kTile;
  constexpr int kSegs = kTile / kSeg;  // segments per tile row
  if (paths.vec) {  // uniform over the block; a segment lies wholly inside or outside the tensor
    for (int i = threadIdx.x; i < kTile * kSegs; i += blockDim.x) {
      const int r = i / kSegs, c = i % kSegs * kSeg;
      const int64_t R = r0 + r, C = c0 + c;
      if (R < rows && C < cols) {
        float v[kSeg];
        src.Load(R, C, v);
        const uint2 q = ToFp8x8(v, scale, out.e5m2);
        if (out.codes != nullptr) *reinterpret_cast<uint2*>(out.codes + R * cols + C) = q;
        *reinterpret_cast<uint32_t*>(&codes[r][c]) = q.x;
        *reinterpret_cast<uint32_t*>(&codes[r][c + 4]) = q.y;
      }
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
      const int r = i / kTile, c = i % kTile;
      const int64_t R = r0 + r, C = c0 + c;
      if (R < rows && C < cols) {
        const uint8_t q = ToFp8(__fmul_rn(src(R, C), scale), out.e5m2);
        if (out.codes != nullptr) out.codes[R * cols + C] = q;
        codes[r][c] = q;
      }
    }
  }
  if (out.codes_t == nullptr) return;  // uniform over the block
  __syncthreads();
  if (paths.vec_t) {
    for (int i = threadIdx.x; i < kTile * kSegs; i += blockDim.x) {
      const int c = i / kSegs, r = i % kSegs * kSeg;
      const int64_t R = r0 + r, C = c0 + c;
      if (R < rows && C < cols) {
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < kSeg; ++k) w[k / 4] |= uint32_t{codes[r + k][c]} << (8 * (k % 4));
        *reinterpret_cast<uint2*>(out.codes_t + C * rows + R) = make_uint2(w[0], w[1]);
      }
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
      const int c = i / kTile, r = i % kTile;
      const int64_t R = r0 + r, C = c0 + c;
      if (R < rows && C < cols) out.codes_t[C * rows + R] = codes[r][c];
    }
  }
}

// Every block computes the scale; block 0 publishes it and its inverse.
__device__ float ReadScale(const Fp8Dev& out, bool publish) {
  const float scale = ScaleFrom(*out.amax, out.fmax);
  if (publish && threadIdx.x == 0) {
    if (out.scale != nullptr) *out.scale = scale;
    *out.inverse = __fdiv_rn(1.0f, scale);
  }
  return scale;
}

template <class Source>
__global__ void __launch_bounds__(kTileThreads)
    QuantizeKernel(Source src, int64_t rows, int64_t cols, Fp8Dev out, TilePaths paths) {
  const float scale = ReadScale(out, blockIdx.x == 0);
  QuantizeTile(src, rows, cols, blockIdx.x, scale, out, paths);
}

int64_t TilesOf(int64_t rows, int64_t cols) {
  return std::max<int64_t>(CeilDiv(rows, kTile) * CeilDiv(cols, kTile), 1);
}

Fp8Dev DevOf(const Fp8Output& o) {
  return {static_cast<uint8_t*>(o.codes),
          static_cast<uint8_t*>(o.codes_t),
          o.amax,
          o.scale,
          o.inverse_scale,
          o.format == DType::kFp8E5M2 ? 1 : 0,
          Fp8MaxOf(o.format)};
}

Status CheckOutput(const Fp8Output& o, const char* op) {
  if (!IsFp8(o.format)) return internal::UnsupportedDType(o.format, op);
  SPINDLE_CHECK_ARG(o.amax != nullptr && o.inverse_scale != nullptr,
                    std::string(op) + ": amax and inverse_scale are required");
  SPINDLE_CHECK_ARG(o.codes != nullptr || o.codes_t != nullptr,
                    std::string(op) + ": neither codes nor codes_t given");
  return Status::Ok();
}

template <class Source>
Status LaunchQuantize(const Source& src, int64_t rows, int64_t cols, const Fp8Output& out,
                      cudaStream_t stream) {
  const Fp8Dev dev = DevOf(out);
  QuantizeKernel<Source><<<TilesOf(rows, cols), kTileThreads, 0, stream>>>(
      src, rows, cols, dev, PathsOf(src, rows, dev));
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// ---- Pass 1 of a stored tensor ------------------------------------------------------------------

// A block reduces kAmaxChunk values; kVecLoad (n a multiple of kSeg, x 16-byte aligned): kSeg at a
// time.
template <typename T, bool kVecLoad>
__global__ void __launch_bounds__(kAmaxThreads) AbsMaxKernel(const T* x, int64_t n, float* amax) {
  const int64_t begin = blockIdx.x * kAmaxChunk, end = std::min(begin + kAmaxChunk, n);
  uint32_t m = 0;
  if constexpr (kVecLoad) {
    for (int64_t i = begin + threadIdx.x * kSeg; i < end; i += kAmaxThreads * kSeg) {
      float v[kSeg];
      Load8(x + i, v);
#pragma unroll
      for (int k = 0; k < kSeg; ++k) m = max(m, AbsBits(v[k]));
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kAmaxThreads) {
      m = max(m, AbsBits(ToFloat(x[i])));
    }
  }
  BlockMaxToGlobal(m, amax);
}

// ---- The weights' multi-tensor cast -------------------------------------------------------------

struct CastTable {
  struct Entry {
    const float* x;
    int64_t rows, cols;
    Fp8Dev out;
    TilePaths paths;
  } t[kMaxCastTensors];
  int32_t first_block[kMaxCastTensors + 1];  // amax pass: tensor i's blocks
  int32_t first_tile[kMaxCastTensors + 1];   // quantize pass: tensor i's tiles
  int32_t n;
};
static_assert(sizeof(CastTable) + 64 < 4096, "kernel argument space");

__global__ void CastZeroAmaxKernel(CastTable table) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < table.n) *const_cast<float*>(table.t[i].out.amax) = 0.0f;
}

__global__ void __launch_bounds__(kAmaxThreads) CastAbsMaxKernel(CastTable table) {
  const int b = static_cast<int>(blockIdx.x);
  const int i = FindTensor(table.first_block, table.n, b);
  const auto& e = table.t[i];
  const int64_t n = e.rows * e.cols;
  const int64_t begin = (b - table.first_block[i]) * kAmaxChunk;
  const int64_t end = std::min(begin + kAmaxChunk, n);
  uint32_t m = 0;
  for (int64_t j = begin + threadIdx.x; j < end; j += kAmaxThreads) m = max(m, AbsBits(e.x[j]));
  BlockMaxToGlobal(m, const_cast<float*>(e.out.amax));
}

__global__ void __launch_bounds__(kTileThreads) CastQuantizeKernel(CastTable table) {
  const int b = static_cast<int>(blockIdx.x);
  const int i = FindTensor(table.first_tile, table.n, b);
  const auto& e = table.t[i];
  const int64_t tile = b - table.first_tile[i];
  const float scale = ReadScale(e.out, tile == 0);
  QuantizeTile(StoredSource<float>{e.x, e.cols}, e.rows, e.cols, tile, scale, e.out, e.paths);
}

// ---- Pass 1 of the fused producers --------------------------------------------------------------

// One warp per row: rstd, h (kResidual), y (if asked for) and the amax of the fp32 results.
template <typename T, bool kResidual>
__global__ void __launch_bounds__(32 * kRowWarps)
    RmsNormStatsKernel(const T* x, const T* res, T* h, const T* w, T* y, float* rstd, int64_t rows,
                       int64_t D, float eps, float* amax) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowWarps) + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (row < rows) {  // uniform over the warp
    const T* src = nullptr;
    const float ss = internal::RmsRowSumSquares<T, kResidual>(x, res, h, row, D, lane, &src);
    const float r = rsqrtf(ss / static_cast<float>(D) + eps);
    __syncwarp();
    for (int64_t j = lane; j < D; j += 32) {
      const float v = RmsValue(ToFloat(src[j]), r, ToFloat(w[j]));
      m = max(m, AbsBits(v));
      if (y != nullptr) y[row * D + j] = FromFloat<T>(v);
    }
    if (lane == 0) rstd[row] = r;
  }
  BlockMaxToGlobal(m, amax);
}

// The same without the residual add for bf16 rows of D = 256 k values (k <= kRmsVecs, the row
// 16-byte aligned): lane l loads vectors l, l + 32, ... of kSeg values, all of them before the
// warp's sum, and keeps them in registers for the results (one read of the row, 16 bytes a load).
constexpr int kRmsVecs = 8;
template <typename T>
__global__ void __launch_bounds__(32 * kRowWarps)
    RmsNormStatsVecKernel(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t D,
                          float eps, float* amax) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowWarps) + (threadIdx.x >> 5);
  const int vecs = static_cast<int>(D / (32 * kSeg));
  uint32_t m = 0;
  if (row < rows) {  // uniform over the warp
    const T* xr = x + row * D;
    float v[kRmsVecs][kSeg];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kRmsVecs; ++k)
      if (k < vecs) Load8(xr + (k * 32 + lane) * kSeg, v[k]);
#pragma unroll
    for (int k = 0; k < kRmsVecs; ++k) {
      if (k < vecs) {
#pragma unroll
        for (int e = 0; e < kSeg; ++e) ss += v[k][e] * v[k][e];
      }
    }
    const float r = rsqrtf(WarpSum(ss) / static_cast<float>(D) + eps);
#pragma unroll
    for (int k = 0; k < kRmsVecs; ++k) {
      if (k < vecs) {
        const int64_t c = (k * 32 + lane) * kSeg;
        float wv[kSeg];
        Load8(w + c, wv);
#pragma unroll
        for (int e = 0; e < kSeg; ++e) {
          const float value = RmsValue(v[k][e], r, wv[e]);
          m = max(m, AbsBits(value));
          if (y != nullptr) y[row * D + c + e] = FromFloat<T>(value);
        }
      }
    }
    if (lane == 0) rstd[row] = r;
  }
  BlockMaxToGlobal(m, amax);
}

template <typename T, bool kVecLoad>
__global__ void __launch_bounds__(kAmaxThreads)
    SwiGluStatsKernel(const T* g, const T* u, T* y, int64_t n, float* amax) {
  const int64_t begin = blockIdx.x * kAmaxChunk, end = std::min(begin + kAmaxChunk, n);
  const SwiGluSource<T> src{g, u, n};  // one row of n
  uint32_t m = 0;
  if constexpr (kVecLoad) {
    for (int64_t i = begin + threadIdx.x * kSeg; i < end; i += kAmaxThreads * kSeg) {
      float v[kSeg];
      src.Load(0, i, v);
#pragma unroll
      for (int k = 0; k < kSeg; ++k) {
        m = max(m, AbsBits(v[k]));
        if (y != nullptr) y[i + k] = FromFloat<T>(v[k]);
      }
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kAmaxThreads) {
      const float v = src(0, i);
      m = max(m, AbsBits(v));
      if (y != nullptr) y[i] = FromFloat<T>(v);
    }
  }
  BlockMaxToGlobal(m, amax);
}

// One warp per (token, head) row of Dh values.
template <typename T>
__global__ void __launch_bounds__(32 * kRowWarps)
    GroupGateStatsKernel(const T* o, const T* w, const T* gate, T* y, float* rstd, int64_t T_,
                         int64_t H, int64_t Dh, float eps, float* amax) {
  const int lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * static_cast<int64_t>(kRowWarps) + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (r < T_ * H) {
    const int64_t hd = r % H * Dh, off = r * Dh;  // [T, H, Dh] flattened
    const T* row = nullptr;
    const float ss = internal::RmsRowSumSquares<T, false>(o, nullptr, nullptr, r, Dh, lane, &row);
    const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
    for (int64_t j = lane; j < Dh; j += 32) {
      const float v =
          GroupGateValue(ToFloat(o[off + j]), rs, ToFloat(w[hd + j]), ToFloat(gate[off + j]));
      m = max(m, AbsBits(v));
      if (y != nullptr) y[off + j] = FromFloat<T>(v);
    }
    if (lane == 0) rstd[r] = rs;
  }
  BlockMaxToGlobal(m, amax);
}

// The same with Dh / kSeg = G = 2^log2G lanes per (token, head) row (G <= 32, pointers 16-byte
// aligned, T H G < 2^31: row and head in 32-bit arithmetic): each lane loads kSeg values of o,
// gate and w at once.
template <typename T>
__global__ void __launch_bounds__(32 * kRowWarps)
    GroupGateStatsVecKernel(const T* o, const T* w, const T* gate, T* y, float* rstd, int T_H,
                            int H, int64_t Dh, int log2G, float eps, float* amax) {
  const int G = 1 << log2G;
  const int sub = static_cast<int>(threadIdx.x) & (G - 1);
  const int r = static_cast<int>((blockIdx.x * (32 * kRowWarps) + threadIdx.x) >> log2G);
  const bool active = r < T_H;
  const int64_t off = r * Dh + sub * kSeg, hd = (r % H) * Dh + sub * kSeg;
  float ov[kSeg];
  float ss = 0.0f;
  if (active) {
    Load8(o + off, ov);
#pragma unroll
    for (int k = 0; k < kSeg; ++k) ss += ov[k] * ov[k];
  }
  ss = internal::GroupSum(ss, G);  // every lane of the warp
  uint32_t m = 0;
  if (active) {
    const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
    float gv[kSeg], wv[kSeg];
    Load8(gate + off, gv);
    Load8(w + hd, wv);
#pragma unroll
    for (int k = 0; k < kSeg; ++k) {
      const float v = GroupGateValue(ov[k], rs, wv[k], gv[k]);
      m = max(m, AbsBits(v));
      if (y != nullptr) y[off + k] = FromFloat<T>(v);
    }
    if (sub == 0) rstd[r] = rs;
  }
  BlockMaxToGlobal(m, amax);
}

template <typename T>
Status LaunchRmsNormFp8(const void* x, const void* residual, void* h, const void* w, void* y,
                        float* rstd, int64_t rows, int64_t D, float eps, const Fp8Output& q,
                        cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* wt = static_cast<const T*>(w);
  T* ht = static_cast<T*>(h);
  T* yt = static_cast<T*>(y);
  const int64_t blocks = std::max<int64_t>(CeilDiv(rows, kRowWarps), 1);
  if (residual != nullptr) {
    RmsNormStatsKernel<T, true><<<blocks, 32 * kRowWarps, 0, stream>>>(
        xt, static_cast<const T*>(residual), ht, wt, yt, rstd, rows, D, eps, q.amax);
  } else if (sizeof(T) == 2 && D % (32 * kSeg) == 0 && D <= 32 * kSeg * kRmsVecs &&
             Aligned16(x) && Aligned16(w)) {
    RmsNormStatsVecKernel<T><<<blocks, 32 * kRowWarps, 0, stream>>>(xt, wt, yt, rstd, rows, D,
                                                                     eps, q.amax);
  } else {
    RmsNormStatsKernel<T, false><<<blocks, 32 * kRowWarps, 0, stream>>>(
        xt, nullptr, nullptr, wt, yt, rstd, rows, D, eps, q.amax);
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  const T* normalized = residual != nullptr ? ht : xt;
  return LaunchQuantize(RmsSource<T>{normalized, wt, rstd, D}, rows, D, q, stream);
}

}  // namespace

float Fp8MaxOf(DType format) {
  switch (format) {
    case DType::kFp8E4M3:
      return 448.0f;
    case DType::kFp8E5M2:
      return 57344.0f;
    default:
      return 0.0f;
  }
}

Status Fp8AbsMax(const void* x, int64_t n, DType dtype, float* amax, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0 && amax != nullptr, "Fp8AbsMax: bad arguments");
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "Fp8AbsMax", {
    const auto* xt = static_cast<const scalar_t*>(x);
    if (n % kSeg == 0 && Aligned16(x)) {
      AbsMaxKernel<scalar_t, true><<<CeilDiv(n, kAmaxChunk), kAmaxThreads, 0, stream>>>(xt, n, amax);
    } else {
      AbsMaxKernel<scalar_t, false><<<CeilDiv(n, kAmaxChunk), kAmaxThreads, 0, stream>>>(xt, n,
                                                                                          amax);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status Fp8QuantizeFromAmax(const void* x, int64_t rows, int64_t cols, DType dtype,
                           const Fp8Output& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols >= 0, "Fp8QuantizeFromAmax: negative size");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(out, "Fp8QuantizeFromAmax"));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "Fp8QuantizeFromAmax", {
    return LaunchQuantize(StoredSource<scalar_t>{static_cast<const scalar_t*>(x), cols}, rows, cols,
                          out, stream);
  });
  return Status::Ok();
}

Status Fp8Quantize(const void* x, int64_t rows, int64_t cols, DType dtype, const Fp8Output& out,
                   cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols >= 0, "Fp8Quantize: negative size");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(out, "Fp8Quantize"));
  SPINDLE_RETURN_IF_ERROR(Fp8AbsMax(x, rows * cols, dtype, out.amax, stream));
  return Fp8QuantizeFromAmax(x, rows, cols, dtype, out, stream);
}

Status Fp8CastWeights(const Fp8WeightCast* tensors, int64_t n_tensors, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n_tensors >= 0 && (n_tensors == 0 || tensors != nullptr),
                    "Fp8CastWeights: bad tensor list");
  for (int64_t start = 0; start < n_tensors; start += kMaxCastTensors) {
    CastTable table{};
    table.n = static_cast<int32_t>(std::min<int64_t>(n_tensors - start, kMaxCastTensors));
    int64_t blocks = 0, tiles = 0;
    for (int i = 0; i < table.n; ++i) {
      const Fp8WeightCast& w = tensors[start + i];
      SPINDLE_CHECK_ARG(w.rows >= 0 && w.cols >= 0 && w.master != nullptr,
                        "Fp8CastWeights: bad tensor " + std::to_string(start + i));
      SPINDLE_RETURN_IF_ERROR(CheckOutput(w.out, "Fp8CastWeights"));
      const Fp8Dev dev = DevOf(w.out);
      table.t[i] = {w.master, w.rows, w.cols, dev,
                    PathsOf(StoredSource<float>{w.master, w.cols}, w.rows, dev)};
      table.first_block[i] = static_cast<int32_t>(blocks);
      table.first_tile[i] = static_cast<int32_t>(tiles);
      // Every tensor gets at least one block and one tile (an empty one publishes its scale).
      blocks += std::max<int64_t>(CeilDiv(w.rows * w.cols, kAmaxChunk), 1);
      tiles += TilesOf(w.rows, w.cols);
      SPINDLE_CHECK_ARG(blocks < std::numeric_limits<int32_t>::max() &&
                            tiles < std::numeric_limits<int32_t>::max(),
                        "Fp8CastWeights: tensors too large for one launch");
    }
    table.first_block[table.n] = static_cast<int32_t>(blocks);
    table.first_tile[table.n] = static_cast<int32_t>(tiles);
    CastZeroAmaxKernel<<<1, kMaxCastTensors, 0, stream>>>(table);
    SPINDLE_CUDA_CHECK_LAUNCH();
    CastAbsMaxKernel<<<blocks, kAmaxThreads, 0, stream>>>(table);
    SPINDLE_CUDA_CHECK_LAUNCH();
    CastQuantizeKernel<<<tiles, kTileThreads, 0, stream>>>(table);
    SPINDLE_CUDA_CHECK_LAUNCH();
  }
  return Status::Ok();
}

Status RmsNormForwardFp8(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                         int64_t D, float eps, DType dtype, const Fp8Output& q,
                         cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D <= kMaxRowWidth, "RmsNormForwardFp8: bad sizes");
  SPINDLE_CHECK_ARG(y == nullptr || y != x, "RmsNormForwardFp8: y must not alias x");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "RmsNormForwardFp8"));
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(q.amax, 0, sizeof(float), stream));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormForwardFp8", {
    return LaunchRmsNormFp8<scalar_t>(x, nullptr, nullptr, w, y, rstd, rows, D, eps, q, stream);
  });
  return Status::Ok();
}

Status RmsNormResidualForwardFp8(const void* x, const void* residual, void* h, const void* w,
                                 void* y, float* rstd, int64_t rows, int64_t D, float eps,
                                 DType dtype, const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D <= kMaxRowWidth && residual != nullptr && h != nullptr,
                    "RmsNormResidualForwardFp8: bad sizes");
  SPINDLE_CHECK_ARG(y == nullptr || y != h, "RmsNormResidualForwardFp8: y must not alias h");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "RmsNormResidualForwardFp8"));
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(q.amax, 0, sizeof(float), stream));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormResidualForwardFp8", {
    return LaunchRmsNormFp8<scalar_t>(x, residual, h, w, y, rstd, rows, D, eps, q, stream);
  });
  return Status::Ok();
}

Status SwiGluForwardFp8(const void* g, const void* u, void* y, int64_t rows, int64_t cols,
                        DType dtype, const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols >= 0, "SwiGluForwardFp8: negative size");
  SPINDLE_CHECK_ARG(y == nullptr || (y != g && y != u),
                    "SwiGluForwardFp8: y must not alias g or u");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "SwiGluForwardFp8"));
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(q.amax, 0, sizeof(float), stream));
  const int64_t n = rows * cols;
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluForwardFp8", {
    const auto* gt = static_cast<const scalar_t*>(g);
    const auto* ut = static_cast<const scalar_t*>(u);
    auto* yt = static_cast<scalar_t*>(y);
    if (n > 0 && SwiGluSource<scalar_t>{gt, ut, n}.Vec()) {
      SwiGluStatsKernel<scalar_t, true><<<CeilDiv(n, kAmaxChunk), kAmaxThreads, 0, stream>>>(
          gt, ut, yt, n, q.amax);
      SPINDLE_CUDA_CHECK_LAUNCH();
    } else if (n > 0) {
      SwiGluStatsKernel<scalar_t, false><<<CeilDiv(n, kAmaxChunk), kAmaxThreads, 0, stream>>>(
          gt, ut, yt, n, q.amax);
      SPINDLE_CUDA_CHECK_LAUNCH();
    }
    return LaunchQuantize(SwiGluSource<scalar_t>{gt, ut, cols}, rows, cols, q, stream);
  });
  return Status::Ok();
}

Status GroupNormGateForwardFp8(const void* o, const void* w, const void* gate, void* y, float* rstd,
                               int64_t T, int64_t H, int64_t Dh, float eps, DType dtype,
                               const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && H * Dh <= kMaxRowWidth,
                    "GroupNormGateForwardFp8: bad sizes");
  SPINDLE_CHECK_ARG(y == nullptr || (y != o && y != gate),
                    "GroupNormGateForwardFp8: y must not alias o or gate");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "GroupNormGateForwardFp8"));
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(q.amax, 0, sizeof(float), stream));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateForwardFp8", {
    const auto* ot = static_cast<const scalar_t*>(o);
    const auto* wt = static_cast<const scalar_t*>(w);
    const auto* gt = static_cast<const scalar_t*>(gate);
    const int64_t G = Dh / kSeg;
    if (Dh % kSeg == 0 && G <= 32 && internal::IsPow2(G) && T * H * G < (int64_t{1} << 31) &&
        GroupGateSource<scalar_t>{ot, wt, gt, rstd, H, Dh}.Vec()) {
      int log2G = 0;
      while ((int64_t{1} << log2G) < G) ++log2G;
      const int64_t blocks = std::max<int64_t>(CeilDiv(T * H * G, 32 * kRowWarps), 1);
      GroupGateStatsVecKernel<scalar_t><<<blocks, 32 * kRowWarps, 0, stream>>>(
          ot, wt, gt, static_cast<scalar_t*>(y), rstd, static_cast<int>(T * H),
          static_cast<int>(H), Dh, log2G, eps, q.amax);
    } else {
      const int64_t blocks = std::max<int64_t>(CeilDiv(T * H, kRowWarps), 1);
      GroupGateStatsKernel<scalar_t><<<blocks, 32 * kRowWarps, 0, stream>>>(
          ot, wt, gt, static_cast<scalar_t*>(y), rstd, T, H, Dh, eps, q.amax);
    }
    SPINDLE_CUDA_CHECK_LAUNCH();
    return LaunchQuantize(GroupGateSource<scalar_t>{ot, wt, gt, rstd, H, Dh}, T, H * Dh, q, stream);
  });
  return Status::Ok();
}

Status RmsNormQuantizeFp8(const void* x, const void* w, const float* rstd, int64_t rows, int64_t D,
                          DType dtype, const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && rstd != nullptr, "RmsNormQuantizeFp8: bad sizes");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "RmsNormQuantizeFp8"));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormQuantizeFp8", {
    return LaunchQuantize(RmsSource<scalar_t>{static_cast<const scalar_t*>(x),
                                              static_cast<const scalar_t*>(w), rstd, D},
                          rows, D, q, stream);
  });
  return Status::Ok();
}

Status SwiGluQuantizeFp8(const void* g, const void* u, int64_t rows, int64_t cols, DType dtype,
                         const Fp8Output& q, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols >= 0, "SwiGluQuantizeFp8: negative size");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "SwiGluQuantizeFp8"));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluQuantizeFp8", {
    return LaunchQuantize(SwiGluSource<scalar_t>{static_cast<const scalar_t*>(g),
                                                 static_cast<const scalar_t*>(u), cols},
                          rows, cols, q, stream);
  });
  return Status::Ok();
}

Status GroupNormGateQuantizeFp8(const void* o, const void* w, const void* gate, const float* rstd,
                                int64_t T, int64_t H, int64_t Dh, DType dtype, const Fp8Output& q,
                                cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && rstd != nullptr,
                    "GroupNormGateQuantizeFp8: bad sizes");
  SPINDLE_RETURN_IF_ERROR(CheckOutput(q, "GroupNormGateQuantizeFp8"));
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateQuantizeFp8", {
    return LaunchQuantize(
        GroupGateSource<scalar_t>{static_cast<const scalar_t*>(o), static_cast<const scalar_t*>(w),
                                  static_cast<const scalar_t*>(gate), rstd, H, Dh},
        T, H * Dh, q, stream);
  });
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
