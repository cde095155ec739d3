// The MoE FFN's routing and data-movement kernels on CUDA (moe.h): router forward/backward (one
// warp per token), the stable counting sort that groups (token, choice) pairs by expert, row
// gathers and the weighted combine with its backward. The FP8 gather is in moe_fp8.cu, the
// grouped GEMMs in moe_gemm.cu.
//
// Grouping, and why it is deterministic: items are cut into tiles of kTileItems, one warp each.
// Pass 1 counts each tile's keys (warp-local, __match_any_sync: one leader per distinct key adds
// its peers' count, no atomics), pass 2 scans the tiles' counts per expert in tile order (one
// block per expert), pass 3 turns counts into padded offsets, pass 4 places every item: row =
// offsets[e] + (items of key e in earlier tiles) + (in earlier rounds of the tile) + (in lower
// lanes of the round). Every row depends only on the keys: the same result as the CPU's loop.
#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <string>

#include "kernels/cuda/amax.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::AbsBits;
using internal::Aligned16;
using internal::CeilDiv;
using internal::FromFloat;
using internal::kVec;
using internal::Load16;
using internal::Load8;
using internal::Pack;
using internal::Store16;
using internal::ToFloat;
using internal::Unpack;

constexpr int kWarps = 8;  // warps per block of the per-warp kernels
constexpr int kThreads = 32 * kWarps;

// ---- Router -----------------------------------------------------------------------------------

// The same expression as the CPU's (accurate expf; the CPU's std::exp may differ by an ulp).
__device__ __forceinline__ float RouterSigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

// (a_key, a_id) ranks before (b_key, b_id): larger key, ties to the lower id.
__device__ __forceinline__ bool Before(float a_key, int a_id, float b_key, int b_id) {
  return a_key > b_key || (a_key == b_key && a_id < b_id);
}

// keys: per warp E floats of dynamic shared memory.
__global__ void __launch_bounds__(kThreads)
    RouterForwardKernel(const float* logits, const float* bias, int32_t* idx, float* weights,
                        float* lse, int64_t T, int E, int K) {
  extern __shared__ float keys_all[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  if (t >= T) return;  // uniform over the warp; no block barrier below
  float* keys = keys_all + warp * E;
  const float* z = logits + t * E;
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    const float v = z[e];
    keys[e] = RouterSigmoid(v) + bias[e];
    m = fmaxf(m, v);
  }
  __syncwarp();
  // K rounds of a warp argmax; the winner's key is then taken out of the running.
  for (int k = 0; k < K; ++k) {
    float best = -INFINITY;
    int best_id = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      const float v = keys[e];
      if (Before(v, e, best, best_id)) best = v, best_id = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oid = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (Before(ov, oid, best, best_id)) best = ov, best_id = oid;
    }
    if (lane == 0) {
      idx[t * K + k] = best_id;
      keys[best_id] = -INFINITY;
    }
    __syncwarp();
  }
  __syncwarp();
  if (lane == 0) {  // the sum in choice order, as the CPU's
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += RouterSigmoid(z[idx[t * K + k]]);
    for (int k = 0; k < K; ++k) weights[t * K + k] = RouterSigmoid(z[idx[t * K + k]]) / sum;
  }
  if (lse != nullptr) {
    m = internal::WarpMax(m);
    float s = 0.0f;
    for (int e = lane; e < E; e += 32) s += expf(z[e] - m);
    s = internal::WarpSum(s);
    if (lane == 0) lse[t] = m + logf(s);
  }
}

__global__ void __launch_bounds__(kThreads)
    RouterBackwardKernel(const float* logits, const int32_t* idx, const float* dweights,
                         const float* lse, float zloss_scale, float* dlogits, int64_t T, int E,
                         int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  if (t >= T) return;
  const float* z = logits + t * E;
  const int32_t* id = idx + t * K;
  const float* dg = dweights + t * K;
  // Every lane the same sum and dot, in the CPU's order.
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += RouterSigmoid(z[id[k]]);
  float dot = 0.0f;
  for (int k = 0; k < K; ++k) dot += RouterSigmoid(z[id[k]]) / sum * dg[k];
  const float c = zloss_scale != 0.0f ? zloss_scale * 2.0f * lse[t] : 0.0f;
  for (int e = lane; e < E; e += 32) {
    float v = zloss_scale != 0.0f ? c * expf(z[e] - lse[t]) : 0.0f;
    for (int k = 0; k < K; ++k) {
      if (id[k] == e) {
        const float s = RouterSigmoid(z[e]);
        v += (dg[k] - dot) / sum * s * (1.0f - s);
      }
    }
    dlogits[t * E + e] = v;
  }
}

// ---- Grouping ---------------------------------------------------------------------------------

constexpr int kTileRounds = 8;                // rounds of 32 items per tile
constexpr int kTileItems = 32 * kTileRounds;  // items per warp tile

// Pass 1: tile_counts[tile * E + e] = items of key e in the tile.
__global__ void __launch_bounds__(kThreads)
    TileCountKernel(const int32_t* key, int64_t n, int E, int64_t tiles, int32_t* tile_counts) {
  extern __shared__ int32_t counts_all[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tile = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  if (tile >= tiles) return;
  int32_t* counts = counts_all + warp * E;
  for (int e = lane; e < E; e += 32) counts[e] = 0;
  __syncwarp();
  const int64_t base = tile * kTileItems;
  for (int r = 0; r < kTileRounds; ++r) {
    const int64_t i = base + r * 32 + lane;
    const bool valid = i < n;
    const int k = valid ? key[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, k);
    if (valid && lane == __ffs(peers) - 1) counts[k] += __popc(peers);
    __syncwarp();
  }
  for (int e = lane; e < E; e += 32) tile_counts[tile * E + e] = counts[e];
}

// Pass 2, one block per expert e: tile_counts[., e] becomes its exclusive prefix over the tiles;
// counts[e] its total.
__global__ void __launch_bounds__(kThreads)
    TileScanKernel(int32_t* tile_counts, int64_t tiles, int E, int64_t* counts) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int e = blockIdx.x;
  int32_t carry = 0;
  for (int64_t start = 0; start < tiles; start += kThreads) {
    const int64_t t = start + threadIdx.x;
    const int32_t v = t < tiles ? tile_counts[t * E + e] : 0;
    int32_t prefix = 0, total = 0;
    Scan(temp).ExclusiveSum(v, prefix, total);
    if (t < tiles) tile_counts[t * E + e] = carry + prefix;
    carry += total;
    __syncthreads();  // temp is reused
  }
  if (threadIdx.x == 0) counts[e] = carry;
}

// Pass 3: offsets from the counts, padded to `align` (one thread; E <= kMoeMaxExperts).
__global__ void OffsetsKernel(const int64_t* counts, int E, int64_t align, int64_t* offsets) {
  if (threadIdx.x != 0) return;
  int64_t o = 0;
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) {
    o += (counts[e] + align - 1) / align * align;
    offsets[e + 1] = o;
  }
}

// Pass 4: every item's row.
__global__ void __launch_bounds__(kThreads)
    PlaceKernel(const int32_t* key, int64_t n, int64_t per_source, int E, int64_t tiles,
                const int32_t* tile_prefix, const int64_t* offsets, int32_t* item_row,
                int32_t* row_source) {
  extern __shared__ int32_t next_all[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tile = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  if (tile >= tiles) return;
  int32_t* next = next_all + warp * E;
  for (int e = lane; e < E; e += 32) {
    next[e] = static_cast<int32_t>(offsets[e]) + tile_prefix[tile * E + e];
  }
  __syncwarp();
  const int64_t base = tile * kTileItems;
  for (int r = 0; r < kTileRounds; ++r) {
    const int64_t i = base + r * 32 + lane;
    const bool valid = i < n;
    const int k = valid ? key[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, k);
    int32_t row = 0;
    if (valid) row = next[k] + __popc(peers & ((1u << lane) - 1u));
    __syncwarp();
    if (valid && lane == __ffs(peers) - 1) next[k] += __popc(peers);
    __syncwarp();
    if (valid) {
      item_row[i] = row;
      row_source[row] = static_cast<int32_t>(i / per_source);
    }
  }
}

// ---- Gather ---------------------------------------------------------------------------------

// One warp per row; kVecPath: 16-byte vectors (D a multiple of kVec<T>, pointers aligned).
template <typename T, bool kVecPath>
__global__ void __launch_bounds__(kThreads)
    GatherKernel(const T* in, const int32_t* src, T* out, int64_t rows, int64_t D) {
  const int lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int32_t s = src[r];
  T* o = out + r * D;
  if constexpr (kVecPath) {
    constexpr int V = kVec<T>;
    const int64_t vecs = D / V;
    if (s < 0) {
      for (int64_t v = lane; v < vecs; v += 32) Store16(o + v * V, make_uint4(0, 0, 0, 0));
    } else {
      const T* i = in + static_cast<int64_t>(s) * D;
      for (int64_t v = lane; v < vecs; v += 32) Store16(o + v * V, Load16(i + v * V));
    }
  } else {
    if (s < 0) {
      for (int64_t j = lane; j < D; j += 32) o[j] = FromFloat<T>(0.0f);
    } else {
      const T* i = in + static_cast<int64_t>(s) * D;
      for (int64_t j = lane; j < D; j += 32) o[j] = i[j];
    }
  }
}

// ---- Combine ----------------------------------------------------------------------------------

// One warp per token. kVecPath: 16-byte vectors of 8 values (D a multiple of 8, pointers
// aligned; an fp32 tensor moves 8 values as two vectors).
template <typename T>
__device__ __forceinline__ void Store8(T* p, const float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    Store16(p, Pack<T>(v));
  } else {
    const float a[4] = {v[0], v[1], v[2], v[3]}, b[4] = {v[4], v[5], v[6], v[7]};
    Store16(p, Pack<T>(a));
    Store16(p + 4, Pack<T>(b));
  }
}

template <typename TY, typename TO, bool kVecPath>
__global__ void __launch_bounds__(kThreads)
    CombineKernel(const TY* y, const int32_t* row, const float* w, TO* out, int64_t T, int K,
                  int64_t D, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  if (t >= T) return;
  TO* o = out + t * D;
  const int32_t* rows = row + t * K;
  const float* wt = w != nullptr ? w + t * K : nullptr;
  if constexpr (kVecPath) {
    for (int64_t c = lane * 8; c < D; c += 32 * 8) {
      float acc[8];
      if (accumulate) {
        Load8(o + c, acc);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      }
      for (int k = 0; k < K; ++k) {
        const float g = wt != nullptr ? wt[k] : 1.0f;
        float v[8];
        Load8(y + static_cast<int64_t>(rows[k]) * D + c, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += g * v[j];
      }
      Store8(o + c, acc);
    }
  } else {
    for (int64_t c = lane; c < D; c += 32) {
      float acc = accumulate ? ToFloat(o[c]) : 0.0f;
      for (int k = 0; k < K; ++k) {
        const float g = wt != nullptr ? wt[k] : 1.0f;
        acc += g * ToFloat(y[static_cast<int64_t>(rows[k]) * D + c]);
      }
      o[c] = FromFloat<TO>(acc);
    }
  }
}

// One warp per token; dw from per-lane partial sums (each lane's elements in order) and a fixed
// butterfly. kAmax: max |dy| as stored.
template <typename T, bool kVecPath, bool kAmax>
__global__ void __launch_bounds__(kThreads)
    CombineBackwardKernel(const T* dout, const T* y, const int32_t* row, const float* w, T* dy,
                          float* dw, int64_t T_, int K, int64_t D, float* amax) {
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (t < T_) {
    const T* g = dout + t * D;
    for (int k = 0; k < K; ++k) {
      const int64_t r = row[t * K + k];
      const float wk = w[t * K + k];
      const T* src = y + r * D;
      T* d = dy + r * D;
      float dot = 0.0f;
      if constexpr (kVecPath) {
        for (int64_t c = lane * 8; c < D; c += 32 * 8) {
          float gv[8], yv[8], dv[8];
          Load8(g + c, gv);
          Load8(src + c, yv);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            dot += gv[j] * yv[j];
            dv[j] = wk * gv[j];
            if constexpr (kAmax) m = max(m, internal::StoredAbsBits<T>(dv[j]));
          }
          Store8(d + c, dv);
        }
      } else {
        for (int64_t c = lane; c < D; c += 32) {
          const float gv = ToFloat(g[c]);
          dot += gv * ToFloat(src[c]);
          const float dv = wk * gv;
          if constexpr (kAmax) m = max(m, internal::StoredAbsBits<T>(dv));
          d[c] = FromFloat<T>(dv);
        }
      }
      dot = internal::WarpSum(dot);
      if (lane == 0) dw[t * K + k] = dot;
    }
  }
  if constexpr (kAmax) internal::BlockMaxToGlobal(m, amax);
}

template <typename TY, typename TO>
Status LaunchCombine(const void* y, const int32_t* row, const float* w, void* out, int64_t T,
                     int64_t K, int64_t D, bool accumulate, cudaStream_t stream) {
  const auto* yt = static_cast<const TY*>(y);
  auto* ot = static_cast<TO*>(out);
  const int64_t blocks = CeilDiv(T, kWarps);
  if (D % 8 == 0 && Aligned16(y) && Aligned16(out)) {
    CombineKernel<TY, TO, true>
        <<<blocks, kThreads, 0, stream>>>(yt, row, w, ot, T, static_cast<int>(K), D, accumulate);
  } else {
    CombineKernel<TY, TO, false>
        <<<blocks, kThreads, 0, stream>>>(yt, row, w, ot, T, static_cast<int>(K), D, accumulate);
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

inline int64_t Tiles(int64_t n) { return CeilDiv(n, kTileItems); }

}  // namespace

Status MoeRouterForward(const float* logits, const float* bias, int32_t* idx, float* weights,
                        float* lse, int64_t T, int64_t E, int64_t K, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && E >= 1 && E <= kMoeMaxExperts && K >= 1 && K <= E,
                    "MoeRouterForward: bad sizes");
  SPINDLE_CHECK_ARG(logits != nullptr && bias != nullptr && idx != nullptr && weights != nullptr,
                    "MoeRouterForward: null pointer");
  if (T == 0) return Status::Ok();
  const size_t smem = sizeof(float) * kWarps * E;
  RouterForwardKernel<<<CeilDiv(T, kWarps), kThreads, smem, stream>>>(
      logits, bias, idx, weights, lse, T, static_cast<int>(E), static_cast<int>(K));
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status MoeRouterBackward(const float* logits, const int32_t* idx, const float* dweights,
                         const float* lse, float zloss_scale, float* dlogits, int64_t T, int64_t E,
                         int64_t K, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && E >= 1 && E <= kMoeMaxExperts && K >= 1 && K <= E,
                    "MoeRouterBackward: bad sizes");
  SPINDLE_CHECK_ARG(zloss_scale == 0.0f || lse != nullptr,
                    "MoeRouterBackward: the z-loss needs lse");
  if (T == 0) return Status::Ok();
  RouterBackwardKernel<<<CeilDiv(T, kWarps), kThreads, 0, stream>>>(
      logits, idx, dweights, lse, zloss_scale, dlogits, T, static_cast<int>(E),
      static_cast<int>(K));
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t MoeGroupRowsWorkspaceBytes(int64_t n, int64_t E) {
  return static_cast<size_t>(std::max<int64_t>(Tiles(n), 1) * std::max<int64_t>(E, 1)) *
         sizeof(int32_t);
}

Status MoeGroupRows(const int32_t* key, int64_t n, int64_t per_source, int64_t E, int64_t align,
                    int64_t* counts, int64_t* offsets, int32_t* item_row, int32_t* row_source,
                    int64_t row_capacity, int64_t* counts_host, Workspace ws, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n >= 0 && n < (int64_t{1} << 31) && per_source >= 1 && E >= 1 &&
                        E <= kMoeMaxExperts && align >= 1,
                    "MoeGroupRows: bad sizes");
  SPINDLE_CHECK_ARG(row_capacity >= n + E * (align - 1) && row_capacity < (int64_t{1} << 31),
                    "MoeGroupRows: row_capacity below n + E * (align - 1)");
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= MoeGroupRowsWorkspaceBytes(n, E),
                    "MoeGroupRows: workspace too small");
  auto* tile_counts = static_cast<int32_t*>(ws.data);
  const int64_t tiles = Tiles(n);
  const int e32 = static_cast<int>(E);
  const size_t smem = sizeof(int32_t) * kWarps * E;
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(row_source, 0xFF, sizeof(int32_t) * row_capacity, stream));
  if (tiles > 0) {
    TileCountKernel<<<CeilDiv(tiles, kWarps), kThreads, smem, stream>>>(key, n, e32, tiles,
                                                                        tile_counts);
    SPINDLE_CUDA_CHECK_LAUNCH();
    TileScanKernel<<<e32, kThreads, 0, stream>>>(tile_counts, tiles, e32, counts);
    SPINDLE_CUDA_CHECK_LAUNCH();
  } else {
    SPINDLE_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int64_t) * E, stream));
  }
  OffsetsKernel<<<1, 32, 0, stream>>>(counts, e32, align, offsets);
  SPINDLE_CUDA_CHECK_LAUNCH();
  if (tiles > 0) {
    PlaceKernel<<<CeilDiv(tiles, kWarps), kThreads, smem, stream>>>(
        key, n, per_source, e32, tiles, tile_counts, offsets, item_row, row_source);
    SPINDLE_CUDA_CHECK_LAUNCH();
  }
  if (counts_host != nullptr) {
    SPINDLE_CUDA_CHECK(
        cudaMemcpyAsync(counts_host, counts, sizeof(int64_t) * E, cudaMemcpyDeviceToHost, stream));
  }
  return Status::Ok();
}

Status GatherRows(const void* in, const int32_t* src, void* out, int64_t rows, int64_t D,
                  DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D >= 0, "GatherRows: negative size");
  if (rows == 0 || D == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GatherRows", {
    const auto* it = static_cast<const scalar_t*>(in);
    auto* ot = static_cast<scalar_t*>(out);
    const int64_t blocks = CeilDiv(rows, kWarps);
    if (D % kVec<scalar_t> == 0 && Aligned16(in) && Aligned16(out)) {
      GatherKernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(it, src, ot, rows, D);
    } else {
      GatherKernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(it, src, ot, rows, D);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status MoeCombine(const void* y, DType y_dtype, const int32_t* row, const float* w, void* out,
                  DType out_dtype, int64_t T, int64_t K, int64_t D, bool accumulate,
                  cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && K >= 1 && D >= 0, "MoeCombine: bad sizes");
  if (T == 0 || D == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(y_dtype, "MoeCombine", {
    using y_t = scalar_t;
    SPINDLE_DISPATCH_FLOAT_BF16(out_dtype, "MoeCombine", {
      return LaunchCombine<y_t, scalar_t>(y, row, w, out, T, K, D, accumulate, stream);
    });
  });
  return Status::Ok();
}

Status MoeCombineBackward(const void* dout, const void* y, const int32_t* row, const float* w,
                          void* dy, float* dw, int64_t T, int64_t K, int64_t D, DType dtype,
                          cudaStream_t stream, float* dy_amax) {
  SPINDLE_CHECK_ARG(T >= 0 && K >= 1 && D >= 0, "MoeCombineBackward: bad sizes");
  SPINDLE_CHECK_ARG(w != nullptr && dw != nullptr, "MoeCombineBackward: w and dw are required");
  if (dy_amax != nullptr) SPINDLE_CUDA_CHECK(cudaMemsetAsync(dy_amax, 0, sizeof(float), stream));
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "MoeCombineBackward", {
    const auto* gt = static_cast<const scalar_t*>(dout);
    const auto* yt = static_cast<const scalar_t*>(y);
    auto* dt = static_cast<scalar_t*>(dy);
    const int k32 = static_cast<int>(K);
    const int64_t blocks = CeilDiv(T, kWarps);
    const bool vec = D % 8 == 0 && Aligned16(dout) && Aligned16(y) && Aligned16(dy);
    if (vec && dy_amax != nullptr) {
      CombineBackwardKernel<scalar_t, true, true>
          <<<blocks, kThreads, 0, stream>>>(gt, yt, row, w, dt, dw, T, k32, D, dy_amax);
    } else if (vec) {
      CombineBackwardKernel<scalar_t, true, false>
          <<<blocks, kThreads, 0, stream>>>(gt, yt, row, w, dt, dw, T, k32, D, nullptr);
    } else if (dy_amax != nullptr) {
      CombineBackwardKernel<scalar_t, false, true>
          <<<blocks, kThreads, 0, stream>>>(gt, yt, row, w, dt, dw, T, k32, D, dy_amax);
    } else {
      CombineBackwardKernel<scalar_t, false, false>
          <<<blocks, kThreads, 0, stream>>>(gt, yt, row, w, dt, dw, T, k32, D, nullptr);
    }
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
