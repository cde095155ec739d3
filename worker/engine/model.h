// Model: the DESIGN.md section 2 hybrid decoder (Lightning and MLA layers, SwiGLU FFN, untied LM
// head) with an explicit forward and backward per layer, on the CPU kernels.
//
// ForwardBackward() runs one sequence (or this rank's share of it), adds the parameter gradients
// of `grad_scale * sum(token losses)` into params().flat_grad(), and returns the loss sum and the
// number of valid targets. The LM head and cross-entropy run over row blocks, so full-sequence
// fp32 logits never exist. A layer that recomputes (recompute.h) keeps only its input during the
// forward and re-runs its forward (all but its output, which is the next layer's input) just
// before its backward.
//
// Context parallelism: after SetCp() with a CP group of size > 1, the CpBatch forms run this
// rank's zigzag share of a sequence (cp/cp_layout.h); the Lightning and MLA cores then run in the
// mode chosen per layer type (cp/cp_attention.h) and everything else stays token-local. Losses
// and gradients are this rank's part: the caller sums them over the group (the trainer's
// all-reduce). Without SetCp (or cp = 1) the model never communicates.
// Numerics (numerics.h): exact fp32 by default; SetNumerics() makes the model emulate the CUDA
// engine's bf16 storage and, with an FP8 recipe, FP8 inputs to the blocks' linear layers.
// Mixture of experts (config.moe.experts > 0): the MoE layers' FFN is moe/moe_ffn.h's. With
// expert parallelism (Create's ep > 1) this rank holds the experts of EP rank ep_rank as shards
// of the stacked expert tensors, declared ahead of every other parameter so that their gradients
// are the flat range [0, ExpertGradEnd()), which the trainer reduces over the expert-data-parallel
// group only; SetExpertParallel() gives the EP group the tokens travel over. BeginStep() and
// FinishMoeStep() bracket a training step: the loads the router's choices put on each expert,
// summed over the world, move the balancing biases after the optimizer's update.
// Not thread-safe (kernels parallelise internally with OpenMP).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/engine/batch.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_attention.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/moe/moe_exchange.h"
#include "worker/engine/moe/moe_ffn.h"
#include "worker/engine/numerics.h"
#include "worker/engine/params.h"
#include "worker/engine/recompute.h"
#include "worker/engine/tensor.h"

namespace spindle {

struct LossStats {
  double loss_sum = 0.0;  // sum of per-token losses over valid targets
  int64_t n_valid = 0;
};

// The CP group of this rank and the decided mode per layer type (never kAuto). The hybrid modes
// also need this rank's Ulysses group and ring communicators (cp_groups.h; CpBatch::group says
// which tokens); MLA's Ring and hybrid modes pass `mla_payload` around the ring (MlaRingPayloadFor
// of the heads a rank computes, which the plan names).
struct CpContext {
  Communicator* comm = nullptr;  // not owned; size() == cp
  CpMode lightning_mode = CpMode::kAllGather;
  CpMode mla_mode = CpMode::kAllGather;
  Communicator* ulysses = nullptr;  // hybrid modes: size u, rank CpGroups::Member(cp rank)
  Communicator* ring = nullptr;     // hybrid modes: size r, rank CpGroups::Group(cp rank)
  MlaRingPayload mla_payload = MlaRingPayload::kLatent;
};

// Called during the backward with an offset into the flat gradient buffer: every gradient in
// [flat_begin, numel) is final for this call (the head first, then layer by layer down to the
// embedding at 0), so it can be all-reduced while the backward goes on.
using GradReadyFn = std::function<void(int64_t flat_begin)>;

// log a_h of every head of Lightning layer `layer` (DESIGN.md section 2):
// -2^(-8(h+1)/H) * (1 - layer/n_layers + 1e-5).
std::vector<float> LightningLogDecays(const ModelConfig& c, int64_t layer);

class Model {
 public:
  // host_grads false: the gradient buffer comes with its first use (see ParamSet::Allocate), for
  // the host copy of a device model.
  // ep > 1 (MoE models): this rank holds the experts of EP rank ep_rank of ep.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelConfig& config, uint64_t seed,
                                                       bool host_grads = true, int64_t ep = 1,
                                                       int64_t ep_rank = 0);
  ~Model();

  const ModelConfig& config() const { return config_; }
  ParamSet& params() { return params_; }

  LossStats ForwardBackward(const Batch& batch, float grad_scale, Recompute recompute);
  // Loss only (evaluation); no gradients, no saved activations beyond one layer.
  LossStats Forward(const Batch& batch);

  // The number formats of every later pass (the default: exact fp32); under FP8 the
  // Fp8LinearWeights and, per expert, the MoE layers' expert weights run as FP8 GEMM weights.
  void SetNumerics(const Numerics& numerics);
  // The parameters the FP8 recipe runs as FP8 GEMM weights (numerics.h): every layer's
  // projections but MLA's per-head ones (q or q_b, kv_b). The CUDA engine's fp8 uses the same.
  std::vector<int> Fp8LinearWeights() const;
  const Numerics& numerics() const { return numerics_.numerics(); }
  // train.z_loss: the LM head's objective adds z_loss * logsumexp(logits)^2 per valid token
  // (kernels/cpu/ops.h CrossEntropy); 0 (the default) leaves the cross-entropy alone.
  void SetZLoss(float z_loss) { z_loss_ = z_loss; }

  // MoE: the EP group (size ep of Create, this rank's position ep_rank; not owned). Needed before
  // any pass when ep > 1.
  absl::Status SetExpertParallel(Communicator* ep);
  int64_t ep() const { return ep_; }
  // The end of the expert shards' range of the flat buffers: 0 for a dense model.
  int64_t ExpertGradEnd() const { return expert_end_; }
  // A training step begins: the MoE statistics restart, and the z-loss is spread over the step's
  // `tokens` (over the world).
  void BeginStep(double tokens);
  // After the optimizer's update: the loads summed over `world` (null: this rank's alone) move the
  // balancing biases (DESIGN.md section 2); returns the step's MoE fields for the step event
  // ("moe": per MoE layer its index, max/mean load, bias range and mean lse(z)^2). Empty for a dense
  // model. Errors are the communicator's.
  absl::StatusOr<nlohmann::json> FinishMoeStep(Communicator* world);
  // This rank's statistics of the step so far, by layer index (empty before BeginStep).
  const std::vector<MoeLayerStats>& moe_stats() const { return moe_stats_; }

  // Uses `cp` for the CpBatch forms (the communicator must outlive the model's use of it).
  void SetCp(const CpContext& cp) { cp_ = cp; }
  // This rank's share of a sequence. Errors are the communicator's (a peer failed).
  absl::StatusOr<LossStats> ForwardBackward(const CpBatch& batch, float grad_scale,
                                            Recompute recompute,
                                            const GradReadyFn& on_grad_ready = nullptr);
  absl::StatusOr<LossStats> Forward(const CpBatch& batch);

  struct Layer;  // per-layer parameter indices and decays (model.cc)
  struct Cache;  // one layer's saved activations (model.cc)
  struct Work;   // gradient scratch shared by all layers (model.cc)
  class Passes;  // a step's LayerPasses on this model (model.cc)

 private:
  explicit Model(const ModelConfig& config);
  void Build();
  absl::StatusOr<LossStats> Run(const Batch& b, const CpBatch* cp, float grad_scale,
                                Recompute recompute, const GradReadyFn& on_grad_ready);
  absl::StatusOr<LossStats> RunForward(const Batch& b, const CpBatch* cp);
  // FailedPrecondition when the communicators of SetCp do not fit the batch's layout and modes.
  absl::Status CheckCp(const CpBatch& b) const;
  // FailedPrecondition when the experts are sharded and SetExpertParallel gave no group.
  absl::Status CheckExpertParallel() const;
  LossStats HeadAndLoss(const Batch& b, const float* x, float grad_scale, float* dx);

  ModelConfig config_;
  ParamSet params_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<std::unique_ptr<Layer>> layers_;
  // One per layer that keeps its activations, one shared by the layers that recompute.
  std::vector<std::unique_ptr<Cache>> caches_;
  std::unique_ptr<Work> work_;
  // The input of every layer, then the final hidden state: [n_layers + 1][T, d].
  std::vector<Tensor> layer_inputs_;
  Tensor hf_, rstd_f_, dhf_, logits_, dx_;
  CpContext cp_;
  CpScratch cp_scratch_;
  // Mixture of experts.
  int64_t ep_ = 1, ep_rank_ = 0, expert_end_ = 0;
  Communicator* ep_comm_ = nullptr;
  HostMoeRows moe_rows_;
  std::vector<MoeLayerStats> moe_stats_;  // by layer index
  float zloss_scale_ = 0.0f;
  NumericsEmulator numerics_;
  float z_loss_ = 0.0f;
};

}  // namespace spindle
