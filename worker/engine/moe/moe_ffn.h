// The CPU model's mixture-of-experts FFN (DESIGN.md section 2), forward and backward:
//   z = Wr h (fp32), s = sigmoid(z), the top-k of s + b chosen, g = s / sum over the chosen,
//   y = sum_k g_k Expert_{e_k}(h) + Shared(h), each expert and the shared one a SwiGLU.
// Dropless: every (token, choice) pair is computed. Under expert parallelism (ep > 1) this rank
// holds experts [ep_rank * E / ep, ...) as the shards of the stacked expert tensors, and the
// pairs travel to their experts' ranks and back through moe_exchange.h (the same plan in the
// backward). The router z-loss adds zloss_scale * lse(z)^2 per token to what is differentiated.
//
// Numerics: the router runs in fp32 on the fp32 master weights; with bf16 storage the experts'
// and the shared expert's activations are rounded where the dense FFN's are. Under FP8 the
// experts' GEMMs multiply FP8 inputs (numerics.h: one scale per expert for the weights, one over
// the rank's expert rows or 1 x 128 blocks for the activations and gradients), as the CUDA
// engine's grouped FP8 GEMMs do; the shared expert stays bf16, as on the GPU.
// Not thread-safe; the caches belong to one model.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/moe/moe_exchange.h"
#include "worker/engine/numerics.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

// A MoE layer's parameter indices: the router weight [E, d] and balancing bias [E] (whole on
// every rank), this rank's experts w1, w3 [El, F, d] and w2 [El, d, F], the shared expert's s1,
// s3 [S, d] and s2 [d, S] (-1 without one).
struct MoeLayerParams {
  int router = -1, bias = -1, w1 = -1, w2 = -1, w3 = -1, s1 = -1, s2 = -1, s3 = -1;
};

// Declares a MoE layer's parameters (layer index i) in `P`, with the experts of EP rank ep_rank
// of ep; the expert tensors first when `experts` is true, the rest when it is false (the model
// declares every layer's experts ahead of its other parameters, so that the expert gradients,
// reduced over another group, form one range of the flat buffer).
void DeclareMoeParams(const ModelConfig& c, int64_t i, int64_t ep, int64_t ep_rank, bool experts,
                      ParamSet& P, MoeLayerParams* L);

// One layer's saved activations (the forward's, for the backward).
struct MoeCache {
  Tensor logits, weights, lse;  // [T, E], [T, K], [T]
  std::vector<int32_t> idx;     // [T * K]
  MoeDispatchPlan plan;
  Tensor xe, g, u, a, ye;  // the experts' rows: inputs, SwiGLU parts, outputs
  // The experts' rows by (local expert, source rank): row offsets, first 0, last R; the segments
  // within which the blockwise recipe forms its column blocks (numerics.h).
  std::vector<int64_t> segments;
  Fp8Copy q_xe, q_a;        // FP8: the inputs' and SwiGLU output's values
  GemmOperand xe_op, a_op;  // the GEMMs' operands for xe and a (into q_xe / q_a under FP8)
  Tensor returned;          // ep > 1: the outputs back in send order [T * K, d]
  Tensor sg, su, sa;        // the shared expert [T, S]
};

// Scratch shared by the layers: the exchange's send and receive rows (forward and backward) and
// the gradients.
struct MoeWork {
  Tensor dsend, drecv, dye, da, dg, du, dxe, dw, dlogits, sda, sdg, sdu;
  Fp8Copy q_dye, q_dg, q_du;  // FP8: the experts' output gradients
};

// What a step's MoE layers did, for the balancing bias and the metrics: the (token, choice) pairs
// each expert received from this rank (E entries) and the sum of lse(z)^2 over its tokens.
struct MoeLayerStats {
  std::vector<double> load;
  double zloss_sum = 0.0;
  int64_t tokens = 0;
};

// After a step's update, the aux-loss-free balancing (DESIGN.md section 2) of every MoE layer of
// `c`: the step's loads (stats, by layer index, this rank's) summed over `world` (null: alone),
// then b_e += bias_rate * sign(mean - load_e) on `bias(layer)` (E host floats, the master), so that
// every rank moves its biases alike. Returns the step event's fields ({"moe": {"layers",
// "load_max_over_mean", "bias_min", "bias_max", "router_lse_sq"}}, one entry per MoE layer).
// Errors are the communicator's.
absl::StatusOr<nlohmann::json> BalanceMoeBiases(const ModelConfig& c,
                                                std::vector<MoeLayerStats>& stats,
                                                Communicator* world,
                                                const std::function<float*(int64_t)>& bias);

struct MoeContext {
  const ModelConfig& c;
  ParamSet& P;
  const NumericsEmulator& nx;
  MoeRows& rows;
  Communicator* ep = nullptr;  // the EP group; null: ep = 1
  float zloss_scale = 0.0f;    // moe.z_loss / the step's tokens over the world
};

// y [T, d] = MoE(h) for h [T, d]; adds this pass's choices to `stats` (nullable).
absl::Status MoeFfnForward(const MoeContext& ctx, const MoeLayerParams& L, MoeCache& C,
                           MoeWork& W, const float* h, int64_t T, float* y, MoeLayerStats* stats);
// dh [T, d] (overwritten) from dy [T, d]; the parameter gradients accumulated.
absl::Status MoeFfnBackward(const MoeContext& ctx, const MoeLayerParams& L, MoeCache& C,
                            MoeWork& W, const float* h, const float* dy, int64_t T, float* dh);

}  // namespace spindle
