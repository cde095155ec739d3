// The CPU model's MoE FFN (see moe_ffn.h).
#include "worker/engine/moe/moe_ffn.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"

namespace spindle {

namespace k = kernels::cpu;

void DeclareMoeParams(const ModelConfig& c, int64_t i, int64_t ep, int64_t ep_rank, bool experts,
                      ParamSet& P, MoeLayerParams* L) {
  const MoeConfig& m = c.moe;
  const int64_t d = c.d_model, E = m.experts, F = m.expert_ffn, S = m.shared_ffn;
  const int64_t El = E / ep, first = ep_rank * El;
  const float out_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  const std::string p = absl::StrCat("layers.", i, ".moe.");
  if (experts) {
    L->w1 = P.AddShard(p + "experts.w1.weight", {E, F, d}, first, El, ParamInit::kNormal);
    L->w2 = P.AddShard(p + "experts.w2.weight", {E, d, F}, first, El, ParamInit::kNormal, out_std);
    L->w3 = P.AddShard(p + "experts.w3.weight", {E, F, d}, first, El, ParamInit::kNormal);
    return;
  }
  L->router = P.Add(p + "router.weight", {E, d}, ParamInit::kNormal);
  L->bias = P.Add(p + "router.bias", {E}, ParamInit::kZeros);
  if (S > 0) {
    L->s1 = P.Add(p + "shared.w1.weight", {S, d}, ParamInit::kNormal);
    L->s2 = P.Add(p + "shared.w2.weight", {d, S}, ParamInit::kNormal, out_std);
    L->s3 = P.Add(p + "shared.w3.weight", {S, d}, ParamInit::kNormal);
  }
}

absl::StatusOr<nlohmann::json> BalanceMoeBiases(const ModelConfig& c,
                                                std::vector<MoeLayerStats>& stats,
                                                Communicator* world,
                                                const std::function<float*(int64_t)>& bias) {
  const int64_t E = c.moe.experts;
  // Every MoE layer's loads, lse^2 sum and token count, summed over the world in one collective.
  std::vector<double> sums;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (!c.IsMoeLayer(i)) continue;
    MoeLayerStats& s = stats[i];
    s.load.resize(E, 0.0);
    sums.insert(sums.end(), s.load.begin(), s.load.end());
    sums.push_back(s.zloss_sum);
    sums.push_back(static_cast<double>(s.tokens));
  }
  if (world && world->size() > 1)
    RETURN_IF_ERROR(world->AllReduceSum(sums.data(), static_cast<int64_t>(sums.size()),
                                        CommType::kF64, CommLayer::kOther));
  nlohmann::json layer_index = nlohmann::json::array(), load_ratio = nlohmann::json::array(),
                 bias_min = nlohmann::json::array(), bias_max = nlohmann::json::array(),
                 lse_sq = nlohmann::json::array();
  const float rate = static_cast<float>(c.moe.bias_rate);
  size_t at = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (!c.IsMoeLayer(i)) continue;
    const double* load = sums.data() + at;
    const double zsum = sums[at + E], tokens = sums[at + E + 1];
    at += E + 2;
    double total = 0.0, most = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      total += load[e];
      most = std::max(most, load[e]);
    }
    const double mean = total / static_cast<double>(E);
    float* b = bias(i);
    if (total > 0)
      for (int64_t e = 0; e < E; ++e) b[e] += load[e] < mean ? rate : load[e] > mean ? -rate : 0.0f;
    layer_index.push_back(i);
    load_ratio.push_back(mean > 0 ? most / mean : 0.0);
    bias_min.push_back(*std::min_element(b, b + E));
    bias_max.push_back(*std::max_element(b, b + E));
    lse_sq.push_back(tokens > 0 ? zsum / tokens : 0.0);
  }
  return nlohmann::json{{"moe",
                         {{"layers", layer_index},
                          {"load_max_over_mean", load_ratio},
                          {"bias_min", bias_min},
                          {"bias_max", bias_max},
                          {"router_lse_sq", lse_sq}}}};
}

namespace {

void Ensure(Tensor& t, int64_t rows, int64_t cols) {
  rows = std::max<int64_t>(rows, 1);  // an expert group may be empty; keep a valid pointer
  if (t.numel() < rows * cols) t = Tensor({rows, cols});
}

// y[n, out] = x[n, in] W[out, in]^T, each operand's inverse scale applied to the accumulator.
void Lin(GemmOperand x, GemmOperand W, float* y, int64_t n, int64_t in, int64_t out) {
  if (n > 0)
    k::Gemm(false, true, n, out, in, x.inverse_scale * W.inverse_scale, x.values, in, W.values, in,
            0.0f, y, out);
}

// dx[n, in] (+)= dy W; dW[out, in] += dy^T x, on the operands' copies for the weight gradient
// (blockwise FP8: the contraction runs over the rows, in column blocks).
void LinBwd(GemmOperand x, GemmOperand W, GemmOperand dy, float* dx, float* dW, int64_t n,
            int64_t in, int64_t out, bool accumulate_dx) {
  if (n == 0) return;
  k::Gemm(false, false, n, in, out, dy.inverse_scale * W.inverse_scale, dy.values, out, W.values,
          in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  const GemmOperand dyw = dy.ForWeightGradient(), xw = x.ForWeightGradient();
  k::Gemm(true, false, out, in, n, dyw.inverse_scale * xw.inverse_scale, dyw.values, out, xw.values,
          in, 1.0f, dW, in);
}

// A plain operand (the router's fp32 and the shared expert's bf16, outside the FP8 recipe).
GemmOperand Plain(const float* p) { return {p, 1.0f}; }

// The shared expert, a SwiGLU FFN over n rows: g = x W1^T, u = x W3^T, a = silu(g) u,
// y = a W2^T.
void SwiGluFfn(const MoeContext& ctx, const float* x, const float* W1, const float* W3,
               const float* W2, float* g, float* u, float* a, float* y, int64_t n, int64_t F) {
  const int64_t d = ctx.c.d_model;
  Lin(Plain(x), Plain(W1), g, n, d, F);
  Lin(Plain(x), Plain(W3), u, n, d, F);
  ctx.nx.Store(g, n * F);
  ctx.nx.Store(u, n * F);
  k::SwiGluForward(g, u, a, n * F);
  ctx.nx.Store(a, n * F);
  Lin(Plain(a), Plain(W2), y, n, F, d);
  ctx.nx.Store(y, n * d);
}

// Its backward: dx (+)= from dy; dW1, dW2, dW3 accumulated. da, dg, du: [n, F] scratch.
void SwiGluFfnBwd(const MoeContext& ctx, const float* x, const float* g, const float* u,
                  const float* a, const float* W1, const float* W3, const float* W2,
                  const float* dy, float* dW1, float* dW3, float* dW2, float* da, float* dg,
                  float* du, float* dx, int64_t n, int64_t F, bool accumulate_dx) {
  const int64_t d = ctx.c.d_model;
  LinBwd(Plain(a), Plain(W2), Plain(dy), da, dW2, n, F, d, false);
  ctx.nx.Store(da, n * F);
  k::SwiGluBackward(g, u, da, dg, du, n * F);
  ctx.nx.Store(dg, n * F);
  ctx.nx.Store(du, n * F);
  LinBwd(Plain(x), Plain(W1), Plain(dg), dx, dW1, n, d, F, accumulate_dx);
  ctx.nx.Store(dx, n * d);  // the GPU stores the first GEMM's output before the second adds to it
  LinBwd(Plain(x), Plain(W3), Plain(du), dx, dW3, n, d, F, true);
}

}  // namespace

absl::Status MoeFfnForward(const MoeContext& ctx, const MoeLayerParams& L, MoeCache& C,
                           MoeWork& W, const float* h, int64_t T, float* y, MoeLayerStats* stats) {
  const ModelConfig& c = ctx.c;
  const MoeConfig& m = c.moe;
  ParamSet& P = ctx.P;
  const int64_t d = c.d_model, E = m.experts, K = m.top_k, F = m.expert_ffn, S = m.shared_ffn;
  // Router, in fp32 on the master weights.
  Ensure(C.logits, T, E);
  Ensure(C.weights, T, K);
  Ensure(C.lse, T, 1);
  C.idx.resize(T * K);
  Lin(Plain(h), Plain(P.data(L.router)), C.logits.f32(), T, d, E);
  k::MoeRouterForward(C.logits.f32(), P.data(L.bias), C.idx.data(), C.weights.f32(), C.lse.f32(), T,
                      E, K);
  RETURN_IF_ERROR(PlanMoeDispatch(C.idx.data(), T, K, E, /*align=*/1, ctx.ep, ctx.rows, &C.plan));
  const MoeDispatchPlan& plan = C.plan;
  if (stats) {
    if (stats->load.size() != static_cast<size_t>(E)) stats->load.assign(E, 0.0);
    for (int64_t e = 0; e < E; ++e) stats->load[e] += static_cast<double>(plan.counts[e]);
    for (int64_t t = 0; t < T; ++t)
      stats->zloss_sum += static_cast<double>(C.lse.f32()[t]) * C.lse.f32()[t];
    stats->tokens += T;
  }
  // Tokens to their experts; the shared expert runs while they travel.
  const int64_t R = plan.expert_rows();
  Ensure(C.xe, R, d);
  if (plan.ep > 1) {
    Ensure(W.dsend, T * K, d);
    Ensure(W.drecv, plan.recv_total(), d);
  }
  for (Tensor* t : {&C.sg, &C.su, &C.sa}) Ensure(*t, T, std::max<int64_t>(S, 1));
  const NumericsEmulator& nx = ctx.nx;
  auto shared = [&] {
    if (S == 0) {
      std::fill(y, y + T * d, 0.0f);
      return;
    }
    SwiGluFfn(ctx, h, nx.Weight(P, L.s1), nx.Weight(P, L.s3), nx.Weight(P, L.s2), C.sg.f32(),
              C.su.f32(), C.sa.f32(), y, T, S);
  };
  RETURN_IF_ERROR(MoeDispatch(plan, ctx.rows, ctx.ep, h, d, W.dsend.f32(), W.drecv.f32(),
                              C.xe.f32(), shared));
  // The experts, each over its rows; under FP8 each GEMM input is quantized once for all the
  // rank's experts (numerics.h), as the GPU's grouped GEMMs read it.
  Ensure(C.ye, R, d);
  for (Tensor* t : {&C.g, &C.u, &C.a}) Ensure(*t, R, F);
  MoeExpertSegments(plan, &C.segments);
  const int64_t El = plan.local_experts;
  const int64_t* off = plan.expert_offsets.data();
  const int64_t* count = plan.expert_counts.data();
  float *g = C.g.f32(), *u = C.u.f32(), *a = C.a.f32();
  C.xe_op = nx.GroupedActivation(C.xe.f32(), R, d, C.segments, C.q_xe);
  for (int64_t j = 0; j < El; ++j) {
    Lin(C.xe_op.At(off[j] * d), nx.ExpertWeight(P, L.w1, j), g + off[j] * F, count[j], d, F);
    Lin(C.xe_op.At(off[j] * d), nx.ExpertWeight(P, L.w3, j), u + off[j] * F, count[j], d, F);
  }
  nx.Store(g, R * F);
  nx.Store(u, R * F);
  k::SwiGluForward(g, u, a, R * F);
  C.a_op = nx.GroupedActivation(a, R, F, C.segments, C.q_a);  // from the fp32 result
  nx.Store(a, R * F);
  for (int64_t j = 0; j < El; ++j)
    Lin(C.a_op.At(off[j] * F), nx.ExpertWeight(P, L.w2, j), C.ye.f32() + off[j] * d, count[j], F,
        d);
  nx.Store(C.ye.f32(), R * d);
  // Back to the tokens, weighted, onto the shared expert's output.
  const float* Y = C.ye.f32();
  if (plan.ep > 1) {
    Ensure(C.returned, T * K, d);
    RETURN_IF_ERROR(MoeFromExperts(plan, ctx.rows, ctx.ep, C.ye.f32(), d, W.drecv.f32(),
                                   C.returned.f32()));
    Y = C.returned.f32();
  }
  k::MoeCombine(Y, plan.pair_row.data(), C.weights.f32(), y, T, K, d, /*accumulate=*/true);
  nx.Store(y, T * d);
  return absl::OkStatus();
}

absl::Status MoeFfnBackward(const MoeContext& ctx, const MoeLayerParams& L, MoeCache& C,
                            MoeWork& W, const float* h, const float* dy, int64_t T, float* dh) {
  const ModelConfig& c = ctx.c;
  const MoeConfig& m = c.moe;
  ParamSet& P = ctx.P;
  const NumericsEmulator& nx = ctx.nx;
  const int64_t d = c.d_model, E = m.experts, K = m.top_k, F = m.expert_ffn, S = m.shared_ffn;
  const MoeDispatchPlan& plan = C.plan;
  const int64_t R = plan.expert_rows();
  // The combine's backward: each pair's output gradient (weighted) and its weight's gradient.
  Ensure(W.dw, T, K);
  Ensure(W.dye, R, d);
  const float* Y = plan.ep > 1 ? C.returned.f32() : C.ye.f32();
  if (plan.ep > 1) {
    Ensure(W.dsend, T * K, d);
    Ensure(W.drecv, plan.recv_total(), d);
    k::MoeCombineBackward(dy, Y, plan.pair_row.data(), C.weights.f32(), W.dsend.f32(), W.dw.f32(),
                          T, K, d);
    nx.Store(W.dsend.f32(), T * K * d);
  } else {
    std::fill(W.dye.f32(), W.dye.f32() + R * d, 0.0f);  // padding rows stay zero
    k::MoeCombineBackward(dy, Y, plan.pair_row.data(), C.weights.f32(), W.dye.f32(), W.dw.f32(), T,
                          K, d);
    nx.Store(W.dye.f32(), R * d);
  }
  // The shared expert's backward runs while the gradients travel to the experts.
  for (Tensor* t : {&W.sda, &W.sdg, &W.sdu}) Ensure(*t, T, std::max<int64_t>(S, 1));
  auto shared = [&] {
    if (S == 0) {
      std::fill(dh, dh + T * d, 0.0f);
      return;
    }
    SwiGluFfnBwd(ctx, h, C.sg.f32(), C.su.f32(), C.sa.f32(), nx.Weight(P, L.s1),
                 nx.Weight(P, L.s3), nx.Weight(P, L.s2), dy, P.grad(L.s1), P.grad(L.s3),
                 P.grad(L.s2), W.sda.f32(), W.sdg.f32(), W.sdu.f32(), dh, T, S, false);
  };
  if (plan.ep > 1) {
    RETURN_IF_ERROR(MoeToExperts(plan, ctx.rows, ctx.ep, W.dsend.f32(), d, W.drecv.f32(),
                                 W.dye.f32(), shared));
  } else {
    shared();
  }
  // The experts' backward, each output gradient quantized (under FP8) from its stored values
  // for all the rank's experts at once.
  Ensure(W.dxe, R, d);
  for (Tensor* t : {&W.da, &W.dg, &W.du}) Ensure(*t, R, F);
  const int64_t El = plan.local_experts;
  const int64_t* off = plan.expert_offsets.data();
  const int64_t* count = plan.expert_counts.data();
  float *da = W.da.f32(), *dg = W.dg.f32(), *du = W.du.f32(), *dxe = W.dxe.f32();
  const GemmOperand dY = nx.GroupedGradient(W.dye.f32(), R, d, C.segments, W.q_dye);
  for (int64_t j = 0; j < El; ++j)
    LinBwd(C.a_op.At(off[j] * F), nx.ExpertWeight(P, L.w2, j), dY.At(off[j] * d), da + off[j] * F,
           P.grad(L.w2) + j * d * F, count[j], F, d, false);
  nx.Store(da, R * F);
  k::SwiGluBackward(C.g.f32(), C.u.f32(), da, dg, du, R * F);
  nx.Store(dg, R * F);
  nx.Store(du, R * F);
  const GemmOperand dG = nx.GroupedGradient(dg, R, F, C.segments, W.q_dg);
  const GemmOperand dU = nx.GroupedGradient(du, R, F, C.segments, W.q_du);
  for (int64_t j = 0; j < El; ++j)
    LinBwd(C.xe_op.At(off[j] * d), nx.ExpertWeight(P, L.w1, j), dG.At(off[j] * F),
           dxe + off[j] * d, P.grad(L.w1) + j * F * d, count[j], d, F, false);
  nx.Store(dxe, R * d);  // the GPU stores the first GEMM's output before the second adds to it
  for (int64_t j = 0; j < El; ++j)
    LinBwd(C.xe_op.At(off[j] * d), nx.ExpertWeight(P, L.w3, j), dU.At(off[j] * F),
           dxe + off[j] * d, P.grad(L.w3) + j * F * d, count[j], d, F, true);
  nx.Store(dxe, R * d);
  // The input gradients back to the tokens (each token's K rows summed).
  const float* dX = W.dxe.f32();
  if (plan.ep > 1) {
    RETURN_IF_ERROR(
        MoeFromExperts(plan, ctx.rows, ctx.ep, W.dxe.f32(), d, W.drecv.f32(), W.dsend.f32()));
    dX = W.dsend.f32();
  }
  k::MoeCombine(dX, plan.pair_row.data(), nullptr, dh, T, K, d, /*accumulate=*/true);
  // The router: through the weights' renormalised sigmoid, and the z-loss.
  Ensure(W.dlogits, T, E);
  k::MoeRouterBackward(C.logits.f32(), C.idx.data(), W.dw.f32(), C.lse.f32(), ctx.zloss_scale,
                       W.dlogits.f32(), T, E, K);
  LinBwd(Plain(h), Plain(P.data(L.router)), Plain(W.dlogits.f32()), dh, P.grad(L.router), T, d, E,
         true);
  nx.Store(dh, T * d);
  return absl::OkStatus();
}

}  // namespace spindle
