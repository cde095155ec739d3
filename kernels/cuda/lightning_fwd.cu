// Lightning on CUDA: LightningForward (pass 1, the scan over blocks, the main sweep; see
// lightning_sweep.cu), and the CP carry correction with its backward (WMMA tiles).
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

// dst rows t < n_tokens (+)= w_t * src_t P (or P^T), w_t = scale * a^(t+1): the CP carry
// correction (src = q, dst = out, P) and the dq part of its backward (src = dout, dst = dq, P^T).
struct CarryArgs {
  const bf16* src;
  int64_t src_stride;
  bf16* dst;
  int64_t dst_stride;
  const float* P;
  const float* log_decay;
  float scale;
  int n_tokens;
};

template <int DH, bool kTransposeP>
__global__ void __launch_bounds__(kThreads) CarryKernel(CarryArgs a) {
  using Pt = Pitch<DH>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);
  bf16* pb = reinterpret_cast<bf16*>(smem + Pt::kRowsBytes);
  float* scratch =
      reinterpret_cast<float*>(smem + Pt::kRowsBytes + Pt::kStateBytes) + (threadIdx.x >> 5) * 256;
  float* w = reinterpret_cast<float*>(smem + Pt::kRowsBytes + Pt::kStateBytes + Pt::kScratchBytes);
  const int h = blockIdx.y, t0 = blockIdx.x * kChunk, warp = threadIdx.x >> 5;
  const int len = min(kChunk, a.n_tokens - t0);
  if (threadIdx.x < kChunk) {
    w[threadIdx.x] = a.scale * expf(static_cast<float>(t0 + threadIdx.x + 1) * a.log_decay[h]);
  }
  const float* ph = a.P + static_cast<int64_t>(h) * DH * DH;
  for (int idx = threadIdx.x; idx < DH * DH; idx += kThreads) {
    pb[(idx / DH) * Pt::kRow + idx % DH] = __float2bfloat16(ph[idx]);
  }
  LoadRows<DH>(xs, a.src + static_cast<int64_t>(t0) * a.src_stride + h * DH, a.src_stride, len);
  __syncthreads();
  const int orow = warp / 2, ocol0 = (warp % 2) * Pt::kOutTiles;
  bf16* dst = a.dst + static_cast<int64_t>(t0) * a.dst_stride + h * DH;
  for (int i = 0; i < Pt::kOutTiles; ++i) {
    Acc o;
    wmma::fill_fragment(o, 0.0f);
    const int col = (ocol0 + i) * 16;
    if constexpr (kTransposeP) {
      Mma<FragA, FragBT>(o, xs + orow * 16 * Pt::kRow, Pt::kRow, 16, pb + col * Pt::kRow,
                         Pt::kRow, 16, DH / 16);
    } else {
      Mma<FragA, FragB>(o, xs + orow * 16 * Pt::kRow, Pt::kRow, 16, pb + col, Pt::kRow,
                        16 * Pt::kRow, DH / 16);
    }
    ScaleAccRows(o, scratch, w, orow * 16);
    StoreAccBf16(o, scratch, dst + orow * 16 * a.dst_stride + col, a.dst_stride, orow * 16, len,
                 true);
  }
}

template <int DH, bool kTransposeP>
Status LaunchCarry(const CarryArgs& a, int H, cudaStream_t stream) {
  using Pt = Pitch<DH>;
  constexpr int kSmem = Pt::kRowsBytes + Pt::kStateBytes + Pt::kScratchBytes + kChunk * 4;
  SPINDLE_CUDA_CHECK(cudaFuncSetAttribute(CarryKernel<DH, kTransposeP>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CarryKernel<DH, kTransposeP>
      <<<dim3(CeilDiv(a.n_tokens, kChunk), H), kThreads, kSmem, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace
}  // namespace spindle::kernels::cuda::internal::lightning

namespace spindle::kernels::cuda {

using namespace internal::lightning;  // NOLINT: the private pieces of this op
using internal::bf16;

Status LightningForward(const void* q, const void* k, const void* v, const float* log_decay,
                        const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                        float scale, const LightningDims& dims, void* out, float* end_state,
                        DType dtype, Workspace ws, cudaStream_t stream,
                        const LightningConfig& config, float* saved) {
  SPINDLE_RETURN_IF_ERROR(CheckCommon(q, k, v, dims, dtype, "LightningForward"));
  const int64_t H = dims.H, Dh = dims.Dh;
  if (dims.T == 0 || n_segments == 0) return PassStateThrough(end_state, carry_in, H, Dh, stream);
  if (IsSmallHead(Dh))
    return SmallLightning(q, k, v, log_decay, cu_seqlens, n_segments, carry_in, scale, dims,
                          nullptr, nullptr, out, end_state, nullptr, nullptr, nullptr, nullptr,
                          /*backward=*/false, stream);
  const Plan plan = MakePlan(dims.T, H, Dh, config);
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= LightningWorkspaceBytes(dims, config),
                    "LightningForward: workspace too small");
  // The block states and decays go to `saved` when the backward will want them.
  float* U = saved ? saved : static_cast<float*>(ws.data);
  float* F = reinterpret_cast<float*>(saved ? reinterpret_cast<char*>(saved) + plan.state_bytes
                                            : static_cast<char*>(ws.data) + 2 * plan.state_bytes);

  SweepArgs sa = BaseSweepArgs(plan, dims, config, log_decay, cu_seqlens, n_segments, scale);
  sa.y = static_cast<const bf16*>(k), sa.y_stride = dims.qkv_stride;
  sa.z = static_cast<const bf16*>(v), sa.z_stride = dims.qkv_stride;
  sa.U = U, sa.F = F;
  SPINDLE_RETURN_IF_ERROR(LaunchSweep(static_cast<int>(Dh), false, true, sa, stream));

  ScanArgs sc = BaseScanArgs(plan, dims, F);
  sc.in = U, sc.out = U, sc.init = carry_in, sc.final_out = end_state;
  SPINDLE_RETURN_IF_ERROR(LaunchScan(sc, stream));

  sa.x = static_cast<const bf16*>(q), sa.x_stride = dims.qkv_stride;
  sa.out = static_cast<bf16*>(out), sa.out_stride = H * Dh;
  sa.start = U, sa.transpose_start = false;
  sa.U = nullptr, sa.F = nullptr;
  return LaunchSweep(static_cast<int>(Dh), false, false, sa, stream);
}

// CheckCommon refuses the other sizes for every function here, with kUnsupported.
bool LightningSupportsHeadDim(int64_t Dh) { return Dh == 64 || Dh == 128 || IsSmallHead(Dh); }

Status LightningCarryCorrection(const void* q, const float* log_decay, const float* P,
                                float scale, const LightningDims& dims, int64_t n_tokens,
                                void* out, DType dtype, cudaStream_t stream) {
  SPINDLE_RETURN_IF_ERROR(CheckCommon(q, q, out, dims, dtype, "LightningCarryCorrection"));
  SPINDLE_CHECK_ARG(n_tokens >= 0 && n_tokens <= dims.T, "LightningCarryCorrection: n_tokens");
  if (n_tokens == 0) return Status::Ok();
  if (IsSmallHead(dims.Dh))
    return SmallCarryCorrection(q, log_decay, P, scale, dims, n_tokens, out, stream);
  CarryArgs a{};
  a.src = static_cast<const bf16*>(q), a.src_stride = dims.qkv_stride;
  a.dst = static_cast<bf16*>(out), a.dst_stride = dims.H * dims.Dh;
  a.P = P, a.log_decay = log_decay, a.scale = scale, a.n_tokens = static_cast<int>(n_tokens);
  const int H = static_cast<int>(dims.H);
  return dims.Dh == 64 ? LaunchCarry<64, false>(a, H, stream) : LaunchCarry<128, false>(a, H, stream);
}

Status LightningCarryCorrectionBackward(const void* q, const float* log_decay, const float* P,
                                        float scale, const LightningDims& dims, int64_t n_tokens,
                                        const void* dout, void* dq, float* dP, DType dtype,
                                        Workspace ws, cudaStream_t stream,
                                        const LightningConfig& config) {
  SPINDLE_RETURN_IF_ERROR(
      CheckCommon(q, dout, dq, dims, dtype, "LightningCarryCorrectionBackward"));
  SPINDLE_CHECK_ARG(n_tokens >= 0 && n_tokens <= dims.T,
                    "LightningCarryCorrectionBackward: n_tokens");
  if (n_tokens == 0) return Status::Ok();
  if (IsSmallHead(dims.Dh))
    return SmallCarryCorrectionBackward(q, log_decay, P, scale, dims, n_tokens, dout, dq, dP,
                                        stream);
  const int64_t H = dims.H, Dh = dims.Dh;
  CarryArgs a{};
  a.src = static_cast<const bf16*>(dout), a.src_stride = H * Dh;
  a.dst = static_cast<bf16*>(dq), a.dst_stride = dims.qkv_stride;
  a.P = P, a.log_decay = log_decay, a.scale = scale, a.n_tokens = static_cast<int>(n_tokens);
  const Status dq_status = Dh == 64 ? LaunchCarry<64, true>(a, static_cast<int>(H), stream)
                                    : LaunchCarry<128, true>(a, static_cast<int>(H), stream);
  SPINDLE_RETURN_IF_ERROR(dq_status);
  // dP += sum_t scale a^(t+1) q_t^T dout_t: pass 1 in reverse over one segment, then a reverse
  // scan over blocks whose final carry is the sum.
  const LightningDims sub{n_tokens, H, Dh, dims.qkv_stride};
  const Plan plan = MakePlan(n_tokens, H, Dh, config);
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= LightningWorkspaceBytes(sub, config),
                    "LightningCarryCorrectionBackward: workspace too small");
  float* U = static_cast<float*>(ws.data);
  float* F = reinterpret_cast<float*>(static_cast<char*>(ws.data) + 2 * plan.state_bytes);
  SweepArgs sa = BaseSweepArgs(plan, sub, config, log_decay, nullptr, 1, scale);
  sa.y = static_cast<const bf16*>(q), sa.y_stride = dims.qkv_stride;
  sa.z = static_cast<const bf16*>(dout), sa.z_stride = H * Dh;
  sa.U = U, sa.F = F;
  SPINDLE_RETURN_IF_ERROR(LaunchSweep(static_cast<int>(Dh), true, true, sa, stream));
  ScanArgs sc = BaseScanArgs(plan, sub, F);
  sc.in = U, sc.out = U, sc.final_out = dP, sc.accumulate_final = true, sc.reverse = true;
  return LaunchScan(sc, stream);
}

}  // namespace spindle::kernels::cuda
