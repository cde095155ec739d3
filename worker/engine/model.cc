// The hybrid Lightning/MLA model: parameters, explicit per-layer forward and backward, the LM
// head with a blocked fused cross-entropy (see model.h and DESIGN.md section 2).
#include "worker/engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"
#include "worker/engine/layer_passes.h"

namespace spindle {

namespace k = kernels::cpu;

struct Model::Layer {
  char kind = 'L';
  int index = 0;
  int attn_norm = -1, ffn_norm = -1, w1 = -1, w2 = -1, w3 = -1;
  // Lightning
  int qkv = -1, gate = -1, out = -1, q_norm = -1, k_norm = -1, out_norm = -1;
  std::vector<float> log_decay;  // [H]
  // MLA
  int q = -1, q_a = -1, q_a_norm = -1, q_b = -1, kv_a = -1, kv_norm = -1, kv_b = -1, mo = -1;
  // MoE FFN (in place of w1, w2, w3)
  bool moe = false;
  MoeLayerParams moe_p;
};

// An activation as the input of its GEMMs: the operand, which points into the FP8 copy under
// FP8 and at the activation itself otherwise.
struct SavedInput {
  Fp8Copy fp8;
  GemmOperand op;
};

// Saved activations of one layer (the names follow model.h's formulas).
struct Model::Cache {
  Tensor h, rstd1, x_mid, h2, rstd2, g, u, a;        // norms and FFN
  Tensor q_raw, k_raw, qn, kn, v, rstd_q, rstd_k;    // Lightning projections
  Tensor o, gate, y, rstd_o;                         // Lightning output path
  Tensor qa, rstd_qa, qa_n, Q, kva, c, c_n, rstd_c;  // MLA projections
  Tensor kvb, kr, K, V, O, lse;                      // MLA attention
  Tensor latent;                                     // MLA AllGather: [c_n, RoPE'd k_r]
  Tensor cp_P;                                       // Lightning AllGather carry-ins
  std::vector<float> cp_saved;                       // CP mode state kept for the backward
  // The linear layers' activation inputs: the normed inputs, SwiGLU's output, Lightning's gated
  // output, MLA's normed q_a output, normed latent and attention output.
  SavedInput in_h, in_h2, in_a, in_y, in_qa_n, in_c_n, in_O;
  MoeCache moe;
  Tensor moe_y;  // a recomputed MoE FFN's output, not needed
};

// Gradient scratch, sized for the largest layer and reused by every layer's backward.
struct Model::Work {
  Tensor dh, dtmp, dq, dk, dv, dgate, dy, dO, dQ, dK, dV, dkvb, dc, dkva, dqa, dqa_n, da, dg, du;
  Tensor ones_T;  // unused placeholder kept zero-sized
  // FP8 copies of output gradients, each used by the GEMMs right after its quantization (the
  // Lightning gate's apart: it may run while a CP collective is in flight).
  Fp8Copy f_dy, f_dgate, f_dqkv;
  MoeWork moe;
};

std::vector<float> LightningLogDecays(const ModelConfig& c, int64_t layer) {
  const int64_t H = c.n_heads;
  std::vector<float> ld;
  for (int64_t h = 0; h < H; ++h) {
    const double slope = std::pow(2.0, -8.0 * static_cast<double>(h + 1) / H);
    ld.push_back(static_cast<float>(
        -slope * (1.0 - static_cast<double>(layer) / c.n_layers + 1e-5)));
  }
  return ld;
}

namespace {

void Ensure(Tensor& t, int64_t rows, int64_t cols) {
  if (t.numel() != rows * cols) t = Tensor({rows, cols});
}

// y[T, out] = x[T, in] W[out, in]^T, each operand's inverse scale applied to the accumulator.
void Linear(GemmOperand x, GemmOperand W, float* y, int64_t T, int64_t in, int64_t out) {
  k::Gemm(false, true, T, out, in, x.inverse_scale * W.inverse_scale, x.values, in, W.values, in,
          0.0f, y, out);
}

// dx (+)= dy[T, out] * W[out, in]; dW[out, in] += dy^T x.
void LinearBwdAcc(GemmOperand x, GemmOperand W, GemmOperand dy, float* dx, float* dW, int64_t T,
                  int64_t in, int64_t out, bool accumulate_dx) {
  if (dx)
    k::Gemm(false, false, T, in, out, dy.inverse_scale * W.inverse_scale, dy.values, out, W.values,
            in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  // Blockwise FP8: this GEMM contracts over the tokens, so it reads the copies in blocks down
  // the columns.
  const GemmOperand dyw = dy.ForWeightGradient(), xw = x.ForWeightGradient();
  k::Gemm(true, false, out, in, T, dyw.inverse_scale * xw.inverse_scale, dyw.values, out,
          xw.values, in, 1.0f, dW, in);
}

// A plain fp32 operand (the LM head's, outside the FP8 recipe).
GemmOperand Plain(const float* p) { return {p, 1.0f}; }

void AddInto(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

Model::Model(const ModelConfig& config) : config_(config), work_(std::make_unique<Work>()) {}
Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelConfig& config, uint64_t seed,
                                                     bool host_grads, int64_t ep,
                                                     int64_t ep_rank) {
  RETURN_IF_ERROR(config.Validate());
  if (ep < 1 || ep_rank < 0 || ep_rank >= ep || (ep > 1 && config.moe.experts % ep != 0))
    return absl::InvalidArgumentError(
        absl::StrCat("model: expert parallelism ", ep, " (rank ", ep_rank, ") does not shard ",
                     config.moe.experts, " experts"));
  std::unique_ptr<Model> m(new Model(config));
  m->ep_ = ep;
  m->ep_rank_ = ep_rank;
  m->Build();
  m->params_.Allocate(seed, host_grads);
  return m;
}

std::vector<int> Model::Fp8LinearWeights() const {
  std::vector<int> linear;
  for (const LinearWeight& w : spindle::Fp8LinearWeights(config_))
    if (const int i = params_.Find(w.name); i >= 0) linear.push_back(i);
  return linear;
}

void Model::SetNumerics(const Numerics& numerics) {
  std::vector<int> experts;  // the MoE layers' stacked expert weights, quantized per expert
  for (const auto& L : layers_)
    if (L->moe)
      for (int i : {L->moe_p.w1, L->moe_p.w2, L->moe_p.w3}) experts.push_back(i);
  numerics_.Set(numerics, Fp8LinearWeights(), std::move(experts));
}

void Model::Build() {
  const ModelConfig& c = config_;
  const int64_t d = c.d_model, H = c.n_heads, Dh = c.head_dim(), F = c.ffn_dim;
  const float out_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  ParamSet& P = params_;
  // The experts first: their gradients are one range, reduced over the expert-data-parallel group.
  std::vector<MoeLayerParams> moe(c.n_layers);
  for (int64_t i = 0; i < c.n_layers; ++i)
    if (c.IsMoeLayer(i)) DeclareMoeParams(c, i, ep_, ep_rank_, /*experts=*/true, P, &moe[i]);
  if (P.size() > 0) expert_end_ = P.info(P.size() - 1).offset + P.info(P.size() - 1).numel;
  embed_ = P.Add("embed.weight", {c.vocab, d}, ParamInit::kNormal, 0.02f);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    auto L = std::make_unique<Layer>();
    L->kind = c.LayerKind(i);
    L->index = static_cast<int>(i);
    const std::string p = absl::StrCat("layers.", i, ".");
    L->attn_norm = P.Add(p + "attn_norm.weight", {d}, ParamInit::kOnes);
    if (L->kind == 'L') {
      L->qkv = P.Add(p + "la.qkv.weight", {3 * d, d}, ParamInit::kNormal);
      L->gate = P.Add(p + "la.gate.weight", {d, d}, ParamInit::kNormal);
      L->out = P.Add(p + "la.out.weight", {d, d}, ParamInit::kNormal, out_std);
      L->q_norm = P.Add(p + "la.q_norm.weight", {Dh}, ParamInit::kOnes);
      L->k_norm = P.Add(p + "la.k_norm.weight", {Dh}, ParamInit::kOnes);
      L->out_norm = P.Add(p + "la.out_norm.weight", {d}, ParamInit::kOnes);
      L->log_decay = LightningLogDecays(c, i);
    } else {
      const MlaConfig& m = c.mla;
      const int64_t qk = m.qk_nope_dim + m.qk_rope_dim;
      if (m.q_lora_rank > 0) {
        L->q_a = P.Add(p + "mla.q_a.weight", {m.q_lora_rank, d}, ParamInit::kNormal);
        L->q_a_norm = P.Add(p + "mla.q_a_norm.weight", {m.q_lora_rank}, ParamInit::kOnes);
        L->q_b = P.Add(p + "mla.q_b.weight", {H * qk, m.q_lora_rank}, ParamInit::kNormal);
      } else {
        L->q = P.Add(p + "mla.q.weight", {H * qk, d}, ParamInit::kNormal);
      }
      L->kv_a = P.Add(p + "mla.kv_a.weight", {m.kv_lora_rank + m.qk_rope_dim, d}, ParamInit::kNormal);
      L->kv_norm = P.Add(p + "mla.kv_norm.weight", {m.kv_lora_rank}, ParamInit::kOnes);
      L->kv_b = P.Add(p + "mla.kv_b.weight", {H * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank},
                      ParamInit::kNormal);
      L->mo = P.Add(p + "mla.out.weight", {d, H * m.v_head_dim}, ParamInit::kNormal, out_std);
    }
    L->ffn_norm = P.Add(p + "ffn_norm.weight", {d}, ParamInit::kOnes);
    if (c.IsMoeLayer(i)) {
      L->moe = true;
      L->moe_p = moe[i];
      DeclareMoeParams(c, i, ep_, ep_rank_, /*experts=*/false, P, &L->moe_p);
    } else {
      L->w1 = P.Add(p + "ffn.w1.weight", {F, d}, ParamInit::kNormal);
      L->w2 = P.Add(p + "ffn.w2.weight", {d, F}, ParamInit::kNormal, out_std);
      L->w3 = P.Add(p + "ffn.w3.weight", {F, d}, ParamInit::kNormal);
    }
    layers_.push_back(std::move(L));
  }
  final_norm_ = P.Add("final_norm.weight", {d}, ParamInit::kOnes);
  lm_head_ = P.Add("lm_head.weight", {c.vocab, d}, ParamInit::kNormal);
}

// ---- One layer ---------------------------------------------------------------------------------

namespace {

struct LayerCtx {
  const ModelConfig& c;
  ParamSet& P;
  const NumericsEmulator& nx;
  const Batch& b;
  const CpLayout* layout = nullptr;  // null or cp == 1: single-rank
  const CpContext* cp = nullptr;
  CpScratch* scratch = nullptr;
  const CpBatch* group = nullptr;  // the hybrid modes' CpBatch::group
  MoeRows* moe_rows = nullptr;
  Communicator* ep = nullptr;                     // the EP group (null: ep = 1)
  float zloss_scale = 0.0f;
  std::vector<MoeLayerStats>* moe_stats = nullptr;  // a training pass's, by layer
  MoeWork* moe_work = nullptr;
  MoeContext Moe() const { return {c, P, nx, *moe_rows, ep, zloss_scale}; }
  bool split() const { return layout && layout->cp > 1; }
  CpMode lightning() const { return split() ? cp->lightning_mode : CpMode::kAuto; }
  CpMode mla() const { return split() ? cp->mla_mode : CpMode::kAuto; }
  // Parameter i's working copy, and as the weight of a linear layer.
  const float* Wt(int i) const { return nx.Weight(P, i); }
  GemmOperand Lin(int i, bool fp8 = true) const { return nx.LinearWeight(P, i, fp8); }
  // Activation x [rows, cols] as the input of its GEMMs, into `in`.
  void Input(SavedInput& in, const float* x, int64_t rows, int64_t cols) const {
    in.op = nx.Activation(x, rows, cols, in.fp8);
  }
  void Store(Tensor& t) const { nx.Store(t.f32(), t.numel()); }
  void Store(float* x, int64_t n) const { nx.Store(x, n); }
};

// The context of one pass over `b`: single-rank without `cpb`.
LayerCtx MakeCtx(const ModelConfig& c, ParamSet& P, const NumericsEmulator& nx, const Batch& b,
                 const CpBatch* cpb, const CpContext* cp, CpScratch* scratch) {
  return {c,  P,       nx, b, cpb ? &cpb->layout : nullptr,
          cp, scratch, cpb ? cpb->group.get() : nullptr};
}

LightningCpArgs LightningArgs(const LayerCtx& ctx, const Model::Layer& L, const Model::Cache& C) {
  const int64_t H = ctx.c.n_heads, Dh = ctx.c.head_dim();
  return {C.qn.f32(),
          C.kn.f32(),
          C.v.f32(),
          L.log_decay.data(),
          H,
          Dh,
          1.0f / std::sqrt(static_cast<float>(Dh)),
          &ctx.b,
          ctx.layout,
          ctx.cp->comm,
          {ctx.group, ctx.cp->ulysses, ctx.cp->ring}};
}

// The Lightning mixing o = LA(q, k, v). `overlap` is independent work of the caller, run while a
// CP collective is in flight (or after the local mixing when there is none).
absl::Status LightningForwardMix(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                                 const std::function<void()>& overlap) {
  const int64_t T = ctx.b.T, d = ctx.c.d_model, H = ctx.c.n_heads, Dh = ctx.c.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  Ensure(C.o, T, d);
  if (ctx.lightning() == CpMode::kAllGather) {
    Ensure(C.cp_P, 2 * H, Dh * Dh);
    return LightningAllGatherForward(LightningArgs(ctx, L, C), *ctx.scratch, overlap, C.o.f32(),
                                     C.cp_P.f32());
  }
  if (ctx.lightning() == CpMode::kAll2All) {
    RETURN_IF_ERROR(
        LightningAll2AllForward(LightningArgs(ctx, L, C), *ctx.scratch, C.o.f32(), &C.cp_saved));
    overlap();
    return absl::OkStatus();
  }
  if (ctx.lightning() == CpMode::kHybrid) {
    Ensure(C.cp_P, 2 * H, Dh * Dh);  // 2 * H/u * Dh * Dh are used
    return LightningHybridForward(LightningArgs(ctx, L, C), *ctx.scratch, overlap, C.o.f32(),
                                  C.cp_P.f32(), &C.cp_saved);
  }
  for (const Piece& p : ctx.b.pieces) {
    k::LightningDims dims{p.len, H, Dh, d};
    const int64_t off = p.begin * d;
    k::LightningForward(C.qn.f32() + off, C.kn.f32() + off, C.v.f32() + off, L.log_decay.data(),
                        p.cu_seqlens.data(), p.n_segments(), nullptr, scale, dims, C.o.f32() + off,
                        nullptr);
  }
  overlap();
  return absl::OkStatus();
}

absl::Status LightningBackwardMix(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                                  const float* d_o, const std::function<void()>& overlap,
                                  float* dq, float* dk, float* dv) {
  const int64_t d = ctx.c.d_model, H = ctx.c.n_heads, Dh = ctx.c.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  if (ctx.lightning() == CpMode::kAllGather)
    return LightningAllGatherBackward(LightningArgs(ctx, L, C), *ctx.scratch, C.cp_P.f32(), d_o,
                                      overlap, dq, dk, dv);
  if (ctx.lightning() == CpMode::kHybrid)
    return LightningHybridBackward(LightningArgs(ctx, L, C), *ctx.scratch, C.cp_P.f32(), C.cp_saved,
                                   d_o, overlap, dq, dk, dv);
  overlap();
  if (ctx.lightning() == CpMode::kAll2All)
    return LightningAll2AllBackward(LightningArgs(ctx, L, C), *ctx.scratch, C.cp_saved, d_o, dq,
                                    dk, dv);
  for (const Piece& p : ctx.b.pieces) {
    k::LightningDims dims{p.len, H, Dh, d};
    const int64_t off = p.begin * d;
    k::LightningBackward(C.qn.f32() + off, C.kn.f32() + off, C.v.f32() + off, L.log_decay.data(),
                         p.cu_seqlens.data(), p.n_segments(), nullptr, scale, dims, d_o + off,
                         nullptr, dq + off, dk + off, dv + off, nullptr);
  }
  return absl::OkStatus();
}

// Lightning attention block: x_mid = x + Wo(GroupNormGate(LA(rope(norm(q)), rope(norm(k)), v))).
absl::Status LightningAttnForward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C) {
  const ModelConfig& c = ctx.c;
  const int64_t T = ctx.b.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  const GemmOperand Wqkv = ctx.Lin(L.qkv);
  for (Tensor* t : {&C.q_raw, &C.k_raw, &C.qn, &C.kn, &C.v, &C.gate, &C.y}) Ensure(*t, T, d);
  Ensure(C.rstd_q, T, H);
  Ensure(C.rstd_k, T, H);
  Ensure(C.rstd_o, T, H);
  Linear(C.in_h.op, Wqkv, C.q_raw.f32(), T, d, d);
  Linear(C.in_h.op, Wqkv.At(d * d), C.k_raw.f32(), T, d, d);
  Linear(C.in_h.op, Wqkv.At(2 * d * d), C.v.f32(), T, d, d);
  for (Tensor* t : {&C.q_raw, &C.k_raw, &C.v}) ctx.Store(*t);
  k::RmsNormForward(C.q_raw.f32(), ctx.Wt(L.q_norm), C.qn.f32(), C.rstd_q.f32(), T * H, Dh, eps);
  k::RmsNormForward(C.k_raw.f32(), ctx.Wt(L.k_norm), C.kn.f32(), C.rstd_k.f32(), T * H, Dh, eps);
  k::RopeApply(C.qn.f32(), ctx.b.pos.data(), T, H, Dh, d, Dh, theta, false);
  k::RopeApply(C.kn.f32(), ctx.b.pos.data(), T, H, Dh, d, Dh, theta, false);
  ctx.Store(C.qn);
  ctx.Store(C.kn);
  // The gate projection does not depend on the mixing: it overlaps a CP collective.
  RETURN_IF_ERROR(LightningForwardMix(ctx, L, C, [&] {
    Linear(C.in_h.op, ctx.Lin(L.gate), C.gate.f32(), T, d, d);
    ctx.Store(C.gate);
  }));
  ctx.Store(C.o);
  k::GroupNormGateForward(C.o.f32(), ctx.Wt(L.out_norm), C.gate.f32(), C.y.f32(), C.rstd_o.f32(), T,
                          H, Dh, eps);
  ctx.Input(C.in_y, C.y.f32(), T, d);  // from the fused kernel's fp32 result
  ctx.Store(C.y);
  return absl::OkStatus();
}

// Given dy_attn = d(attn output before Wo is applied... ) see caller: `dout` is the gradient of the
// block output [T, d]; adds the gradient w.r.t. the normed input into W.dh (overwritten).
absl::Status LightningAttnBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                                   Model::Work& W, const float* dout) {
  const ModelConfig& c = ctx.c;
  ParamSet& P = ctx.P;
  const int64_t T = ctx.b.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  for (Tensor* t : {&W.dy, &W.dq, &W.dk, &W.dv, &W.dgate, &W.dtmp}) Ensure(*t, T, d);
  // y -> Wo
  LinearBwdAcc(C.in_y.op, ctx.Lin(L.out), ctx.nx.Gradient(dout, T, d, W.f_dy), W.dy.f32(),
               P.grad(L.out), T, d, d, false);
  ctx.Store(W.dy);
  // group norm + gate: dy -> d_o (into dtmp), dgate
  k::GroupNormGateBackward(C.o.f32(), ctx.Wt(L.out_norm), C.gate.f32(), C.rstd_o.f32(), W.dy.f32(),
                           W.dtmp.f32(), P.grad(L.out_norm), W.dgate.f32(), T, H, Dh);
  ctx.Store(W.dtmp);
  ctx.Store(W.dgate);
  RETURN_IF_ERROR(LightningBackwardMix(
      ctx, L, C, W.dtmp.f32(),
      [&] {
        LinearBwdAcc(C.in_h.op, ctx.Lin(L.gate), ctx.nx.Gradient(W.dgate.f32(), T, d, W.f_dgate),
                     W.dh.f32(), P.grad(L.gate), T, d, d, false);
      },
      W.dq.f32(), W.dk.f32(), W.dv.f32()));
  for (Tensor* t : {&W.dq, &W.dk, &W.dv}) ctx.Store(*t);
  k::RopeApply(W.dq.f32(), ctx.b.pos.data(), T, H, Dh, d, Dh, theta, true);
  k::RopeApply(W.dk.f32(), ctx.b.pos.data(), T, H, Dh, d, Dh, theta, true);
  // Per-head norms (in place is not allowed for dx): the raw q gradient into dy, the raw k
  // gradient into dq (free once q's is done).
  k::RmsNormBackward(C.q_raw.f32(), ctx.Wt(L.q_norm), C.rstd_q.f32(), W.dq.f32(), W.dy.f32(),
                     P.grad(L.q_norm), T * H, Dh);
  k::RmsNormBackward(C.k_raw.f32(), ctx.Wt(L.k_norm), C.rstd_k.f32(), W.dk.f32(), W.dq.f32(),
                     P.grad(L.k_norm), T * H, Dh);
  ctx.Store(W.dy);
  ctx.Store(W.dq);
  // The q, k and v gradients are one [T, 3d] tensor on the GPU: one FP8 scale for the three.
  std::vector<GemmOperand> dqkv;
  ctx.nx.JointGradients({W.dy.f32(), W.dq.f32(), W.dv.f32()}, T, d, W.f_dqkv, &dqkv);
  const GemmOperand Wqkv = ctx.Lin(L.qkv);
  float* dWqkv = P.grad(L.qkv);
  for (int64_t part = 0; part < 3; ++part)
    LinearBwdAcc(C.in_h.op, Wqkv.At(part * d * d), dqkv[part], W.dh.f32(), dWqkv + part * d * d, T,
                 d, d, true);
  return absl::OkStatus();
}

MlaCpArgs MlaArgs(const LayerCtx& ctx) {
  const MlaConfig& m = ctx.c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim;
  return {ctx.c.n_heads,
          qk,
          m.v_head_dim,
          m.kv_lora_rank,
          m.qk_rope_dim,
          1.0f / std::sqrt(static_cast<float>(qk)),
          &ctx.b,
          ctx.layout,
          ctx.cp->comm,
          {ctx.group, ctx.cp->ulysses, ctx.cp->ring},
          ctx.cp->mla_payload};
}

bool MlaRingLike(CpMode m) { return m == CpMode::kRing || m == CpMode::kHybrid; }

// Whether the core takes the latent [c_n, k_r] (and kv_b) rather than K and V: the AllGather
// mode, and the ring modes when the latent travels.
bool MlaTakesLatent(const LayerCtx& ctx) {
  return ctx.mla() == CpMode::kAllGather ||
         (MlaRingLike(ctx.mla()) && ctx.cp->mla_payload == MlaRingPayload::kLatent);
}

absl::Status MlaAttnForward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C) {
  const ModelConfig& c = ctx.c;
  const MlaConfig& m = c.mla;
  const int64_t T = ctx.b.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  Ensure(C.Q, T, H * qk);
  if (m.q_lora_rank > 0) {
    const int64_t qr = m.q_lora_rank;
    Ensure(C.qa, T, qr);
    Ensure(C.qa_n, T, qr);
    Ensure(C.rstd_qa, T, 1);
    Linear(C.in_h.op, ctx.Lin(L.q_a), C.qa.f32(), T, d, qr);
    ctx.Store(C.qa);
    k::RmsNormForward(C.qa.f32(), ctx.Wt(L.q_a_norm), C.qa_n.f32(), C.rstd_qa.f32(), T, qr, eps);
    C.in_qa_n.op = {C.qa_n.f32(), 1.0f};  // q_b is outside the FP8 recipe
    ctx.Store(C.qa_n);
    Linear(C.in_qa_n.op, ctx.Lin(L.q_b), C.Q.f32(), T, qr, H * qk);
  } else {
    Linear({C.h.f32(), 1.0f}, ctx.Lin(L.q), C.Q.f32(), T, d, H * qk);  // the bf16 h, as q's
  }
  ctx.Store(C.Q);
  k::RopeApply(C.Q.f32() + nope, ctx.b.pos.data(), T, H, rd, H * qk, qk, theta, false);
  ctx.Store(C.Q);
  Ensure(C.kva, T, kv + rd);
  Ensure(C.c, T, kv);
  Ensure(C.c_n, T, kv);
  Ensure(C.rstd_c, T, 1);
  Ensure(C.kr, T, rd);
  Linear(C.in_h.op, ctx.Lin(L.kv_a), C.kva.f32(), T, d, kv + rd);
  ctx.Store(C.kva);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(C.c.f32() + t * kv, C.kva.f32() + t * (kv + rd), kv * sizeof(float));
    std::memcpy(C.kr.f32() + t * rd, C.kva.f32() + t * (kv + rd) + kv, rd * sizeof(float));
  }
  k::RmsNormForward(C.c.f32(), ctx.Wt(L.kv_norm), C.c_n.f32(), C.rstd_c.f32(), T, kv, eps);
  C.in_c_n.op = {C.c_n.f32(), 1.0f};  // kv_b is outside the FP8 recipe
  ctx.Store(C.c_n);
  k::RopeApply(C.kr.f32(), ctx.b.pos.data(), T, 1, rd, rd, rd, theta, false);
  ctx.Store(C.kr);
  Ensure(C.O, T, H * vd);
  Ensure(C.lse, T, H);
  if (MlaTakesLatent(ctx)) {  // communicate the latent, not K and V
    Ensure(C.latent, T, kv + rd);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(C.latent.f32() + t * (kv + rd), C.c_n.f32() + t * kv, kv * sizeof(float));
      std::memcpy(C.latent.f32() + t * (kv + rd) + kv, C.kr.f32() + t * rd, rd * sizeof(float));
    }
    if (ctx.mla() == CpMode::kRing)
      return MlaRingForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), nullptr, nullptr, C.latent.f32(),
                            ctx.Wt(L.kv_b), C.O.f32(), C.lse.f32(), &C.cp_saved);
    if (ctx.mla() == CpMode::kHybrid)
      return MlaHybridForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), nullptr, nullptr,
                              C.latent.f32(), ctx.Wt(L.kv_b), C.O.f32(), &C.cp_saved);
    return MlaAllGatherForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), C.latent.f32(),
                               ctx.Wt(L.kv_b), C.O.f32(), C.lse.f32(), &C.cp_saved);
  }
  Ensure(C.kvb, T, H * (nope + vd));
  Linear(C.in_c_n.op, ctx.Lin(L.kv_b), C.kvb.f32(), T, kv, H * (nope + vd));
  ctx.Store(C.kvb);
  Ensure(C.K, T, H * qk);
  Ensure(C.V, T, H * vd);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float* src = C.kvb.f32() + (t * H + h) * (nope + vd);
      float* kdst = C.K.f32() + (t * H + h) * qk;
      std::memcpy(kdst, src, nope * sizeof(float));
      std::memcpy(kdst + nope, C.kr.f32() + t * rd, rd * sizeof(float));
      std::memcpy(C.V.f32() + (t * H + h) * vd, src + nope, vd * sizeof(float));
    }
  }
  if (ctx.mla() == CpMode::kAll2All)
    return MlaAll2AllForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), C.K.f32(), C.V.f32(),
                             C.O.f32(), &C.cp_saved);
  if (ctx.mla() == CpMode::kRing)
    return MlaRingForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), C.K.f32(), C.V.f32(), nullptr,
                          nullptr, C.O.f32(), C.lse.f32(), &C.cp_saved);
  if (ctx.mla() == CpMode::kHybrid)
    return MlaHybridForward(MlaArgs(ctx), *ctx.scratch, C.Q.f32(), C.K.f32(), C.V.f32(), nullptr,
                            nullptr, C.O.f32(), &C.cp_saved);
  k::AttentionMask mask{ctx.b.doc.data(), ctx.b.idx.data(), ctx.b.doc.data(), ctx.b.idx.data()};
  k::AttentionForward(C.Q.f32(), C.K.f32(), C.V.f32(), mask,
                      1.0f / std::sqrt(static_cast<float>(qk)), {T, T, H, qk, vd}, C.O.f32(),
                      C.lse.f32());
  return absl::OkStatus();
}

void MlaKvBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C, Model::Work& W);
void MlaLatentBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                       Model::Work& W);

absl::Status MlaAttnBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                             Model::Work& W, const float* dout) {
  const ModelConfig& c = ctx.c;
  const MlaConfig& m = c.mla;
  ParamSet& P = ctx.P;
  const int64_t T = ctx.b.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  Ensure(W.dO, T, H * vd);
  LinearBwdAcc(C.in_O.op, ctx.Lin(L.mo), ctx.nx.Gradient(dout, T, d, W.f_dy), W.dO.f32(),
               P.grad(L.mo), T, H * vd, d, false);
  ctx.Store(W.dO);
  Ensure(W.dQ, T, H * qk);
  Ensure(W.dK, T, H * qk);
  Ensure(W.dV, T, H * vd);
  Ensure(W.dkva, T, kv + rd);
  Ensure(W.dc, T, kv);
  if (MlaTakesLatent(ctx)) {
    // dQ, and the latent gradient [d c_n, d k_r (rotated)] of this rank's tokens.
    if (ctx.mla() == CpMode::kRing) {
      RETURN_IF_ERROR(MlaRingBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, C.Q.f32(), C.O.f32(),
                                      C.lse.f32(), ctx.Wt(L.kv_b), W.dO.f32(), W.dQ.f32(), nullptr,
                                      nullptr, W.dkva.f32(), P.grad(L.kv_b)));
    } else if (ctx.mla() == CpMode::kHybrid) {
      RETURN_IF_ERROR(MlaHybridBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, ctx.Wt(L.kv_b),
                                        W.dO.f32(), W.dQ.f32(), nullptr, nullptr, W.dkva.f32(),
                                        P.grad(L.kv_b)));
    } else {
      RETURN_IF_ERROR(MlaAllGatherBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, C.Q.f32(),
                                           C.O.f32(), C.lse.f32(), ctx.Wt(L.kv_b), W.dO.f32(),
                                           W.dQ.f32(), W.dkva.f32(), P.grad(L.kv_b)));
    }
    ctx.Store(W.dQ);
    ctx.Store(W.dkva);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(W.dc.f32() + t * kv, W.dkva.f32() + t * (kv + rd), kv * sizeof(float));
  } else {
    if (ctx.mla() == CpMode::kAll2All) {
      RETURN_IF_ERROR(MlaAll2AllBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, W.dO.f32(),
                                         W.dQ.f32(), W.dK.f32(), W.dV.f32()));
    } else if (ctx.mla() == CpMode::kRing) {
      RETURN_IF_ERROR(MlaRingBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, C.Q.f32(), C.O.f32(),
                                      C.lse.f32(), nullptr, W.dO.f32(), W.dQ.f32(), W.dK.f32(),
                                      W.dV.f32(), nullptr, nullptr));
    } else if (ctx.mla() == CpMode::kHybrid) {
      RETURN_IF_ERROR(MlaHybridBackward(MlaArgs(ctx), *ctx.scratch, C.cp_saved, nullptr, W.dO.f32(),
                                        W.dQ.f32(), W.dK.f32(), W.dV.f32(), nullptr, nullptr));
    } else {
      k::AttentionMask mask{ctx.b.doc.data(), ctx.b.idx.data(), ctx.b.doc.data(),
                            ctx.b.idx.data()};
      k::AttentionBackward(C.Q.f32(), C.K.f32(), C.V.f32(), C.O.f32(), C.lse.f32(), W.dO.f32(),
                           mask, 1.0f / std::sqrt(static_cast<float>(qk)), {T, T, H, qk, vd},
                           W.dQ.f32(), W.dK.f32(), W.dV.f32());
    }
    for (Tensor* t : {&W.dQ, &W.dK, &W.dV}) ctx.Store(*t);
    MlaKvBackward(ctx, L, C, W);
  }
  MlaLatentBackward(ctx, L, C, W);
  return absl::OkStatus();
}

// K, V gradients (W.dK, W.dV) -> kv_b output and the shared rotated key: W.dc = d c_n and the
// k_r columns of W.dkva (still rotated); dW_kv_b accumulated.
void MlaKvBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C, Model::Work& W) {
  const MlaConfig& m = ctx.c.mla;
  ParamSet& P = ctx.P;
  const int64_t T = ctx.b.T, H = ctx.c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  Ensure(W.dkvb, T, H * (nope + vd));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* dkr = W.dkva.f32() + t * (kv + rd) + kv;
    std::fill(dkr, dkr + rd, 0.0f);
    for (int64_t h = 0; h < H; ++h) {
      float* dst = W.dkvb.f32() + (t * H + h) * (nope + vd);
      const float* dk = W.dK.f32() + (t * H + h) * qk;
      std::memcpy(dst, dk, nope * sizeof(float));
      std::memcpy(dst + nope, W.dV.f32() + (t * H + h) * vd, vd * sizeof(float));
      for (int64_t j = 0; j < rd; ++j) dkr[j] += dk[nope + j];
    }
  }
  LinearBwdAcc(C.in_c_n.op, ctx.Lin(L.kv_b), {W.dkvb.f32(), 1.0f}, W.dc.f32(), P.grad(L.kv_b), T,
               kv, H * (nope + vd), false);
  ctx.Store(W.dc);
  for (int64_t t = 0; t < T; ++t)  // the shared key's gradient, summed over the heads
    ctx.Store(W.dkva.f32() + t * (kv + rd) + kv, rd);
}

// W.dc and the rotated k_r gradient in W.dkva -> the kv_a and q projections' gradients, W.dh.
void MlaLatentBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                       Model::Work& W) {
  const ModelConfig& c = ctx.c;
  const MlaConfig& m = c.mla;
  ParamSet& P = ctx.P;
  const int64_t T = ctx.b.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  const float theta = static_cast<float>(c.rope_theta);
  k::RopeApply(W.dkva.f32() + kv, ctx.b.pos.data(), T, 1, rd, kv + rd, rd, theta, true);
  // kv norm backward writes dc into the first kv columns of dkva, row by row via a dense buffer.
  Ensure(W.dtmp, T, std::max<int64_t>(kv, d));
  k::RmsNormBackward(C.c.f32(), ctx.Wt(L.kv_norm), C.rstd_c.f32(), W.dc.f32(), W.dtmp.f32(),
                     P.grad(L.kv_norm), T, kv);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(W.dkva.f32() + t * (kv + rd), W.dtmp.f32() + t * kv, kv * sizeof(float));
  ctx.Store(W.dkva);
  LinearBwdAcc(C.in_h.op, ctx.Lin(L.kv_a), ctx.nx.Gradient(W.dkva.f32(), T, kv + rd, W.f_dy),
               W.dh.f32(), P.grad(L.kv_a), T, d, kv + rd, false);
  // Q -> q projection(s).
  k::RopeApply(W.dQ.f32() + nope, ctx.b.pos.data(), T, H, rd, H * qk, qk, theta, true);
  ctx.Store(W.dQ);
  const GemmOperand dQ{W.dQ.f32(), 1.0f};  // q and q_b are outside the FP8 recipe
  if (m.q_lora_rank > 0) {
    const int64_t qr = m.q_lora_rank;
    Ensure(W.dqa_n, T, qr);
    Ensure(W.dqa, T, qr);
    LinearBwdAcc(C.in_qa_n.op, ctx.Lin(L.q_b), dQ, W.dqa_n.f32(), P.grad(L.q_b), T, qr, H * qk,
                 false);
    ctx.Store(W.dqa_n);
    k::RmsNormBackward(C.qa.f32(), ctx.Wt(L.q_a_norm), C.rstd_qa.f32(), W.dqa_n.f32(), W.dqa.f32(),
                       P.grad(L.q_a_norm), T, qr);
    ctx.Store(W.dqa);
    LinearBwdAcc(C.in_h.op, ctx.Lin(L.q_a), ctx.nx.Gradient(W.dqa.f32(), T, qr, W.f_dy),
                 W.dh.f32(), P.grad(L.q_a), T, d, qr, true);
  } else {
    LinearBwdAcc({C.h.f32(), 1.0f}, ctx.Lin(L.q), dQ, W.dh.f32(), P.grad(L.q), T, d, H * qk, true);
  }
}

}  // namespace

// x_out = x_mid + FFN(norm(x_mid)), x_mid = x_in + Attn(norm(x_in)). x_out null: everything the
// backward reads, without the output itself (the FFN's last GEMM), as a recomputed forward needs.
static absl::Status LayerForward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                                 const float* x_in, float* x_out) {
  const ModelConfig& c = ctx.c;
  const int64_t T = ctx.b.T, d = c.d_model, F = c.ffn_dim;
  const float eps = static_cast<float>(c.norm_eps);
  Ensure(C.h, T, d);
  Ensure(C.rstd1, T, 1);
  // Each GEMM input is taken (FP8: quantized) from its producer's fp32 result, as the GPU's fused
  // kernels do, before the result is stored.
  k::RmsNormForward(x_in, ctx.Wt(L.attn_norm), C.h.f32(), C.rstd1.f32(), T, d, eps);
  ctx.Input(C.in_h, C.h.f32(), T, d);
  ctx.Store(C.h);
  Ensure(C.x_mid, T, d);
  if (L.kind == 'L') {
    RETURN_IF_ERROR(LightningAttnForward(ctx, L, C));
    Linear(C.in_y.op, ctx.Lin(L.out), C.x_mid.f32(), T, d, d);
  } else {
    RETURN_IF_ERROR(MlaAttnForward(ctx, L, C));
    const int64_t hv = c.n_heads * c.mla.v_head_dim;
    ctx.Store(C.O);
    ctx.Input(C.in_O, C.O.f32(), T, hv);  // the attention's stored output: no fused producer
    Linear(C.in_O.op, ctx.Lin(L.mo), C.x_mid.f32(), T, hv, d);
  }
  AddInto(C.x_mid.f32(), x_in, T * d);
  ctx.Store(C.x_mid);
  Ensure(C.h2, T, d);
  Ensure(C.rstd2, T, 1);
  k::RmsNormForward(C.x_mid.f32(), ctx.Wt(L.ffn_norm), C.h2.f32(), C.rstd2.f32(), T, d, eps);
  if (L.moe) {
    ctx.Store(C.h2);
    // A recomputed forward needs the FFN's saved activations, not its output.
    float* y = x_out;
    if (y == nullptr) {
      Ensure(C.moe_y, T, d);
      y = C.moe_y.f32();
    }
    MoeLayerStats* stats = x_out && ctx.moe_stats ? &(*ctx.moe_stats)[L.index] : nullptr;
    RETURN_IF_ERROR(
        MoeFfnForward(ctx.Moe(), L.moe_p, C.moe, *ctx.moe_work, C.h2.f32(), T, y, stats));
    if (x_out == nullptr) return absl::OkStatus();
    AddInto(x_out, C.x_mid.f32(), T * d);
    ctx.Store(x_out, T * d);
    return absl::OkStatus();
  }
  for (Tensor* t : {&C.g, &C.u, &C.a}) Ensure(*t, T, F);
  C.in_h2.op = ctx.nx.FfnInput(L.index, C.h2.f32(), T, d, C.in_h2.fp8);  // (its outlier)
  ctx.Store(C.h2);
  Linear(C.in_h2.op, ctx.Lin(L.w1), C.g.f32(), T, d, F);
  Linear(C.in_h2.op, ctx.Lin(L.w3), C.u.f32(), T, d, F);
  ctx.Store(C.g);
  ctx.Store(C.u);
  k::SwiGluForward(C.g.f32(), C.u.f32(), C.a.f32(), T * F);
  ctx.Input(C.in_a, C.a.f32(), T, F);
  ctx.Store(C.a);
  if (x_out == nullptr) return absl::OkStatus();
  Linear(C.in_a.op, ctx.Lin(L.w2), x_out, T, F, d);
  AddInto(x_out, C.x_mid.f32(), T * d);
  ctx.Store(x_out, T * d);
  return absl::OkStatus();
}

// dx: in = gradient of x_out, out = gradient of x_in.
static absl::Status LayerBackward(const LayerCtx& ctx, const Model::Layer& L, Model::Cache& C,
                                  Model::Work& W, const float* x_in, float* dx) {
  const ModelConfig& c = ctx.c;
  ParamSet& P = ctx.P;
  const int64_t T = ctx.b.T, d = c.d_model, F = c.ffn_dim;
  Ensure(W.dh, T, d);
  if (L.moe) {
    RETURN_IF_ERROR(MoeFfnBackward(ctx.Moe(), L.moe_p, C.moe, W.moe, C.h2.f32(), dx, T, W.dh.f32()));
  } else {
    // FFN (each output gradient quantized, under FP8, from its stored value)
    for (Tensor* t : {&W.da, &W.dg, &W.du}) Ensure(*t, T, F);
    const NumericsEmulator& nx = ctx.nx;
    LinearBwdAcc(C.in_a.op, ctx.Lin(L.w2), nx.Gradient(dx, T, d, W.f_dy), W.da.f32(),
                 P.grad(L.w2), T, F, d, false);
    ctx.Store(W.da);
    k::SwiGluBackward(C.g.f32(), C.u.f32(), W.da.f32(), W.dg.f32(), W.du.f32(), T * F);
    ctx.Store(W.dg);
    ctx.Store(W.du);
    LinearBwdAcc(C.in_h2.op, ctx.Lin(L.w1), nx.Gradient(W.dg.f32(), T, F, W.f_dy), W.dh.f32(),
                 P.grad(L.w1), T, d, F, false);
    ctx.Store(W.dh);  // the GPU stores the first GEMM's output before the second adds to it
    LinearBwdAcc(C.in_h2.op, ctx.Lin(L.w3), nx.Gradient(W.du.f32(), T, F, W.f_dy), W.dh.f32(),
                 P.grad(L.w3), T, d, F, true);
    nx.FfnInputGradient(L.index, W.dh.f32(), T, d);  // through the injected outlier, if any
    ctx.Store(W.dh);
  }
  Ensure(W.dtmp, T, d);
  k::RmsNormBackward(C.x_mid.f32(), ctx.Wt(L.ffn_norm), C.rstd2.f32(), W.dh.f32(), W.dtmp.f32(),
                     P.grad(L.ffn_norm), T, d);
  AddInto(dx, W.dtmp.f32(), T * d);  // dx is now d x_mid
  ctx.Store(dx, T * d);
  // Attention
  if (L.kind == 'L') {
    RETURN_IF_ERROR(LightningAttnBackward(ctx, L, C, W, dx));
  } else {
    RETURN_IF_ERROR(MlaAttnBackward(ctx, L, C, W, dx));
  }
  ctx.Store(W.dh);
  Ensure(W.dtmp, T, d);
  k::RmsNormBackward(x_in, ctx.Wt(L.attn_norm), C.rstd1.f32(), W.dh.f32(), W.dtmp.f32(),
                     P.grad(L.attn_norm), T, d);
  AddInto(dx, W.dtmp.f32(), T * d);
  ctx.Store(dx, T * d);
  return absl::OkStatus();
}

// ---- Whole model ---------------------------------------------------------------------------------

LossStats Model::HeadAndLoss(const Batch& b, const float* x, float grad_scale, float* dx) {
  const int64_t T = b.T, d = config_.d_model, V = config_.vocab;
  Ensure(hf_, T, d);
  Ensure(rstd_f_, T, 1);
  const NumericsEmulator& nx = numerics_;
  k::RmsNormForward(x, nx.Weight(params_, final_norm_), hf_.f32(), rstd_f_.f32(), T, d,
                    static_cast<float>(config_.norm_eps));
  nx.Store(hf_.f32(), T * d);
  const float* head = nx.Weight(params_, lm_head_);  // bf16 at most: outside the FP8 recipe
  // Row blocks of about 4M logits keep the fp32 logits small whatever T is.
  const int64_t block = std::max<int64_t>(16, std::min<int64_t>(T, (int64_t{1} << 22) / V));
  Ensure(logits_, block, V);
  if (dx) Ensure(dhf_, T, d);
  LossStats s;
  for (int64_t r0 = 0; r0 < T; r0 += block) {
    const int64_t rows = std::min(block, T - r0);
    const float* h = hf_.f32() + r0 * d;
    Linear(Plain(h), Plain(head), logits_.f32(), rows, d, V);
    nx.Store(logits_.f32(), rows * V);
    s.loss_sum += k::CrossEntropy(logits_.f32(), b.targets.data() + r0, rows, V, grad_scale,
                                  dx ? logits_.f32() : nullptr, &s.n_valid, z_loss_);
    if (dx) {
      nx.Store(logits_.f32(), rows * V);
      LinearBwdAcc(Plain(h), Plain(head), Plain(logits_.f32()), dhf_.f32() + r0 * d,
                   params_.grad(lm_head_), rows, d, V, false);
      nx.Store(dhf_.f32() + r0 * d, rows * d);
    }
  }
  if (dx) {
    k::RmsNormBackward(x, nx.Weight(params_, final_norm_), rstd_f_.f32(), dhf_.f32(), dx,
                       params_.grad(final_norm_), T, d);
    nx.Store(dx, T * d);
  }
  return s;
}

LossStats Model::ForwardBackward(const Batch& b, float grad_scale, Recompute recompute) {
  return *Run(b, nullptr, grad_scale, recompute, nullptr);  // never fails without CP
}

LossStats Model::Forward(const Batch& b) { return *RunForward(b, nullptr); }

absl::Status Model::CheckCp(const CpBatch& b) const {
  const CpLayout& L = b.layout;
  if (L.cp <= 1) return absl::OkStatus();
  if (!cp_.comm || cp_.comm->size() != L.cp)
    return absl::FailedPreconditionError(
        absl::StrCat("model: a cp=", L.cp, " batch needs SetCp with a group of that size"));
  const bool hybrid = cp_.lightning_mode == CpMode::kHybrid || cp_.mla_mode == CpMode::kHybrid;
  if (!hybrid) return absl::OkStatus();
  const CpGroups g = L.groups();
  if (g.u < 2 || !b.group)
    return absl::FailedPreconditionError(absl::StrCat(
        "model: the hybrid modes need a batch sharded with Ulysses groups (ShardForCp with "
        "ulysses >= 2), got ulysses=",
        g.u));
  if (!cp_.ulysses || cp_.ulysses->size() != g.u || cp_.ulysses->rank() != g.Member(L.rank) ||
      !cp_.ring || cp_.ring->size() != g.r() || cp_.ring->rank() != g.Group(L.rank))
    return absl::FailedPreconditionError(
        absl::StrCat("model: the hybrid modes need SetCp with this rank's Ulysses group (", g.u,
                     " ranks, rank ", g.Member(L.rank), ") and ring (", g.r(), " ranks, rank ",
                     g.Group(L.rank), ") communicators"));
  return absl::OkStatus();
}

absl::StatusOr<LossStats> Model::ForwardBackward(const CpBatch& b, float grad_scale,
                                                 Recompute recompute,
                                                 const GradReadyFn& on_grad_ready) {
  RETURN_IF_ERROR(CheckCp(b));
  return Run(b.local, &b, grad_scale, recompute, on_grad_ready);
}

absl::StatusOr<LossStats> Model::Forward(const CpBatch& b) {
  RETURN_IF_ERROR(CheckCp(b));
  return RunForward(b.local, &b);
}

// The step's passes (layer_passes.h) on this model: a training step keeps every layer input
// (n + 1 of them, the last the head's), a forward-only pass two in turn and one cache.
class Model::Passes final : public LayerPasses {
 public:
  Passes(Model& m, const Batch& b, const CpBatch* cpb, float grad_scale, bool backward,
         GradReadyFn on_grad_ready)
      : m_(m),
        b_(b),
        ctx_(WithMoe(m, MakeCtx(m.config_, m.params_, m.numerics_, b, cpb, &m.cp_, &m.cp_scratch_),
                     backward)),
        grad_scale_(grad_scale),
        backward_(backward),
        on_grad_ready_(std::move(on_grad_ready)) {}

  absl::Status Embed() override {
    k::EmbeddingForward(b_.ids.data(), ctx_.Wt(m_.embed_), In(0), b_.T, m_.config_.d_model);
    return absl::OkStatus();
  }
  absl::Status Forward(int64_t i, int64_t cache, bool) override {
    return LayerForward(ctx_, *m_.layers_[i], *m_.caches_[cache], In(i), In(i + 1));
  }
  absl::StatusOr<LossStats> Head() override {
    const int64_t n = m_.config_.n_layers;
    if (!backward_) return m_.HeadAndLoss(b_, In(n), 0.0f, nullptr);
    Ensure(m_.dx_, b_.T, m_.config_.d_model);
    LossStats s = m_.HeadAndLoss(b_, In(n), grad_scale_, m_.dx_.f32());
    Ready(m_.params_.info(m_.final_norm_).offset);
    return s;
  }
  absl::Status Backward(int64_t i, int64_t cache, bool recomputes) override {
    Cache& C = *m_.caches_[cache];
    // A recomputing layer refills the shared cache; its output is the next layer's input.
    if (recomputes) RETURN_IF_ERROR(LayerForward(ctx_, *m_.layers_[i], C, In(i), nullptr));
    RETURN_IF_ERROR(LayerBackward(ctx_, *m_.layers_[i], C, *m_.work_, In(i), m_.dx_.f32()));
    Ready(m_.params_.info(m_.layers_[i]->attn_norm).offset);
    return absl::OkStatus();
  }
  absl::Status EmbedBackward() override {
    k::EmbeddingBackward(b_.ids.data(), m_.dx_.f32(), m_.params_.grad(m_.embed_), b_.T,
                         m_.config_.d_model, m_.config_.vocab);
    Ready(0);
    return absl::OkStatus();
  }

 private:
  float* In(int64_t i) { return m_.layer_inputs_[backward_ ? i : i % 2].f32(); }
  // The MoE layers' exchange and, for a training pass, their statistics.
  static LayerCtx WithMoe(Model& m, LayerCtx ctx, bool training) {
    ctx.moe_rows = &m.moe_rows_;
    ctx.ep = m.ep_comm_;
    ctx.zloss_scale = m.zloss_scale_;
    ctx.moe_work = &m.work_->moe;
    if (training) {
      // A training pass before any BeginStep counts into fresh statistics.
      if (m.moe_stats_.size() < static_cast<size_t>(m.config_.n_layers))
        m.moe_stats_.resize(m.config_.n_layers);
      ctx.moe_stats = &m.moe_stats_;
    }
    return ctx;
  }
  void Ready(int64_t offset) {
    if (on_grad_ready_) on_grad_ready_(offset);
  }

  Model& m_;
  const Batch& b_;
  const LayerCtx ctx_;
  const float grad_scale_;
  const bool backward_;
  const GradReadyFn on_grad_ready_;
};

absl::Status Model::SetExpertParallel(Communicator* ep) {
  const int64_t size = ep ? ep->size() : 1, rank = ep ? ep->rank() : 0;
  if (size != ep_ || rank != ep_rank_)
    return absl::FailedPreconditionError(
        absl::StrCat("model: built for EP rank ", ep_rank_, " of ", ep_, ", given a group of ", size,
                     " at rank ", rank));
  ep_comm_ = size > 1 ? ep : nullptr;
  return absl::OkStatus();
}

void Model::BeginStep(double tokens) {
  moe_stats_.assign(config_.n_layers, MoeLayerStats{});
  zloss_scale_ =
      tokens > 0 ? static_cast<float>(config_.moe.z_loss / tokens) : 0.0f;
}

absl::StatusOr<nlohmann::json> Model::FinishMoeStep(Communicator* world) {
  if (config_.moe.experts == 0) return nlohmann::json::object();
  if (moe_stats_.size() < static_cast<size_t>(config_.n_layers))
    moe_stats_.resize(config_.n_layers);
  return BalanceMoeBiases(config_, moe_stats_, world, [this](int64_t i) {
    return params_.data(layers_[i]->moe_p.bias);
  });
}

absl::StatusOr<LossStats> Model::Run(const Batch& b, const CpBatch* cpb, float grad_scale,
                                     Recompute recompute, const GradReadyFn& on_grad_ready) {
  RETURN_IF_ERROR(CheckExpertParallel());
  const int64_t n = config_.n_layers;
  const size_t n_caches = static_cast<size_t>(recompute.NumCaches(n));
  while (caches_.size() < n_caches) caches_.push_back(std::make_unique<Cache>());
  if (caches_.size() > n_caches) caches_.resize(n_caches);
  layer_inputs_.resize(n + 1);
  for (Tensor& t : layer_inputs_) Ensure(t, b.T, config_.d_model);
  numerics_.RefreshWeights(params_);
  Passes passes(*this, b, cpb, grad_scale, /*backward=*/true, on_grad_ready);
  return RunLayerPasses(passes, n, recompute, /*backward=*/true);
}

absl::Status Model::CheckExpertParallel() const {
  if (ep_ > 1 && ep_comm_ == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(
        "model: the experts are sharded over ", ep_, " ranks; SetExpertParallel gives their group"));
  return absl::OkStatus();
}

absl::StatusOr<LossStats> Model::RunForward(const Batch& b, const CpBatch* cpb) {
  RETURN_IF_ERROR(CheckExpertParallel());
  if (caches_.empty()) caches_.push_back(std::make_unique<Cache>());
  layer_inputs_.resize(2);
  for (Tensor& t : layer_inputs_) Ensure(t, b.T, config_.d_model);
  numerics_.RefreshWeights(params_);
  Passes passes(*this, b, cpb, 0.0f, /*backward=*/false, nullptr);
  return RunLayerPasses(passes, config_.n_layers, Recompute::All(), /*backward=*/false);
}

}  // namespace spindle
