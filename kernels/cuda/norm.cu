// RMSNorm (plain, fused residual add, per-head q/k norm fused with RoPE) and group RMSNorm +
// sigmoid gate, forward and backward, on CUDA.
//
// One warp per row. Weight gradients are reduced without atomics: each warp adds its rows into a
// private shared-memory row of partial sums, each block writes the sum of its warps to the
// workspace, and a second kernel adds the blocks' rows into dw in block order. The grid depends
// on (rows, D) only, so results are bitwise reproducible.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::bf16;
using internal::CeilDiv;
using internal::FromFloat;
using internal::ToFloat;
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

// dw0[j] += sum_b ws[b, j] for j < split, dw1[j - split] += ... for j >= split.
__global__ void ReducePartialsKernel(const float* ws, int64_t blocks, int64_t D, int64_t split,
                                     float* dw0, float* dw1) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= D) return;
  float s = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) s += ws[b * D + j];
  if (j < split) {
    dw0[j] += s;
  } else {
    dw1[j - split] += s;
  }
}

Status ReducePartials(const float* ws, int64_t blocks, int64_t D, int64_t split, float* dw0,
                      float* dw1, cudaStream_t stream) {
  ReducePartialsKernel<<<CeilDiv(D, 128), 128, 0, stream>>>(ws, blocks, D, split, dw0, dw1);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <typename T, bool kResidual>
__global__ void RmsNormFwdKernel(const T* x, const T* res, T* h, const T* w, T* y, float* rstd,
                                 int64_t rows, int64_t D, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kFwdWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* xr = x + row * D;
  float ss = 0.0f;
  for (int64_t j = lane; j < D; j += 32) {
    float v = ToFloat(xr[j]);
    if constexpr (kResidual) {
      const T hv = FromFloat<T>(v + ToFloat(res[row * D + j]));
      h[row * D + j] = hv;
      v = ToFloat(hv);
    }
    ss += v * v;
  }
  ss = WarpSum(ss);
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
  const T* src = kResidual ? h + row * D : xr;
  __syncwarp();
  for (int64_t j = lane; j < D; j += 32) {
    y[row * D + j] = FromFloat<T>(ToFloat(src[j]) * r * ToFloat(w[j]));
  }
  if (lane == 0) rstd[row] = r;
}

template <typename T>
__global__ void RmsNormBwdKernel(const T* x, const T* w, const float* rstd, const T* dy,
                                 const T* dres, T* dx, int64_t rows, int64_t D, float* ws) {
  extern __shared__ float part[];  // [warps, D]
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
    }
  }
  StoreBlockPartial(part, warps, D, ws);
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

// Partial weight gradients: part row [2 * Dh], q's columns then k's.
template <typename T>
__global__ void QkNormRopeBwdKernel(const T* in, const T* wq, const T* wk, const float* rstd_q,
                                    const float* rstd_k, const int32_t* pos, const T* dout,
                                    T* din, int64_t T_, int64_t H, int64_t Dh, float theta,
                                    int n_blocks, float* ws) {
  extern __shared__ float part[];  // [warps, 2 * Dh]
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
      for (int64_t j = lane; j < Dh; j += 32) din[off + j] = dout[off + j];
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
        din[off + j] = FromFloat<T>(rs * (ToFloat(w[j]) * ulo[i] - xlo[i] * c));
        din[off + j + half] = FromFloat<T>(rs * (ToFloat(w[j + half]) * uhi[i] - xhi[i] * c));
        pw[j] += ulo[i] * xlo[i] * rs;
        pw[j + half] += uhi[i] * xhi[i] * rs;
      }
    }
  }
  StoreBlockPartial(part, warps, D2, ws);
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
  float ss = 0.0f;
  for (int64_t j = lane; j < Dh; j += 32) {
    const float v = ToFloat(o[off + j]);
    ss += v * v;
  }
  ss = WarpSum(ss);
  const float rs = rsqrtf(ss / static_cast<float>(Dh) + eps);
  for (int64_t j = lane; j < Dh; j += 32) {
    const float sig = internal::Sigmoid(ToFloat(gate[off + j]));
    y[off + j] = FromFloat<T>(ToFloat(o[off + j]) * rs * ToFloat(w[h * Dh + j]) * sig);
  }
  if (lane == 0) rstd[r] = rs;
}

// One warp per token (all heads), so a warp's partial row covers all H * Dh weights.
template <typename T>
__global__ void GroupNormGateBwdKernel(const T* o, const T* w, const T* gate, const float* rstd,
                                       const T* dy, T* do_, T* dgate, int64_t T_, int64_t H,
                                       int64_t Dh, float* ws) {
  extern __shared__ float part[];  // [warps, H * Dh]
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
        dgate[off + j] = FromFloat<T>(dn * n * (1.0f - sig));
        do_[off + j] = FromFloat<T>(rs * dn - c * ov);
      }
    }
  }
  StoreBlockPartial(part, warps, C, ws);
}

}  // namespace

Status RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                      float eps, DType dtype, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0, "RmsNormForward: bad sizes");
  if (rows == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormForward", {
    RmsNormFwdKernel<scalar_t, false><<<CeilDiv(rows, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
        static_cast<const scalar_t*>(x), nullptr, nullptr, static_cast<const scalar_t*>(w),
        static_cast<scalar_t*>(y), rstd, rows, D, eps);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status RmsNormResidualForward(const void* x, const void* residual, void* h, const void* w, void* y,
                              float* rstd, int64_t rows, int64_t D, float eps, DType dtype,
                              cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0, "RmsNormResidualForward: bad sizes");
  if (rows == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormResidualForward", {
    RmsNormFwdKernel<scalar_t, true><<<CeilDiv(rows, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
        static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(residual),
        static_cast<scalar_t*>(h), static_cast<const scalar_t*>(w), static_cast<scalar_t*>(y),
        rstd, rows, D, eps);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t RmsNormBackwardWorkspaceBytes(int64_t rows, int64_t D) {
  return static_cast<size_t>(PlanBwd(rows, D).blocks * D * 4);
}

Status RmsNormBackward(const void* x, const void* w, const float* rstd, const void* dy,
                       const void* dresidual, void* dx, float* dw, int64_t rows, int64_t D,
                       DType dtype, Workspace ws, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && D <= kMaxRowWidth, "RmsNormBackward: bad sizes");
  if (rows == 0) return Status::Ok();
  const BwdPlan plan = PlanBwd(rows, D);
  SPINDLE_CHECK_ARG(ws.bytes >= RmsNormBackwardWorkspaceBytes(rows, D) && ws.data != nullptr,
                    "RmsNormBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormBackward", {
    RmsNormBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * D * 4, stream>>>(
        static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(w), rstd,
        static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(dresidual),
        static_cast<scalar_t*>(dx), rows, D, part);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, plan.blocks, D, D, dw, dw, stream);
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
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "QkNormRopeForward", {
    QkNormRopeFwdKernel<scalar_t><<<CeilDiv(rows, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
        static_cast<const scalar_t*>(qkv_in), static_cast<const scalar_t*>(w_q),
        static_cast<const scalar_t*>(w_k), pos, static_cast<scalar_t*>(qkv_out), rstd_q, rstd_k,
        T, H, Dh, eps, theta, n_blocks);
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
                          Workspace ws, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && Dh % 2 == 0 && Dh <= 64 * kMaxPairsPerLane,
                    "QkNormRopeBackward: Dh must be even and <= 512");
  if (T == 0) return Status::Ok();
  const int n_blocks = copy_v ? 3 : 2;
  // The plan uses 3 blocks per token either way, so the workspace size does not depend on copy_v.
  const BwdPlan plan = PlanBwd(T * H * 3, 2 * Dh);
  SPINDLE_CHECK_ARG(ws.bytes >= QkNormRopeBackwardWorkspaceBytes(T, H, Dh) && ws.data != nullptr,
                    "QkNormRopeBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "QkNormRopeBackward", {
    QkNormRopeBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * 2 * Dh * 4,
                                    stream>>>(
        static_cast<const scalar_t*>(qkv_in), static_cast<const scalar_t*>(w_q),
        static_cast<const scalar_t*>(w_k), rstd_q, rstd_k, pos,
        static_cast<const scalar_t*>(dqkv_out), static_cast<scalar_t*>(dqkv_in), T, H, Dh, theta,
        n_blocks, part);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, plan.blocks, 2 * Dh, Dh, dw_q, dw_k, stream);
}

Status GroupNormGateForward(const void* o, const void* w, const void* gate, void* y, float* rstd,
                            int64_t T, int64_t H, int64_t Dh, float eps, DType dtype,
                            cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0, "GroupNormGateForward: bad sizes");
  if (T == 0) return Status::Ok();
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateForward", {
    GroupNormGateFwdKernel<scalar_t><<<CeilDiv(T * H, kFwdWarps), 32 * kFwdWarps, 0, stream>>>(
        static_cast<const scalar_t*>(o), static_cast<const scalar_t*>(w),
        static_cast<const scalar_t*>(gate), static_cast<scalar_t*>(y), rstd, T, H, Dh, eps);
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
                             cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && H * Dh <= kMaxRowWidth,
                    "GroupNormGateBackward: bad sizes");
  if (T == 0) return Status::Ok();
  const BwdPlan plan = PlanBwd(T, H * Dh);
  SPINDLE_CHECK_ARG(ws.bytes >= GroupNormGateBackwardWorkspaceBytes(T, H, Dh) && ws.data != nullptr,
                    "GroupNormGateBackward: workspace too small");
  float* part = static_cast<float*>(ws.data);
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateBackward", {
    GroupNormGateBwdKernel<scalar_t><<<plan.blocks, 32 * plan.warps, plan.warps * H * Dh * 4,
                                       stream>>>(
        static_cast<const scalar_t*>(o), static_cast<const scalar_t*>(w),
        static_cast<const scalar_t*>(gate), rstd, static_cast<const scalar_t*>(dy),
        static_cast<scalar_t*>(do_), static_cast<scalar_t*>(dgate), T, H, Dh, part);
  });
  SPINDLE_CUDA_CHECK_LAUNCH();
  return ReducePartials(part, plan.blocks, H * Dh, H * Dh, dw, dw, stream);
}

}  // namespace spindle::kernels::cuda
