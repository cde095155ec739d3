// The CUDA model's mixture-of-experts FFN family (DESIGN.md section 2; the CPU model's
// moe/moe_ffn.h, with the same roundings): each MoE layer's saved state (MoeDevCache), the scratch
// the MoE layers share (MoeDevWork), the EP group, the step's router statistics, and the forward
// and backward passes (cuda_moe_ffn.cc).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kernels/cuda/moe.h"
#include "worker/engine/cuda/cuda_layer_context.h"
#include "worker/engine/moe/moe_exchange.h"

namespace spindle {
namespace cuda_model_detail {

// The MoE FFN's forward state of one layer, kept for its backward: the router's input in fp32,
// logits, choices, weights and lse; the exchange's plan (host) and its row maps on the device;
// the experts' rows (inputs, SwiGLU parts, outputs), the outputs back in send order (ep > 1), and
// the shared expert's hidden layer.
struct MoeDevCache {
  DevBuf h32, logits, idx, weights, lse;
  std::vector<int32_t> idx_host;
  MoeDispatchPlan plan;
  DevBuf expert_src, pair_row, send_token, recv_expert_row;  // the plan's maps, int32
  DevBuf xe, g, u, a, ye, returned, sg, su, sa;
  // fp8: the experts' inputs and SwiGLU outputs as FP8 codes, both layouts (the forward's GEMMs
  // read the codes, the weight gradients their transposes); no bf16 xe (at ep = 1) nor a.
  Fp8Act q_xe, q_a;
  // Blockwise fp8: the experts' rows by (expert, source rank) (MoeExpertSegments), their bands
  // (kernels/cuda/moe.h's grouped layout, which every FP8 rows tensor of the layer shares) on the
  // host and on the device.
  std::vector<int64_t> segments;
  kc::Fp8RowBands row_bands;
  DevBuf bands;
};

// The MoE FFN's scratch, shared by the layers: the exchange's send and receive rows, the gradients
// of the experts' rows and of the shared expert, the weights' and logits' gradients, and an fp32
// accumulator of the input gradient.
struct MoeDevWork {
  DevBuf send, recv, y, dye, da, dg, du, dxe, dw, dlogits, acc, sda, sdg, sdu;
  DevBuf group_counts, group_offsets, group_ws;  // MoeGroupRows's (ep = 1: grouped on the device)
  DevBuf lse_sq_ws;                              // SquaredNorm's workspace
  Fp8Act q_dye, q_dg, q_du;                      // fp8: the experts' output gradients (E5M2)
};

// The MoE FFN of every MoE layer. The experts run as grouped GEMMs, the row gathers of the token
// exchange (moe/moe_exchange.h) on the context's stream, over the EP group (null: ep = 1; a host
// communicator's through `ep_staged`).
struct CudaMoeFfn {
  explicit CudaMoeFfn(LayerContext& cx) : cx(cx), c(cx.c), B(cx.B) {}
  ~CudaMoeFfn();
  CudaMoeFfn(const CudaMoeFfn&) = delete;
  CudaMoeFfn& operator=(const CudaMoeFfn&) = delete;

  // From A.h2, y (nullable) = MoE(h2), its state in M; `stats` (nullable) takes the choices.
  // transposes false (blockwise fp8: the first forward of a layer that recomputes, whose backward
  // runs the forward again): no transposed codes, which only the backward reads.
  absl::Status Forward(const LayerIdx& L, LayerActs& A, MoeDevCache& M, void* y,
                       MoeLayerStats* stats, bool transposes = true);
  // From dy, the gradient of y: the context's W.dh (overwritten) and the parameter gradients.
  absl::Status Backward(const LayerIdx& L, LayerActs& A, MoeDevCache& M, const void* dy);
  // The step's statistics reset, with its z-loss scale (CudaModel::BeginStep).
  void BeginStep(double tokens);
  // The slots so far into moe_stats (syncs the stream) and none left.
  absl::Status DrainLseSq();
  // The shared scratch back to the allocator.
  void Release();
  // The grouped GEMMs go: the next forward creates them with cx.expert_gemm (the stream idle).
  void ResetGroupedGemm() { moe_gemm.reset(); }

  // A training step's statistics by layer and its z-loss scale; moe_counting: a training pass,
  // whose first forwards count the choices.
  std::vector<MoeLayerStats> moe_stats;
  float zloss_scale = 0.0f;
  bool moe_counting = false;
  Communicator* ep = nullptr;
  std::unique_ptr<Communicator> ep_staged;

 private:
  // fp8: the experts' backward from W.dye (the combine's backward, its amax in W.q_dye at ep = 1)
  // to W.dxe and the experts' weight gradients, on their FP8 codes.
  absl::Status ExpertsBackwardFp8(const LayerIdx& L, MoeDevCache& M);
  // Blockwise fp8: M's segments and bands from M.plan, the bands uploaded.
  absl::Status PlanBlocks(MoeDevCache& M);
  // Blockwise fp8: the experts' rows `x` [R, cols] (gathered through src, or src null: x itself)
  // quantized into q (format f) in the grouped layout of M's bands; codes_t too if `transposes`.
  absl::Status QuantizeRows(MoeDevCache& M, Fp8Act& q, KDType f, const void* x, const int32_t* src,
                            int64_t cols, bool transposes);
  // The grouped GEMMs' operands of q: its row codes (forward, input gradient) and its transposed
  // codes (weight gradient), tensorwise or (blockwise) with their block scales.
  kc::Fp8Operand RowsOperand(const Fp8Act& q) const;
  kc::Fp8Operand ColumnsOperand(const Fp8Act& q) const;
  // The experts' weight gradient dB += dC^T A on transposed codes (blockwise: per segment of M).
  absl::Status WeightGrad(const MoeDevCache& M, const Fp8Act& dC, const Fp8Act& A, float* dB,
                          int64_t N, int64_t K);
  // ep = 1: groups the router's choices M.idx by expert on the device (M.pair_row, expert_src),
  // enqueues `overlap` (the shared expert), then waits only for the group sizes and fills
  // M.plan's counts and offsets (its row maps stay on the device).
  absl::Status GroupOnDevice(MoeDevCache& M, int64_t align, const std::function<void()>& overlap);
  // A counting forward's sum of lse^2 into the step's next slot (moe_lse_sq).
  absl::Status CountLseSq(const LayerIdx& L, const float* lse, int64_t T);

  LayerContext& cx;
  const ModelConfig& c;
  const BatchDev& B;
  MoeDevWork W;
  std::unique_ptr<kc::GroupedGemm> moe_gemm;
  std::unique_ptr<MoeRows> moe_rows;
  // ep = 1: the group sizes of MoeGroupRows (pinned, kMoeMaxExperts entries) and the event after
  // their copy, which the host waits on while the shared expert runs.
  int64_t* moe_counts_host = nullptr;
  cudaEvent_t moe_counts_ready = nullptr;
  // The step's router statistics on the device: each counting forward's sum of lse^2 in a slot
  // of moe_lse_sq (doubles), its layer in moe_lse_sq_layer; read by DrainLseSq.
  DevBuf moe_lse_sq;
  std::vector<int> moe_lse_sq_layer;
};

}  // namespace cuda_model_detail
}  // namespace spindle
