// RMSNorm (plain, fused residual add, per-head q/k norm fused with RoPE) and group RMSNorm +
// sigmoid gate, forward and backward, on CUDA.
//
// Vector paths (16-byte loads and stores, 8 bf16 or 4 fp32 values) run when every activation
// pointer is 16-byte aligned and the row sizes are multiples of the vector; the scalar kernels
// (one warp per row) handle everything else. Weight gradients are reduced without atomics: each
// block accumulates its rows in a fixed order (vector paths: in registers, each thread owning
// fixed columns; scalar paths: per-warp shared-memory rows summed in warp order), writes one row of
// partial sums to the workspace, and a second kernel adds the blocks' rows into dw in a fixed
// order. The grid depends on the sizes only, so results are bitwise reproducible.
#include <algorithm>

#include "kernels/cuda/amax.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::AbsBits;
using internal::Aligned16;
using internal::BlockMaxToGlobal;
using internal::WarpMaxToGlobal;
using internal::PackedAbsBits;
using internal::StoredAbsBits;
using internal::bf16;
using internal::CeilDiv;
using internal::FromFloat;
using internal::GroupSum;
using internal::IsPow2;
using internal::kVec;
using internal::Load16;
using internal::NextPow2;
using internal::Opaque;
using internal::Pack;
using internal::RoundUp;
using internal::Store16;
using internal::ToFloat;
using internal::Unpack;
using internal::WarpSum;

constexpr int kFwdWarps = 8;
constexpr int64_t kMaxPartialBytes = 48 * 1024;
constexpr int64_t kMaxBwdBlocks = 1024;
constexpr int64_t kMaxRowWidth = kMaxPartialBytes / 4;  // D <= 12288
constexpr int kMaxPairsPerLane = 8;                     // fused q/k norm + RoPE: Dh <= 512

// Launch shape of a backward with a [D] weight gradient.
struct BwdPlan {
  int warps;
  int64_t blocks;
};
BwdPlan PlanBwd(int64_t rows, int64_t D) {
  const int warps = static_cast<int>(std::clamp<int64_t>(kMaxPartialBytes / (4 * D), 1, 8));
  const int64_t blocks = std::clamp<int64_t>(CeilDiv(rows, warps), 1, kMaxBwdBlocks);
  return {warps, blocks};
}

// Block epilogue: ws[blockIdx.x, j] = sum over warps of part[w, j], warps in order.
__device__ void StoreBlockPartial(const float* part, int warps, int64_t D, float* ws) {
  __syncthreads();
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += part[w * D + j];
    ws[blockIdx.x * D + j] = s;
  }
}

// dw0[j] += sum_b ws[b, j] for j < split, dw1[j - split] += ... for j >= split. A block sums 32
// columns: warp k adds the blocks b = k mod 8 in increasing order (unrolled, so the loads
// overlap), then warp 0 adds the 8 warp sums in order. Fixed order for given (blocks, D).
constexpr int kReduceWarps = 8;
__global__ void __launch_bounds__(32 * kReduceWarps)
    ReducePartialsKernel(const float* ws, int64_t blocks, int64_t D, int64_t split, float* dw0,
                         float* dw1) {
  __shared__ float sum[kReduceWarps][33];
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int64_t j = blockIdx.x * static_cast<int64_t>(32) + lane;
  float s = 0.0f;
  if (j < D) {
#pragma unroll 8
    for (int64_t b = k; b < blocks; b += kReduceWarps) s += ws[b * D + j];
  }
  sum[k][lane] = s;
  __syncthreads();
  if (k == 0 && j < D) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kReduceWarps; ++i) total += sum[i][lane];
    if (j < split) {
      dw0[j] += total;
    } else {
      dw1[j - split] += total;
    }
  }
}

Status ReducePartials(const float* ws, int64_t blocks, int64_t D, int64_t split, float* dw0,
                      float* dw1, cudaStream_t stream) {
  ReducePartialsKernel<<<CeilDiv(D, 32), 32 * kReduceWarps, 0, stream>>>(ws, blocks, D, split,
                                                                          dw0, dw1);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Threads resident on the GPU at once, roughly (132 SMs x 1024): the vector backward kernels size
// their grid (a function of the sizes only) to about this many threads, in one wave.
constexpr int64_t kResidentThreads = 132 * 1024;
int64_t VecBwdBlocks(int64_t work_items, int threads) {
  return std::clamp<int64_t>(kResidentThreads / threads, 1, std::max<int64_t>(work_items, 1));
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <typename T, bool kResidual>
__global__ void RmsNormFwdKernel(const T* x, const T* res, T* h, const T* w, T* y, float* rstd,
                                 int64_t rows, int64_t D, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kFwdWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* src = nullptr;
  const float ss = internal::RmsRowSumSquares<T, kResidual>(x, res, h, row, D, lane, &src);
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
  __syncwarp();
  for (int64_t j = lane; j < D; j += 32) {
    y[row * D + j] = FromFloat<T>(ToFloat(src[j]) * r * ToFloat(w[j]));
  }
  if (lane == 0) rstd[row] = r;
}

// amax (nullable): max |dx| as stored, reduced into *amax (zeroed before).
template <typename T>
__global__ void RmsNormBwdKernel(const T* x, const T* w, const float* rstd, const T* dy,
                                 const T* dres, T* dx, int64_t rows, int64_t D, float* ws,
                                 float* amax) {
  extern __shared__ float part[];  // [warps, D]
  uint32_t m = 0;
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* my = part + warp * D;
  for (int64_t j = lane; j < D; j += 32) my[j] = 0.0f;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(warps) + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    const T* xr = x + row * D;
    const T* gr = dy + row * D;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t j = lane; j < D; j += 32) dot += ToFloat(gr[j]) * ToFloat(w[j]) * ToFloat(xr[j]);
    dot = WarpSum(dot);
    const float c = dot * r * r / static_cast<float>(D);
    for (int64_t j = lane; j < D; j += 32) {
      const float g = ToFloat(gr[j]), xv = ToFloat(xr[j]);
      float d = r * (ToFloat(w[j]) * g - xv * c);
      if (dres != nullptr) d += ToFloat(dres[row * D + j]);
      my[j] += g * xv * r;
      dx[row * D + j] = FromFloat<T>(d);
      if (amax != nullptr) m = max(m, StoredAbsBits<T>(d));
    }
  }
  StoreBlockPartial(part, warps, D, ws);
  if (amax != nullptr) WarpMaxToGlobal(m, amax);
}

// ---- Fused q/k RMSNorm + RoPE on the split qkv ------------------------------------------------------

// Row r of the fused kernels: token t, block `which` (0 q, 1 k, 2 v) and head h.
struct QkvRow {
  int64_t t;
  int which, h;
};
__device__ __forceinline__ QkvRow SplitRow(int64_t r, int64_t H, int n_blocks) {
  const int64_t per_token = H * n_blocks;
  const int64_t rem = r % per_token;
  return {r / per_token, static_cast<int>(rem / H), static_cast<int>(rem % H)};
}

template <typename T>
__global__ void QkNormRopeFwdKernel(const T* in, const T* wq, const T* wk, const int32_t* pos,
                                    T* out, float* rstd_q, float* rstd_k, int64_t T_, int64_t H,
                                    int64_t Dh, float eps, float theta, int n_blocks) {
  const int lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * static_cast<int64_t>(kFwdWarps) + (threadIdx.x >> 5);
  if (r >= T_ * H * n_blocks) return;
  const QkvRow q = SplitRow(r, H, n_blocks);
  const int64_t off = q.t * 3 * H * Dh + (q.which * H + q.h) * Dh;
  const T* src = in + off;
  T* dst = out + off;
  if (q.which == 2) {
    for (int64_t j = lane; j < Dh; j += 32) dst[j] = src[j];
    return;
  }
  const T* w = q.which == 0 ? wq : wk;
  const int half = static_cast<int>(Dh / 2);
  float lo[kMaxPairsPerLane], hi[kMaxPairsPerLane];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxPairsPerLane; ++i) {
    const int j = lane + 32 * i;
    lo[i] = hi[i] = 0.0f;
    if (j < half) {
      lo[i] = ToFloat(src[j]);
      hi[i] = ToFloat(src[j + half]);
      ss += lo[i] * lo[i] + hi[i] * hi[i];
    }
  }
  ss = WarpSum(ss);
  const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
  const int p = pos[q.t];
#pragma unroll
  for (int i = 0; i < kMaxPairsPerLane; ++i) {
    const int j = lane + 32 * i;
    if (j < half) {
      float c, s;
      internal::RopeCosSin(p, j, static_cast<int>(Dh), theta, &c, &s);
      const float a = lo[i] * rs * ToFloat(w[j]);
      const float b = hi[i] * rs * ToFloat(w[j + half]);
      dst[j] = FromFloat<T>(a * c - b * s);
      dst[j + half] = FromFloat<T>(b * c + a * s);
    }
  }
  if (lane == 0) (q.which == 0 ? rstd_q : rstd_k)[q.t * H + q.h] = rs;
}

// Partial weight gradients: part row [2 * Dh], q's columns then k's. amax (nullable): max |din|
// as stored (the v block's copy included) into *amax (zeroed before).
template <typename T>
__global__ void QkNormRopeBwdKernel(const T* in, const T* wq, const T* wk, const float* rstd_q,
                                    const float* rstd_k, const int32_t* pos, const T* dout,
                                    T* din, int64_t T_, int64_t H, int64_t Dh, float theta,
                                    int n_blocks, float* ws, float* amax) {
  extern __shared__ float part[];  // [warps, 2 * Dh]
  uint32_t m = 0;
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t D2 = 2 * Dh;
  float* my = part + warp * D2;
  for (int64_t j = lane; j < D2; j += 32) my[j] = 0.0f;
  const int half = static_cast<int>(Dh / 2);
  const int64_t rows = T_ * H * n_blocks;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(warps) + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * warps) {
    const QkvRow q = SplitRow(r, H, n_blocks);
    const int64_t off = q.t * 3 * H * Dh + (q.which * H + q.h) * Dh;
    if (q.which == 2) {
      for (int64_t j = lane; j < Dh; j += 32) {
        const T v = dout[off + j];
        din[off + j] = v;
        m = max(m, AbsBits(ToFloat(v)));
      }
      continue;
    }
    const T* w = q.which == 0 ? wq : wk;
    const float rs = (q.which == 0 ? rstd_q : rstd_k)[q.t * H + q.h];
    const int p = pos[q.t];
    float ulo[kMaxPairsPerLane], uhi[kMaxPairsPerLane], xlo[kMaxPairsPerLane],
        xhi[kMaxPairsPerLane];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
      const int j = lane + 32 * i;
      ulo[i] = uhi[i] = xlo[i] = xhi[i] = 0.0f;
      if (j < half) {
        float c, s;
        internal::RopeCosSin(p, j, static_cast<int>(Dh), theta, &c, &s);
        const float ga = ToFloat(dout[off + j]), gb = ToFloat(dout[off + j + half]);
        ulo[i] = ga * c + gb * s;  // rotation by the negative angle
        uhi[i] = gb * c - ga * s;
        xlo[i] = ToFloat(in[off + j]);
        xhi[i] = ToFloat(in[off + j + half]);
        dot += ulo[i] * ToFloat(w[j]) * xlo[i] + uhi[i] * ToFloat(w[j + half]) * xhi[i];
      }
    }
    dot = WarpSum(dot);
    const float c = dot * rs * rs / static_cast<float>(Dh);
    float* pw = my + q.which * Dh;
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < half) {
        const float a = rs * (ToFloat(w[j]) * ulo[i] - xlo[i] * c);
        const float b = rs * (ToFloat(w[j + half]) * uhi[i] - xhi[i] * c);
        din[off + j] = FromFloat<T>(a);
        din[off + j + half] = FromFloat<T>(b);
        m = max(m, max(StoredAbsBits<T>(a), StoredAbsBits<T>(b)));
        pw[j] += ulo[i] * xlo[i] * rs;
        pw[j + half] += uhi[i] * xhi[i] * rs;
      }
    }
  }
  StoreBlockPartial(part, warps, D2, ws);
  if (amax != nullptr) WarpMaxToGlobal(m, amax);
}

// ---- Group RMSNorm + sigmoid gate ---------------------------------------------------------------------

template <typename T>
__global__ void GroupNormGateFwdKernel(const T* o, const T* w, const T* gate, T* y, float* rstd,
                                       int64_t T_, int64_t H, int64_t Dh, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * static_cast<int64_t>(kFwdWarps) + (threadIdx.x >> 5);
  if (r >= T_ * H) return;
  const int64_t h = r % H;
  const int64_t off = r * Dh;  // [T, H, Dh] flattened
  const T* row = nullptr;
  const float ss = internal::RmsRowSumSquares<T, false>(o, nullptr, nullptr, r, Dh, lane, &row);
  const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
  for (int64_t j = lane; j < Dh; j += 32) {
    const float sig = internal::Sigmoid(ToFloat(gate[off + j]));
    y[off + j] = FromFloat<T>(ToFloat(o[off + j]) * rs * ToFloat(w[h * Dh + j]) * sig);
  }
  if (lane == 0) rstd[r] = rs;
}

// One warp per token (all heads), so a warp's partial row covers all H * Dh weights. amax
// (nullable): max |dgate| as stored into *amax (zeroed before).
template <typename T>
__global__ void GroupNormGateBwdKernel(const T* o, const T* w, const T* gate, const float* rstd,
                                       const T* dy, T* do_, T* dgate, int64_t T_, int64_t H,
                                       int64_t Dh, float* ws, float* amax) {
  extern __shared__ float part[];  // [warps, H * Dh]
  uint32_t m = 0;
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t C = H * Dh;
  float* my = part + warp * C;
  for (int64_t j = lane; j < C; j += 32) my[j] = 0.0f;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(warps) + warp; t < T_;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = t * C + h * Dh;
      const float rs = rstd[t * H + h];
      float dot = 0.0f;
      for (int64_t j = lane; j < Dh; j += 32) {
        const float sig = internal::Sigmoid(ToFloat(gate[off + j]));
        dot += ToFloat(dy[off + j]) * ToFloat(w[h * Dh + j]) * sig * ToFloat(o[off + j]);
      }
      dot = WarpSum(dot);
      const float c = dot * rs * rs * rs / static_cast<float>(Dh);
      for (int64_t j = lane; j < Dh; j += 32) {
        const float g = ToFloat(gate[off + j]), sig = internal::Sigmoid(g);
        const float ov = ToFloat(o[off + j]), dyv = ToFloat(dy[off + j]);
        const float n = ov * rs;
        const float dn = dyv * ToFloat(w[h * Dh + j]) * sig;
        my[h * Dh + j] += dyv * n * sig;
        const float dg = dn * n * (1.0f - sig);
        dgate[off + j] = FromFloat<T>(dg);
        do_[off + j] = FromFloat<T>(rs * dn - c * ov);
        m = max(m, StoredAbsBits<T>(dg));
      }
    }
  }
  StoreBlockPartial(part, warps, C, ws);
  if (amax != nullptr) WarpMaxToGlobal(m, amax);
}

// ---- Vector paths -------------------------------------------------------------------------------

// RMSNorm forward, one warp per row: lane l owns the vectors l + 32 k (k < kNV), kept in registers
// (packed) between the sum of squares and the output.
template <typename T, bool kResidual, int kNV>
__global__ void __launch_bounds__(32 * kFwdWarps)
    RmsNormFwdVecKernel(const T* x, const T* res, T* h, const T* w, T* y, float* rstd,
                        int64_t rows, int D, float eps) {
  constexpr int V = kVec<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kFwdWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps
  const int nvec = D / V;
  const int64_t base = row * D;
  uint4 cache[kNV];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    const int c = lane + 32 * k;
    cache[k] = make_uint4(0, 0, 0, 0);
    if (c < nvec) cache[k] = Load16(x + base + c * V);
  }
  if constexpr (kResidual) {
#pragma unroll
    for (int k = 0; k < kNV; ++k) {
      const int c = lane + 32 * k;
      if (c < nvec) {
        float a[V], b[V];
        Unpack<T>(cache[k], a);
        Unpack<T>(Load16(res + base + c * V), b);
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] += b[e];
        cache[k] = Pack<T>(a);  // h rounded to T, as stored
        Store16(h + base + c * V, cache[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    float a[V];
    Unpack<T>(cache[k], a);  // zeros past the row
#pragma unroll
    for (int e = 0; e < V; ++e) ss += a[e] * a[e];
  }
  ss = WarpSum(ss);
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    const int c = lane + 32 * k;
    if (c < nvec) {
      float a[V], wv[V];
      Unpack<T>(cache[k], a);
      Unpack<T>(Load16(w + c * V), wv);
#pragma unroll
      for (int e = 0; e < V; ++e) a[e] = a[e] * r * wv[e];
      Store16(y + base + c * V, Pack<T>(a));
    }
  }
  if (lane == 0) rstd[row] = r;
}

// RMSNorm backward: thread i owns the vectors i + blockDim k (k < kNV) of every row, so its share
// of dw accumulates in registers. Blocks take kR rows at a time (rows r0 + gridDim kR ...); a
// row's dot product is summed over the block (warp sums to shared memory, warps added in order;
// double-buffered, one barrier per kR rows). Block b writes ws[b, :]. kAmax: also max |dx| as
// stored into *amax (zeroed before).
template <typename T, int kNV, int kR, bool kAmax>
__global__ void __launch_bounds__(256, 4)
    RmsNormBwdVecKernel(const T* x, const T* w, const float* rstd, const T* dy, const T* dres,
                        T* dx, int64_t rows, int D, float* ws, float* amax) {
  constexpr int V = kVec<T>;
  __shared__ float red[2][kR][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = blockDim.x >> 5;
  const int nvec = D / V;
  uint4 wraw[kNV];
  float acc[kNV][V];
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    const int c = tid + blockDim.x * k;
    wraw[k] = c < nvec ? Load16(w + c * V) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = 0.0f;
  }
  int buf = 0;
  uint32_t m = 0;
  for (int64_t r0 = blockIdx.x * static_cast<int64_t>(kR); r0 < rows;
       r0 += static_cast<int64_t>(gridDim.x) * kR, buf ^= 1) {
    uint4 xr[kR][kNV], gr[kR][kNV];
    float rs[kR], dot[kR];
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const int64_t row = r0 + r;
      rs[r] = row < rows ? rstd[row] : 0.0f;
#pragma unroll
      for (int k = 0; k < kNV; ++k) {
        const int c = tid + blockDim.x * k;
        xr[r][k] = gr[r][k] = make_uint4(0, 0, 0, 0);
        if (row < rows && c < nvec) {
          xr[r][k] = Load16(x + row * D + c * V);
          gr[r][k] = Load16(dy + row * D + c * V);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      dot[r] = 0.0f;
#pragma unroll
      for (int k = 0; k < kNV; ++k) {
        float xv[V], gv[V], wv[V];
        Unpack<T>(xr[r][k], xv);
        Unpack<T>(gr[r][k], gv);
        Unpack<T>(wraw[k], wv);
#pragma unroll
        for (int e = 0; e < V; ++e) dot[r] += gv[e] * wv[e] * xv[e];
      }
      dot[r] = WarpSum(dot[r]);
      if (lane == 0) red[buf][r][warp] = dot[r];
    }
    // Also orders the previous use of red[buf ^ 1] before its next writes (two iterations on).
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kR; ++r) {
#pragma unroll
      for (int k = 0; k < kNV; ++k) {
        Opaque(xr[r][k]);
        Opaque(gr[r][k]);
        if (r == 0) Opaque(wraw[k]);
      }
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const int64_t row = r0 + r;
      if (row >= rows) break;  // uniform over the block
      float total = 0.0f;
      for (int i = 0; i < warps; ++i) total += red[buf][r][i];
      const float cc = total * rs[r] * rs[r] / static_cast<float>(D);
#pragma unroll
      for (int k = 0; k < kNV; ++k) {
        const int c = tid + blockDim.x * k;
        if (c < nvec) {
          float xv[V], gv[V], wv[V], d[V];
          Unpack<T>(xr[r][k], xv);
          Unpack<T>(gr[r][k], gv);
          Unpack<T>(wraw[k], wv);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            d[e] = rs[r] * (wv[e] * gv[e] - xv[e] * cc);
            acc[k][e] += gv[e] * xv[e] * rs[r];
          }
          if (dres != nullptr) {
            float dr[V];
            Unpack<T>(Load16(dres + row * D + c * V), dr);
#pragma unroll
            for (int e = 0; e < V; ++e) d[e] += dr[e];
          }
          const uint4 packed = Pack<T>(d);
          Store16(dx + row * D + c * V, packed);
          if constexpr (kAmax) m = max(m, PackedAbsBits<T>(packed));
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    const int c = tid + blockDim.x * k;
    if (c < nvec) {
#pragma unroll
      for (int e = 0; e < V; ++e) ws[blockIdx.x * static_cast<int64_t>(D) + c * V + e] = acc[k][e];
    }
  }
  if constexpr (kAmax) BlockMaxToGlobal(m, amax);
}

// Fused q/k norm + RoPE. Thread i < items = 2 H G owns row i / G of every token (q heads, then k
// heads: the row's offset in the token's qkv is row * Dh) and column group g = i % G: the V values
// at g V and the V values at half + g V (rotation partners). G = half / V is a power of two <= 32,
// so a row's threads are aligned lanes of one warp. Blocks loop over tokens; thread j < half owns
// frequency j: inv_freq in a register, cos/sin once per token into a double-buffered shared table
// (one barrier per token) read by every head.
template <typename T>
__global__ void __launch_bounds__(512, 2)
    QkNormRopeFwdVecKernel(const T* in, const T* wq, const T* wk, const int32_t* pos, T* out,
                           float* rstd_q, float* rstd_k, int64_t T_, int H, int Dh, int G,
                           float eps, float theta, bool copy_v) {
  constexpr int V = kVec<T>;
  extern __shared__ float2 qk_tab[];  // [2][half]
  const int half = Dh / 2, tid = threadIdx.x;
  const bool active = tid < 2 * H * G;
  const int row = active ? tid / G : 0, g = tid % G;
  const int which = row / H, h = row - which * H;
  const int c0 = g * V;
  float wlo[V], whi[V];
  {
    const T* w = which == 0 ? wq : wk;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      wlo[e] = active ? ToFloat(w[c0 + e]) : 0.0f;
      whi[e] = active ? ToFloat(w[half + c0 + e]) : 0.0f;
    }
  }
  float* rstd = which == 0 ? rstd_q : rstd_k;
  const double inv_freq = tid < half ? internal::RopeInvFreq(tid, Dh, theta) : 0.0;
  const int64_t C = 3 * static_cast<int64_t>(H) * Dh;
  const int v_off = 2 * H * Dh, n_v = H * Dh / V;
  int buf = 0;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x, buf ^= 1) {
    const int p = pos[t];
    const T* src = in + t * C;
    T* dst = out + t * C;
    uint4 ulo = make_uint4(0, 0, 0, 0), uhi = make_uint4(0, 0, 0, 0);
    if (active) {
      ulo = Load16(src + row * Dh + c0);
      uhi = Load16(src + row * Dh + half + c0);
    }
    if (copy_v) {
      for (int i = tid; i < n_v; i += blockDim.x) {
        Store16(dst + v_off + i * V, Load16(src + v_off + i * V));
      }
    }
    float2* tb = qk_tab + buf * half;
    if (tid < half) {
      float c, s;
      internal::RopeCosSinOfAngle(static_cast<double>(p) * inv_freq, &c, &s);
      tb[tid] = make_float2(c, s);
    }
    float lo[V], hi[V];
    Unpack<T>(ulo, lo);
    Unpack<T>(uhi, hi);
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) ss += lo[e] * lo[e] + hi[e] * hi[e];
    ss = GroupSum(ss, G);
    // Publishes tb; also orders the previous token's reads of the other buffer before its next
    // writes.
    __syncthreads();
    if (active) {
      const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
      float ylo[V], yhi[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float2 cs = tb[c0 + e];
        const float a = lo[e] * rs * wlo[e];
        const float b = hi[e] * rs * whi[e];
        ylo[e] = a * cs.x - b * cs.y;
        yhi[e] = b * cs.x + a * cs.y;
      }
      Store16(dst + row * Dh + c0, Pack<T>(ylo));
      Store16(dst + row * Dh + half + c0, Pack<T>(yhi));
      if (g == 0) rstd[t * H + h] = rs;
    }
  }
}

// Backward of the above, same thread layout. dw accumulates in shared memory, one private slot per
// thread and column (acc[e][tid], e < 2V: this thread's columns of w_q or w_k, summed over the
// block's tokens in order; registers would spill), then the block adds its threads' sums over
// heads in order and writes ws[b, 0:2Dh] (q then k). kAmax: also max |din| as stored (the v
// block's copy included) into *amax (zeroed before).
template <typename T, bool kAmax>
__global__ void __launch_bounds__(512, 2)
    QkNormRopeBwdVecKernel(const T* in, const T* wq, const T* wk, const float* rstd_q,
                           const float* rstd_k, const int32_t* pos, const T* dout, T* din,
                           int64_t T_, int H, int Dh, int G, float theta, bool copy_v,
                           float* ws, float* amax) {
  constexpr int V = kVec<T>;
  extern __shared__ float2 qk_tab[];  // [2][half] float2, [half] double, [2V][items] float
  const int half = Dh / 2, tid = threadIdx.x;
  const int items = 2 * H * G;
  const bool active = tid < items;
  const int row = active ? tid / G : 0, g = tid % G;
  const int which = row / H, h = row - which * H;
  const int c0 = g * V;
  uint4 wl, wh;  // this thread's weights, packed (exact: they are T values)
  {
    const T* w = which == 0 ? wq : wk;
    float wlo[V], whi[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      wlo[e] = active ? ToFloat(w[c0 + e]) : 0.0f;
      whi[e] = active ? ToFloat(w[half + c0 + e]) : 0.0f;
    }
    wl = Pack<T>(wlo);
    wh = Pack<T>(whi);
  }
  const float* rstd = which == 0 ? rstd_q : rstd_k;
  // Each thread reads only its own inv_freq and acc entries: no barrier needed for them.
  double* inv_freq = reinterpret_cast<double*>(qk_tab + 2 * half);
  float* acc = reinterpret_cast<float*>(inv_freq + half);
  if (tid < half) inv_freq[tid] = internal::RopeInvFreq(tid, Dh, theta);
  if (active) {
    for (int e = 0; e < 2 * V; ++e) acc[e * items + tid] = 0.0f;
  }
  const int64_t C = 3 * static_cast<int64_t>(H) * Dh;
  const int v_off = 2 * H * Dh, n_v = H * Dh / V;
  int buf = 0;
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x, buf ^= 1) {
    const int p = pos[t];
    const int64_t off = t * C + row * Dh + c0;
    uint4 gl = make_uint4(0, 0, 0, 0), gh = gl, xl = gl, xh = gl;
    float rs = 0.0f;
    if (active) {
      gl = Load16(dout + off);
      gh = Load16(dout + off + half);
      xl = Load16(in + off);
      xh = Load16(in + off + half);
      rs = rstd[t * H + h];
    }
    if (copy_v) {
      for (int i = tid; i < n_v; i += blockDim.x) {
        const uint4 v = Load16(dout + t * C + v_off + i * V);
        Store16(din + t * C + v_off + i * V, v);
        if constexpr (kAmax) m = max(m, PackedAbsBits<T>(v));
      }
    }
    float2* tb = qk_tab + buf * half;
    if (tid < half) {
      float c, s;
      internal::RopeCosSinOfAngle(static_cast<double>(p) * inv_freq[tid], &c, &s);
      tb[tid] = make_float2(c, s);
    }
    __syncthreads();
    float dot = 0.0f;
    {
      float ga[V], gb[V], xa[V], xb[V], wa[V], wb[V];
      Unpack<T>(gl, ga);
      Unpack<T>(gh, gb);
      Unpack<T>(xl, xa);
      Unpack<T>(xh, xb);
      Unpack<T>(wl, wa);
      Unpack<T>(wh, wb);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float2 cs = tb[c0 + e];
        const float ua = ga[e] * cs.x + gb[e] * cs.y;  // rotation by the negative angle
        const float ub = gb[e] * cs.x - ga[e] * cs.y;
        dot += ua * wa[e] * xa[e] + ub * wb[e] * xb[e];
      }
    }
    dot = GroupSum(dot, G);
    // Recompute the unpacked values and the rotation below rather than keep them live.
    Opaque(gl);
    Opaque(gh);
    Opaque(xl);
    Opaque(xh);
    Opaque(wl);
    Opaque(wh);
    if (active) {
      const float cc = dot * rs * rs / static_cast<float>(Dh);
      float ga[V], gb[V], xa[V], xb[V], wa[V], wb[V], da[V], db[V];
      Unpack<T>(gl, ga);
      Unpack<T>(gh, gb);
      Unpack<T>(xl, xa);
      Unpack<T>(xh, xb);
      Unpack<T>(wl, wa);
      Unpack<T>(wh, wb);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float2 cs = tb[c0 + e];
        const float ua = ga[e] * cs.x + gb[e] * cs.y;
        const float ub = gb[e] * cs.x - ga[e] * cs.y;
        da[e] = rs * (wa[e] * ua - xa[e] * cc);
        db[e] = rs * (wb[e] * ub - xb[e] * cc);
        acc[e * items + tid] += ua * xa[e] * rs;
        acc[(V + e) * items + tid] += ub * xb[e] * rs;
      }
      const uint4 pa = Pack<T>(da), pb = Pack<T>(db);
      Store16(din + off, pa);
      Store16(din + off + half, pb);
      if constexpr (kAmax) m = max(m, max(PackedAbsBits<T>(pa), PackedAbsBits<T>(pb)));
    }
  }
  if constexpr (kAmax) BlockMaxToGlobal(m, amax);
  __syncthreads();
  for (int col = tid; col < 2 * Dh; col += blockDim.x) {
    const int blk = col / Dh, jj = col - blk * Dh;  // blk: 0 q, 1 k
    const int part = jj >= half ? 1 : 0, j2 = jj - part * half;
    const int gg = j2 / V, e = j2 - gg * V;
    float s = 0.0f;
    for (int hh = 0; hh < H; ++hh) s += acc[(part * V + e) * items + (blk * H + hh) * G + gg];
    ws[blockIdx.x * static_cast<int64_t>(2 * Dh) + col] = s;
  }
}

// Group norm + gate forward: G threads per (token, head) row (G = Dh / V rounded up to a power of
// two <= 32; lanes g >= Dh / V idle), one vector each.
template <typename T>
__global__ void __launch_bounds__(256)
    GroupNormGateFwdVecKernel(const T* o, const T* w, const T* gate, T* y, float* rstd,
                              int64_t rows, int H, int Dh, int G, float eps) {
  constexpr int V = kVec<T>;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t r = i / G;
  const int g = static_cast<int>(i % G);
  const bool active = r < rows && g * V < Dh;
  const int h = static_cast<int>(r % H);
  const int64_t off = r * Dh + g * V;  // [T, H, Dh] flattened
  float ov[V], gv[V];
  Unpack<T>(active ? Load16(o + off) : make_uint4(0, 0, 0, 0), ov);
  Unpack<T>(active ? Load16(gate + off) : make_uint4(0, 0, 0, 0), gv);
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < V; ++e) ss += ov[e] * ov[e];
  ss = GroupSum(ss, G);
  const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
  if (active) {
    float wv[V], yv[V];
    Unpack<T>(Load16(w + h * Dh + g * V), wv);
#pragma unroll
    for (int e = 0; e < V; ++e) yv[e] = ov[e] * rs * wv[e] * internal::Sigmoid(gv[e]);
    Store16(y + off, Pack<T>(yv));
    if (g == 0) rstd[r] = rs;
  }
}

// Group norm + gate backward: thread i owns vector i of every token row (head i / G, G = Dh / V a
// power of two <= 32: a head's threads are aligned lanes), so its share of dw accumulates in
// registers and a head's dot product is a shuffle sum: no barrier. Blocks take kTok tokens at a
// time; block b writes ws[b, :]. kAmax: also max |dgate| as stored into *amax (zeroed before).
template <typename T, int kTok, bool kAmax>
__global__ void __launch_bounds__(512, 2)
    GroupNormGateBwdVecKernel(const T* o, const T* w, const T* gate, const float* rstd,
                              const T* dy, T* do_, T* dgate, int64_t T_, int H, int Dh, int G,
                              float* ws, float* amax) {
  constexpr int V = kVec<T>;
  const int tid = threadIdx.x;
  const int C = H * Dh;
  const bool active = tid < C / V;
  const int h = tid / G, col = tid * V;
  uint4 wraw = active ? Load16(w + col) : make_uint4(0, 0, 0, 0);
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.0f;
  uint32_t m = 0;
  for (int64_t t0 = blockIdx.x * static_cast<int64_t>(kTok); t0 < T_;
       t0 += static_cast<int64_t>(gridDim.x) * kTok) {
    uint4 oraw[kTok], graw[kTok], draw[kTok];
    float rs[kTok];
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      const int64_t t = t0 + k;
      oraw[k] = graw[k] = draw[k] = make_uint4(0, 0, 0, 0);
      rs[k] = 0.0f;
      if (active && t < T_) {
        oraw[k] = Load16(o + t * C + col);
        graw[k] = Load16(gate + t * C + col);
        draw[k] = Load16(dy + t * C + col);
        rs[k] = rstd[t * H + h];
      }
    }
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      const int64_t t = t0 + k;
      float sig[V];
      float dot = 0.0f;
      {
        float ov[V], gv[V], dv[V], wv[V];
        Unpack<T>(oraw[k], ov);
        Unpack<T>(graw[k], gv);
        Unpack<T>(draw[k], dv);
        Unpack<T>(wraw, wv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          sig[e] = internal::Sigmoid(gv[e]);
          dot += dv[e] * wv[e] * sig[e] * ov[e];
        }
      }
      dot = GroupSum(dot, G);
      // Unpack again below rather than keep the unpacked values live (the sigmoids are kept).
      Opaque(oraw[k]);
      Opaque(draw[k]);
      Opaque(wraw);
      if (active && t < T_) {
        float ov[V], dv[V], wv[V];
        Unpack<T>(oraw[k], ov);
        Unpack<T>(draw[k], dv);
        Unpack<T>(wraw, wv);
        const float r = rs[k];
        const float c = dot * r * r * r / static_cast<float>(Dh);
        float dgv[V], dov[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float n = ov[e] * r;
          const float dn = dv[e] * wv[e] * sig[e];
          acc[e] += dv[e] * n * sig[e];
          dgv[e] = dn * n * (1.0f - sig[e]);
          dov[e] = r * dn - c * ov[e];
        }
        const uint4 pg = Pack<T>(dgv);
        Store16(dgate + t * C + col, pg);
        Store16(do_ + t * C + col, Pack<T>(dov));
        if constexpr (kAmax) m = max(m, PackedAbsBits<T>(pg));
      }
    }
  }
  if constexpr (kAmax) BlockMaxToGlobal(m, amax);
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) ws[blockIdx.x * static_cast<int64_t>(C) + col + e] = acc[e];
  }
}

// ---- Launch plans of the vector paths (sizes only; the callers also check pointer alignment) ----

// RMSNorm forward: vectors per lane cached in registers, 0 when the vector path does not apply.
template <typename T>
int RmsFwdVecPerLane(int64_t D) {
  constexpr int V = kVec<T>;
  if (D % V != 0) return 0;
  const int64_t nvec = D / V;
  return nvec <= 32 ? 1 : nvec <= 64 ? 2 : nvec <= 128 ? 4 : nvec <= 256 ? 8 : 0;
}

// Rows per iteration of RmsNormBwdVecKernel (register budget: 64 at 4 blocks of 256 per SM).
template <typename T>
constexpr int RmsBwdRowsPerIter(int nv) {
  return nv == 1 ? 4 : sizeof(T) == 4 ? 2 : 1;
}

struct RmsBwdVecPlan {
  int nv = 0;  // vectors per thread (1 or 2); 0: no vector path
  int threads = 0;
  int64_t blocks = 0;
};
template <typename T>
RmsBwdVecPlan PlanRmsBwdVec(int64_t rows, int64_t D) {
  constexpr int V = kVec<T>;
  RmsBwdVecPlan p;
  if (D % V != 0 || D / V < 32 || D / V > 512) return p;
  const int64_t nvec = D / V;
  p.nv = nvec <= 256 ? 1 : 2;
  p.threads = static_cast<int>(RoundUp(CeilDiv(nvec, p.nv), 32));
  const int rows_per_iter = RmsBwdRowsPerIter<T>(p.nv);
  p.blocks = VecBwdBlocks(CeilDiv(rows, rows_per_iter), p.threads);
  return p;
}

struct QkVecPlan {
  int G = 0;  // threads per (row, column group); 0: no vector path
  int threads = 0;
  size_t smem_fwd = 0, smem_bwd = 0;
};
template <typename T>
QkVecPlan PlanQkVec(int64_t H, int64_t Dh) {
  constexpr int V = kVec<T>;
  QkVecPlan p;
  const int64_t half = Dh / 2;
  if (half % V != 0 || !IsPow2(half / V) || half / V > 32) return p;
  const int64_t G = half / V, items = 2 * H * G;
  const int64_t threads = RoundUp(std::max(items, half), 32);
  const int64_t smem_bwd = 24 * half + items * 2 * V * 4;
  if (threads > 512 || smem_bwd > 48 * 1024) return p;
  p.G = static_cast<int>(G);
  p.threads = static_cast<int>(threads);
  p.smem_fwd = static_cast<size_t>(16 * half);
  p.smem_bwd = static_cast<size_t>(smem_bwd);
  return p;
}

// Group norm + gate backward: threads per head (Dh / V, a power of two <= 32), 0 when no vector path.
template <typename T>
int GroupBwdVecG(int64_t H, int64_t Dh) {
  constexpr int V = kVec<T>;
  if (Dh % V != 0 || !IsPow2(Dh / V) || Dh / V > 32 || H * Dh / V > 512) return 0;
  return static_cast<int>(Dh / V);
}
constexpr int kGroupBwdTokens = 2;
int64_t GroupBwdVecBlocks(int64_t T, int64_t H, int64_t Dh, int G) {
  return VecBwdBlocks(CeilDiv(T, kGroupBwdTokens), static_cast<int>(RoundUp(H * Dh / (Dh / G), 32)));
}

template <typename T>
Status LaunchRmsNormFwd(const void* x, const void* residual, void* h, const void* w, void* y,
                        float* rstd, int64_t rows, int64_t D, float eps, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(residual);
  T* ht = static_cast<T*>(h);
  const T* wt = static_cast<const T*>(w);
  T* yt = static_cast<T*>(y);
  const bool res = residual != nullptr;
  const int nv = RmsFwdVecPerLane<T>(D);
  const bool aligned = Aligned16(x) && Aligned16(w) && Aligned16(y) &&
                       (!res || (Aligned16(residual) && Aligned16(h)));
  const int64_t blocks = CeilDiv(rows, kFwdWarps);
  const int threads = 32 * kFwdWarps;
  const int Di = static_cast<int>(D);
  if (nv > 0 && aligned) {
#define SPINDLE_RMS_FWD_VEC(NV)                                                                 \
  if (res) {                                                                                    \
    RmsNormFwdVecKernel<T, true, NV><<<blocks, threads, 0, stream>>>(xt, rt, ht, wt, yt, rstd,  \
                                                                     rows, Di, eps);            \
  } else {                                                                                      \
    RmsNormFwdVecKernel<T, false, NV><<<blocks, threads, 0, stream>>>(xt, nullptr, nullptr, wt, \
                                                                      yt, rstd, rows, Di, eps); \
  }
    switch (nv) {
      case 1:
        SPINDLE_RMS_FWD_VEC(1);
        break;
      case 2:
        SPINDLE_RMS_FWD_VEC(2);
        break;
      case 4:
        SPINDLE_RMS_FWD_VEC(4);
        break;
      default:
        SPINDLE_RMS_FWD_VEC(8);
        break;
    }
#undef SPINDLE_RMS_FWD_VEC
  } else if (res) {
    RmsNormFwdKernel<T, true><<<blocks, threads, 0, stream>>>(xt, rt, ht, wt, yt, rstd, rows, D,
                                                              eps);
  } else {
    RmsNormFwdKernel<T, false><<<blocks, threads, 0, stream>>>(xt, nullptr, nullptr, wt, yt, rstd,
                                                               rows, D, eps);
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// The vector paths' grids never exceed the scalar plans' block counts, so the workspace sizes are
// those of the scalar plans (unchanged, and monotonic in the sizes: callers size one workspace for
// their widest call).
int64_t RmsBwdVecBlocks(const RmsBwdVecPlan& p, int64_t rows, int64_t D) {
  return std::min(p.blocks, PlanBwd(rows, D).blocks);
}
int64_t QkBwdVecBlocks(int threads, int64_t T, int64_t H, int64_t Dh) {
  return std::min(VecBwdBlocks(T, threads), PlanBwd(T * H * 3, 2 * Dh).blocks);
}
int64_t GroupBwdVecBlocksCapped(int64_t T, int64_t H, int64_t Dh, int G) {
  return std::min(GroupBwdVecBlocks(T, H, Dh, G), PlanBwd(T, H * Dh).blocks);
}

}  // namespace

Status RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                      float eps, DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D < (int64_t{1} << 31), "RmsNormForward: bad sizes");
  if (rows == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormForward", {
    return LaunchRmsNormFwd<scalar_t>(x, nullptr, nullptr, w, y, rstd, rows, D, eps, stream);
  });
  return Status::Ok();
}

Status RmsNormResidualForward(const void* x, const void* residual, void* h, const void* w, void* y,
                              float* rstd, int64_t rows, int64_t D, float eps, DType dtype,
                              cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D < (int64_t{1} << 31) && residual != nullptr,
                    "RmsNormResidualForward: bad sizes");
  if (rows == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormResidualForward", {
    return LaunchRmsNormFwd<scalar_t>(x, residual, h, w, y, rstd, rows, D, eps, stream);
  });
  return Status::Ok();
}

size_t RmsNormBackwardWorkspaceBytes(int64_t rows, int64_t D) {
  return static_cast<size_t>(PlanBwd(rows, D).blocks * D * 4);
}

Status RmsNormBackward(const void* x, const void* w, const float* rstd, const void* dy,
                       const void* dresidual, void* dx, float* dw, int64_t rows, int64_t D,
                       DType dtype, Workspace ws, cudaStream_t stream, float* dx_amax) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D <= kMaxRowWidth, "RmsNormBackward: bad sizes");
  if (dx_amax != nullptr) SPINDLE_CUDA_CHECK(cudaMemsetAsync(dx_amax, 0, sizeof(float), stream));
  if (rows == 0) return Status::Ok();
  SPINDLE_CHECK_ARG(ws.bytes >= RmsNormBackwardWorkspaceBytes(rows, D) && ws.data != nullptr,
                    "RmsNormBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  const bool aligned = Aligned16(x) && Aligned16(w) && Aligned16(dy) && Aligned16(dx) &&
                       (dresidual == nullptr || Aligned16(dresidual));
  int64_t blocks = 0;
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormBackward", {
    const auto* xt = static_cast<const scalar_t*>(x);
    const auto* wt = static_cast<const scalar_t*>(w);
    const auto* gt = static_cast<const scalar_t*>(dy);
    const auto* rt = static_cast<const scalar_t*>(dresidual);
    auto* dxt = static_cast<scalar_t*>(dx);
    const RmsBwdVecPlan vp = PlanRmsBwdVec<scalar_t>(rows, D);
    if (vp.nv > 0 && aligned) {
      blocks = RmsBwdVecBlocks(vp, rows, D);
      auto launch = [&](auto kernel) {
        kernel<<<blocks, vp.threads, 0, stream>>>(xt, wt, rstd, gt, rt, dxt, rows,
                                                   static_cast<int>(D), part, dx_amax);
      };
      constexpr int kR1 = RmsBwdRowsPerIter<scalar_t>(1), kR2 = RmsBwdRowsPerIter<scalar_t>(2);
      if (vp.nv == 1 && dx_amax == nullptr) launch(RmsNormBwdVecKernel<scalar_t, 1, kR1, false>);
      if (vp.nv == 1 && dx_amax != nullptr) launch(RmsNormBwdVecKernel<scalar_t, 1, kR1, true>);
      if (vp.nv == 2 && dx_amax == nullptr) launch(RmsNormBwdVecKernel<scalar_t, 2, kR2, false>);
      if (vp.nv == 2 && dx_amax != nullptr) launch(RmsNormBwdVecKernel<scalar_t, 2, kR2, true>);
    } else {
      const BwdPlan plan = PlanBwd(rows, D);
      blocks = plan.blocks;
      RmsNormBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * D * 4, stream>>>(
          xt, wt, rstd, gt, rt, dxt, rows, D, part, dx_amax);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, blocks, D, D, dw, dw, stream);
}

Status QkNormRopeForward(const void* qkv_in, const void* w_q, const void* w_k,
                         const int32_t* pos, void* qkv_out, float* rstd_q, float* rstd_k,
                         int64_t T, int64_t H, int64_t Dh, float eps, float theta, bool copy_v,
                         DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && Dh % 2 == 0 && Dh <= 64 * kMaxPairsPerLane,
                    "QkNormRopeForward: Dh must be even and <= 512");
  if (T == 0) return Status::Ok();
  const int n_blocks = copy_v ? 3 : 2;
  const int64_t rows = T * H * n_blocks;
  const bool aligned = Aligned16(qkv_in) && Aligned16(qkv_out);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "QkNormRopeForward", {
    const auto* in = static_cast<const scalar_t*>(qkv_in);
    const auto* wq = static_cast<const scalar_t*>(w_q);
    const auto* wk = static_cast<const scalar_t*>(w_k);
    auto* out = static_cast<scalar_t*>(qkv_out);
    const QkVecPlan vp = PlanQkVec<scalar_t>(H, Dh);
    if (vp.G > 0 && aligned) {
      QkNormRopeFwdVecKernel<scalar_t>
          <<<VecBwdBlocks(T, vp.threads), vp.threads, vp.smem_fwd, stream>>>(
              in, wq, wk, pos, out, rstd_q, rstd_k, T, static_cast<int>(H), static_cast<int>(Dh),
              vp.G, eps, theta, copy_v);
    } else {
      QkNormRopeFwdKernel<scalar_t><<<CeilDiv(rows, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
          in, wq, wk, pos, out, rstd_q, rstd_k, T, H, Dh, eps, theta, n_blocks);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t QkNormRopeBackwardWorkspaceBytes(int64_t T, int64_t H, int64_t Dh) {
  return static_cast<size_t>(PlanBwd(T * H * 3, 2 * Dh).blocks * 2 * Dh * 4);
}

Status QkNormRopeBackward(const void* qkv_in, const void* w_q, const void* w_k,
                          const float* rstd_q, const float* rstd_k, const int32_t* pos,
                          const void* dqkv_out, void* dqkv_in, float* dw_q, float* dw_k,
                          int64_t T, int64_t H, int64_t Dh, float theta, bool copy_v, DType dtype,
                          Workspace ws, cudaStream_t stream, float* din_amax) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && Dh % 2 == 0 && Dh <= 64 * kMaxPairsPerLane,
                    "QkNormRopeBackward: Dh must be even and <= 512");
  if (din_amax != nullptr) SPINDLE_CUDA_CHECK(cudaMemsetAsync(din_amax, 0, sizeof(float), stream));
  if (T == 0) return Status::Ok();
  const int n_blocks = copy_v ? 3 : 2;
  SPINDLE_CHECK_ARG(ws.bytes >= QkNormRopeBackwardWorkspaceBytes(T, H, Dh) && ws.data != nullptr,
                    "QkNormRopeBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  const bool aligned = Aligned16(qkv_in) && Aligned16(dqkv_out) && Aligned16(dqkv_in);
  int64_t blocks = 0;
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "QkNormRopeBackward", {
    const auto* in = static_cast<const scalar_t*>(qkv_in);
    const auto* wq = static_cast<const scalar_t*>(w_q);
    const auto* wk = static_cast<const scalar_t*>(w_k);
    const auto* dout = static_cast<const scalar_t*>(dqkv_out);
    auto* din = static_cast<scalar_t*>(dqkv_in);
    const QkVecPlan vp = PlanQkVec<scalar_t>(H, Dh);
    if (vp.G > 0 && aligned) {
      blocks = QkBwdVecBlocks(vp.threads, T, H, Dh);
      auto launch = [&](auto kernel) {
        kernel<<<blocks, vp.threads, vp.smem_bwd, stream>>>(
            in, wq, wk, rstd_q, rstd_k, pos, dout, din, T, static_cast<int>(H),
            static_cast<int>(Dh), vp.G, theta, copy_v, part, din_amax);
      };
      if (din_amax != nullptr) {
        launch(QkNormRopeBwdVecKernel<scalar_t, true>);
      } else {
        launch(QkNormRopeBwdVecKernel<scalar_t, false>);
      }
    } else {
      // The plan uses 3 blocks per token either way (workspace size independent of copy_v).
      const BwdPlan plan = PlanBwd(T * H * 3, 2 * Dh);
      blocks = plan.blocks;
      QkNormRopeBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * 2 * Dh * 4,
                                      stream>>>(in, wq, wk, rstd_q, rstd_k, pos, dout, din, T, H,
                                                Dh, theta, n_blocks, part, din_amax);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, blocks, 2 * Dh, Dh, dw_q, dw_k, stream);
}

Status GroupNormGateForward(const void* o, const void* w, const void* gate, void* y, float* rstd,
                            int64_t T, int64_t H, int64_t Dh, float eps, DType dtype,
                            cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && H * Dh < (int64_t{1} << 31),
                    "GroupNormGateForward: bad sizes");
  if (T == 0) return Status::Ok();
  const bool aligned = Aligned16(o) && Aligned16(w) && Aligned16(gate) && Aligned16(y);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateForward", {
    const auto* ot = static_cast<const scalar_t*>(o);
    const auto* wt = static_cast<const scalar_t*>(w);
    const auto* gt = static_cast<const scalar_t*>(gate);
    auto* yt = static_cast<scalar_t*>(y);
    constexpr int V = kVec<scalar_t>;
    if (aligned && Dh % V == 0 && Dh / V <= 32) {
      const int G = NextPow2(Dh / V);
      GroupNormGateFwdVecKernel<scalar_t><<<CeilDiv(T * H * G, 256), 256, 0, stream>>>(
          ot, wt, gt, yt, rstd, T * H, static_cast<int>(H), static_cast<int>(Dh), G, eps);
    } else {
      GroupNormGateFwdKernel<scalar_t><<<CeilDiv(T * H, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
          ot, wt, gt, yt, rstd, T, H, Dh, eps);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t GroupNormGateBackwardWorkspaceBytes(int64_t T, int64_t H, int64_t Dh) {
  return static_cast<size_t>(PlanBwd(T, H * Dh).blocks * H * Dh * 4);
}

Status GroupNormGateBackward(const void* o, const void* w, const void* gate, const float* rstd,
                             const void* dy, void* do_, float* dw, void* dgate, int64_t T,
                             int64_t H, int64_t Dh, DType dtype, Workspace ws,
                             cudaStream_t stream, float* dgate_amax) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && H * Dh <= kMaxRowWidth,
                    "GroupNormGateBackward: bad sizes");
  if (dgate_amax != nullptr)
    SPINDLE_CUDA_CHECK(cudaMemsetAsync(dgate_amax, 0, sizeof(float), stream));
  if (T == 0) return Status::Ok();
  SPINDLE_CHECK_ARG(ws.bytes >= GroupNormGateBackwardWorkspaceBytes(T, H, Dh) && ws.data != nullptr,
                    "GroupNormGateBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  const bool aligned = Aligned16(o) && Aligned16(w) && Aligned16(gate) && Aligned16(dy) &&
                       Aligned16(do_) && Aligned16(dgate);
  int64_t blocks = 0;
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateBackward", {
    const auto* ot = static_cast<const scalar_t*>(o);
    const auto* wt = static_cast<const scalar_t*>(w);
    const auto* gt = static_cast<const scalar_t*>(gate);
    const auto* dyt = static_cast<const scalar_t*>(dy);
    auto* dot = static_cast<scalar_t*>(do_);
    auto* dgt = static_cast<scalar_t*>(dgate);
    const int G = GroupBwdVecG<scalar_t>(H, Dh);
    if (G > 0 && aligned) {
      blocks = GroupBwdVecBlocksCapped(T, H, Dh, G);
      const int threads = static_cast<int>(RoundUp(H * G, 32));
      auto launch = [&](auto kernel) {
        kernel<<<blocks, threads, 0, stream>>>(ot, wt, gt, rstd, dyt, dot, dgt, T,
                                               static_cast<int>(H), static_cast<int>(Dh), G, part,
                                               dgate_amax);
      };
      if (dgate_amax != nullptr) {
        launch(GroupNormGateBwdVecKernel<scalar_t, kGroupBwdTokens, true>);
      } else {
        launch(GroupNormGateBwdVecKernel<scalar_t, kGroupBwdTokens, false>);
      }
    } else {
      const BwdPlan plan = PlanBwd(T, H * Dh);
      blocks = plan.blocks;
      GroupNormGateBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * H * Dh * 4,
                                         stream>>>(ot, wt, gt, rstd, dyt, dot, dgt, T, H, Dh,
                                                   part, dgate_amax);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, blocks, H * Dh, H * Dh, dw, dw, stream);
}

}  // namespace spindle::kernels::cuda
