// Lightning on CUDA: LightningBackward. Pass 1 forward (block end states) and reverse (block state
// gradients), both scans over blocks, then the main sweeps (lightning_sweep.cu): dq forward from
// S^T, and dk with dv in one fused reverse sweep from dS (or two, dS^T and dS, when the config
// asks for separate sweeps).
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda {

using namespace internal::lightning;  // NOLINT: the private pieces of this op
using internal::bf16;

Status LightningBackward(const void* q, const void* k, const void* v, const float* log_decay,
                         const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                         float scale, const LightningDims& dims, const void* dout,
                         const float* d_end_state, void* dq, void* dk, void* dv,
                         float* d_carry_in, DType dtype, Workspace ws, cudaStream_t stream,
                         const LightningConfig& config, const float* saved) {
  SPINDLE_RETURN_IF_ERROR(CheckCommon(q, k, v, dims, dtype, "LightningBackward"));
  SPINDLE_RETURN_IF_ERROR(CheckCommon(dq, dk, dv, dims, dtype, "LightningBackward"));
  const int64_t H = dims.H, Dh = dims.Dh;
  if (dims.T == 0 || n_segments == 0)
    return PassStateThrough(d_carry_in, d_end_state, H, Dh, stream);
  if (IsSmallHead(Dh))
    return SmallLightning(q, k, v, log_decay, cu_seqlens, n_segments, carry_in, scale, dims,
                          dout, d_end_state, nullptr, nullptr, dq, dk, dv, d_carry_in,
                          /*backward=*/true, stream);
  const Plan plan = MakePlan(dims.T, H, Dh, config);
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= LightningWorkspaceBytes(dims, config),
                    "LightningBackward: workspace too small");
  // With `saved`, the forward's block start states and decays (read only below).
  float* U = saved ? const_cast<float*>(saved) : static_cast<float*>(ws.data);
  float* dU = reinterpret_cast<float*>(static_cast<char*>(ws.data) + plan.state_bytes);
  float* F = saved ? reinterpret_cast<float*>(reinterpret_cast<char*>(U) + plan.state_bytes)
                   : reinterpret_cast<float*>(static_cast<char*>(ws.data) + 2 * plan.state_bytes);

  SweepArgs sa = BaseSweepArgs(plan, dims, config, log_decay, cu_seqlens, n_segments, scale);
  const int64_t qs = dims.qkv_stride, os = H * Dh;
  const auto* bq = static_cast<const bf16*>(q);
  const auto* bk = static_cast<const bf16*>(k);
  const auto* bv = static_cast<const bf16*>(v);
  const auto* bo = static_cast<const bf16*>(dout);
  const int dh = static_cast<int>(Dh);
  // Pass 1: block end states S (Y=k, Z=v; unless saved) and block state gradients (Y=q, Z=dout,
  // reversed).
  if (!saved) {
    sa.y = bk, sa.y_stride = qs, sa.z = bv, sa.z_stride = qs, sa.U = U, sa.F = F;
    SPINDLE_RETURN_IF_ERROR(LaunchSweep(dh, false, true, sa, stream));
  }
  sa.y = bq, sa.y_stride = qs, sa.z = bo, sa.z_stride = os, sa.U = dU, sa.F = nullptr;
  SPINDLE_RETURN_IF_ERROR(LaunchSweep(dh, true, true, sa, stream));

  ScanArgs sc = BaseScanArgs(plan, dims, F);
  if (!saved) {
    sc.in = U, sc.out = U, sc.init = carry_in;
    SPINDLE_RETURN_IF_ERROR(LaunchScan(sc, stream));
  }
  sc.in = dU, sc.out = dU, sc.init = d_end_state, sc.final_out = d_carry_in, sc.reverse = true;
  SPINDLE_RETURN_IF_ERROR(LaunchScan(sc, stream));

  sa.U = nullptr, sa.F = nullptr, sa.out_stride = qs;
  // dq = diag(qw) dO S^T + mask(dO V^T) K.
  sa.x = bo, sa.x_stride = os, sa.y = bv, sa.y_stride = qs, sa.z = bk, sa.z_stride = qs;
  sa.start = U, sa.transpose_start = true, sa.out = static_cast<bf16*>(dq);
  SPINDLE_RETURN_IF_ERROR(LaunchSweep(dh, false, false, sa, stream));
  if (!config.separate_dk_dv) {
    DkDvArgs da{};
    da.q = bq, da.k = bk, da.v = bv, da.dout = bo, da.qkv_stride = qs, da.dout_stride = os;
    da.dk = static_cast<bf16*>(dk), da.dv = static_cast<bf16*>(dv), da.dS = dU;
    da.log_decay = sa.log_decay, da.cu = sa.cu, da.n_seg = sa.n_seg;
    da.T = sa.T, da.H = sa.H, da.scale = sa.scale;
    da.chunks_per_block = sa.chunks_per_block, da.n_chunks = sa.n_chunks, da.G = sa.G;
    da.transposed_dk = sa.transposed_state;
    return LaunchDkDv(dh, da, stream);
  }
  // dk = diag(kw) V dS^T + mask(dO V^T)^T Q.
  sa.x = bv, sa.x_stride = qs, sa.y = bo, sa.y_stride = os, sa.z = bq, sa.z_stride = qs;
  sa.start = dU, sa.transpose_start = true, sa.out = static_cast<bf16*>(dk);
  SPINDLE_RETURN_IF_ERROR(LaunchSweep(dh, true, false, sa, stream));
  // dv = diag(kw) K dS + mask(Q K^T)^T dO.
  sa.x = bk, sa.x_stride = qs, sa.y = bq, sa.y_stride = qs, sa.z = bo, sa.z_stride = os;
  sa.start = dU, sa.transpose_start = false, sa.out = static_cast<bf16*>(dv);
  return LaunchSweep(dh, true, false, sa, stream);
}

}  // namespace spindle::kernels::cuda
