// The CUDA model's Lightning attention family (cuda_lightning.h): one layer's block following
// worker/engine/model.cc step for step, and its core under context parallelism.
#include "worker/engine/cuda/cuda_lightning.h"

#include "worker/engine/cp/cp_layout.h"

namespace spindle {
namespace cuda_model_detail {

absl::Status CudaLightning::Forward(const LayerIdx& L, LayerActs& A, LightningCache& C,
                                    const void* x_in, bool transposes, bool requantize) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  for (DevBuf* b : {&C.qkv_raw, &C.qkv_n}) RETURN_IF_ERROR(cx.Act(*b, T, 3 * d));
  for (DevBuf* b : {&C.gate, &C.o}) RETURN_IF_ERROR(cx.Act(*b, T, d));
  if (!cx.fp8) RETURN_IF_ERROR(cx.Act(C.y, T, d));
  for (DevBuf* b : {&C.rstd_q, &C.rstd_k, &C.rstd_o}) RETURN_IF_ERROR(cx.F32(*b, T * H));
  RETURN_IF_ERROR(cx.fp8 ? cx.FwdQ(A.q_h, L.qkv, C.qkv_raw.get(), T, d, 3 * d, false)
                         : cx.Fwd(A.h.get(), d, cx.Wb(L.qkv), C.qkv_raw.get(), T, d, 3 * d, false));
  KC(kc::QkNormRopeForward(C.qkv_raw.get(), cx.Wb(L.q_norm), cx.Wb(L.k_norm), B.pos.i32(),
                           C.qkv_n.get(), C.rstd_q.f32(), C.rstd_k.f32(), T, H, Dh, eps, theta,
                           /*copy_v=*/true, kAct, cx.stream));
  if (cx.LightningAllGather()) {
    RETURN_IF_ERROR(AllGatherForward(L, C));
  } else if (cx.LightningHybrid()) {
    RETURN_IF_ERROR(HybridForward(L, A, C));
  } else if (B.cp > 1) {
    RETURN_IF_ERROR(CoreForward(L, A, C));
  } else {
    const void* q = C.qkv_n.get();
    const int64_t kept = static_cast<int64_t>(kc::LightningSavedBytes({T, H, Dh, 3 * d}));
    if (kept > 0) RETURN_IF_ERROR(C.lstates.Ensure(&cx.alloc, kept));
    KC(kc::LightningForward(q, At(q, d), At(q, 2 * d), L.log_decay, B.cu.i32(),
                            static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                            1.0f / std::sqrt(static_cast<float>(Dh)), {T, H, Dh, 3 * d}, C.o.get(),
                            nullptr, kAct, cx.Ws(), cx.stream, {},
                            kept > 0 ? C.lstates.f32() : nullptr));
  }
  if (!cx.fp8) {
    RETURN_IF_ERROR(cx.Fwd(A.h.get(), d, cx.Wb(L.gate), C.gate.get(), T, d, d, false));
    KC(kc::GroupNormGateForward(C.o.get(), cx.Wb(L.out_norm), C.gate.get(), C.y.get(),
                                C.rstd_o.f32(), T, H, Dh, eps, kAct, cx.stream));
    return cx.Fwd(C.y.get(), d, cx.Wb(L.out), A.x_mid.get(), T, d, d, true, x_in);
  }
  RETURN_IF_ERROR(cx.FwdQ(A.q_h, L.gate, C.gate.get(), T, d, d, false));
  RETURN_IF_ERROR(cx.QAct(C.q_y, T, d));
  if (cx.fp8_blockwise) {  // the group norm for rstd_o (a recomputed forward kept it), then blocks
    if (!requantize) {
      void* y = nullptr;
      RETURN_IF_ERROR(cx.NormScratch(&y));
      KC(kc::GroupNormGateForward(C.o.get(), cx.Wb(L.out_norm), C.gate.get(), y, C.rstd_o.f32(), T,
                                  H, Dh, eps, kAct, cx.stream));
    }
    KC(kc::GroupNormGateQuantizeBlockwise(C.o.get(), cx.Wb(L.out_norm), C.gate.get(),
                                          C.rstd_o.f32(), T, H, Dh, kAct,
                                          cx.QBlockOut(C.q_y, transposes), cx.stream));
    return cx.FwdQ(C.q_y, L.out, A.x_mid.get(), T, d, d, true, x_in);
  }
  const kc::Fp8Output q = cx.QOut(C.q_y, transposes, A, kSiteY);
  if (requantize) {
    KC(kc::GroupNormGateQuantizeFp8(C.o.get(), cx.Wb(L.out_norm), C.gate.get(), C.rstd_o.f32(), T,
                                    H, Dh, kAct, q, cx.stream));
  } else {
    KC(kc::GroupNormGateForwardFp8(C.o.get(), cx.Wb(L.out_norm), C.gate.get(), nullptr,
                                   C.rstd_o.f32(), T, H, Dh, eps, kAct, q, cx.stream));
  }
  return cx.FwdQ(C.q_y, L.out, A.x_mid.get(), T, d, d, true, x_in);
}

absl::Status CudaLightning::Backward(const LayerIdx& L, LayerActs& A, LightningCache& C,
                                     const void* dout) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  for (DevBuf* b : {&W.dy, &W.dgate}) RETURN_IF_ERROR(cx.Act(*b, T, d));
  RETURN_IF_ERROR(cx.Act(W.dqkv, T, 3 * d));
  RETURN_IF_ERROR(
      cx.fp8 ? cx.BwdQ(C.q_y, L.out, dout, W.dy.get(), cx.G(L.out), T, d, d, false,
                       cx.GradAmax(Work::kAmaxDx))
             : cx.Bwd(C.y.get(), d, cx.Wb(L.out), dout, W.dy.get(), cx.G(L.out), T, d, d, false));
  // dy -> d o (in place) and d gate.
  KC(kc::GroupNormGateBackward(C.o.get(), cx.Wb(L.out_norm), C.gate.get(), C.rstd_o.f32(),
                               W.dy.get(), W.dy.get(), cx.G(L.out_norm), W.dgate.get(), T, H, Dh,
                               kAct, cx.Ws(), cx.stream, cx.GradAmax(Work::kAmaxDgate)));
  void* dq = W.dqkv.get();
  if (cx.LightningAllGather()) {
    RETURN_IF_ERROR(AllGatherBackward(L, C));
  } else if (cx.LightningHybrid()) {
    RETURN_IF_ERROR(HybridBackward(L, A, C));
  } else if (B.cp > 1) {
    RETURN_IF_ERROR(CoreBackward(L, A, C));
  } else {
    const void* q = C.qkv_n.get();
    const bool kept = kc::LightningSavedBytes({T, H, Dh, 3 * d}) > 0;
    KC(kc::LightningBackward(q, At(q, d), At(q, 2 * d), L.log_decay, B.cu.i32(),
                             static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                             1.0f / std::sqrt(static_cast<float>(Dh)), {T, H, Dh, 3 * d},
                             W.dy.get(), nullptr, dq, At(dq, d), At(dq, 2 * d), nullptr, kAct,
                             cx.Ws(), cx.stream, {}, kept ? C.lstates.f32() : nullptr));
  }
  KC(kc::QkNormRopeBackward(C.qkv_raw.get(), cx.Wb(L.q_norm), cx.Wb(L.k_norm), C.rstd_q.f32(),
                            C.rstd_k.f32(), B.pos.i32(), dq, dq, cx.G(L.q_norm), cx.G(L.k_norm), T,
                            H, Dh, theta, /*copy_v=*/true, kAct, cx.Ws(), cx.stream,
                            cx.GradAmax(Work::kAmaxDqkv)));
  if (cx.fp8) {
    RETURN_IF_ERROR(cx.BwdQ(A.q_h, L.qkv, dq, cx.W.dh.get(), cx.G(L.qkv), T, d, 3 * d, false,
                            cx.W.Amax(Work::kAmaxDqkv)));
    return cx.BwdQ(A.q_h, L.gate, W.dgate.get(), cx.W.dh.get(), cx.G(L.gate), T, d, d, true,
                   cx.W.Amax(Work::kAmaxDgate));
  }
  RETURN_IF_ERROR(
      cx.Bwd(A.h.get(), d, cx.Wb(L.qkv), dq, cx.W.dh.get(), cx.G(L.qkv), T, d, 3 * d, false));
  return cx.Bwd(A.h.get(), d, cx.Wb(L.gate), W.dgate.get(), cx.W.dh.get(), cx.G(L.gate), T, d, d,
                true);
}

absl::Status CudaLightning::CoreForward(const LayerIdx& L, LayerActs& A, LightningCache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t Hl = H / B.cp, Tf = B.T_full, hw = Hl * Dh, w = 3 * hw;
  RETURN_IF_ERROR(cx.Act(A.cp_full, Tf, w));
  void* q = C.qkv_n.get();
  RETURN_IF_ERROR(cx.PackByHeads(
      B.whole, {{q, 3 * d, Dh, Dh}, {At(q, d), 3 * d, Dh, Dh}, {At(q, 2 * d), 3 * d, Dh, Dh}}));
  RETURN_IF_ERROR(
      cx.ExchangeToGroup(B.whole, cx.W.cp_block.get(), A.cp_full.get(), w, CommLayer::kLightning));
  const void* f = A.cp_full.get();
  KC(kc::LightningForward(f, At(f, hw), At(f, 2 * hw), L.log_decay + B.rank * Hl, B.cu.i32(),
                          static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                          1.0f / std::sqrt(static_cast<float>(Dh)), {Tf, Hl, Dh, w},
                          cx.W.cp_tmp.get(), nullptr, kAct, cx.Ws(), cx.stream));
  RETURN_IF_ERROR(cx.ExchangeFromGroup(B.whole, cx.W.cp_tmp.get(), cx.W.cp_block.get(), hw,
                                       CommLayer::kLightning));
  return cx.UnpackToTokens(B.whole, cx.W.cp_block.get(), {{C.o.get(), d, Dh, Dh}});
}

// d o of this rank's tokens (W.dy) -> the whole sequence for H/cp heads -> the core's backward
// (its gradients into W.cp_block, free once d o is received) -> dq, dk, dv of this rank's tokens
// (received into A.cp_full, whose last reader the core's backward was) into W.dqkv.
absl::Status CudaLightning::CoreBackward(const LayerIdx& L, LayerActs& A, LightningCache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t Hl = H / B.cp, Tf = B.T_full, hw = Hl * Dh, w = 3 * hw;
  RETURN_IF_ERROR(cx.PackByHeads(B.whole, {{W.dy.get(), d, Dh, Dh}}));
  RETURN_IF_ERROR(cx.ExchangeToGroup(B.whole, cx.W.cp_block.get(), cx.W.cp_tmp.get(), hw,
                                     CommLayer::kLightning));
  void* f = A.cp_full.get();
  void* df = cx.W.cp_block.get();
  KC(kc::LightningBackward(f, At(f, hw), At(f, 2 * hw), L.log_decay + B.rank * Hl, B.cu.i32(),
                           static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                           1.0f / std::sqrt(static_cast<float>(Dh)), {Tf, Hl, Dh, w},
                           cx.W.cp_tmp.get(), nullptr, df, At(df, hw), At(df, 2 * hw), nullptr,
                           kAct, cx.Ws(), cx.stream));
  RETURN_IF_ERROR(cx.ExchangeFromGroup(B.whole, df, f, w, CommLayer::kLightning));
  void* dq = W.dqkv.get();
  return cx.UnpackToTokens(
      B.whole, f,
      {{dq, 3 * d, Dh, Dh}, {At(dq, d), 3 * d, Dh, Dh}, {At(dq, 2 * d), 3 * d, Dh, Dh}});
}

// ---- Context parallelism: AllGather (DESIGN.md section 3) ---------------------------------------

absl::Status CudaLightning::GatherStates(const CpLevel& V, Communicator& comm, const float* send,
                                         int64_t H) {
  const int64_t SZ = H * c.head_dim() * c.head_dim();
  float* recv = W.cp_state_recv.f32();
  CUDA(cudaStreamSynchronize(cx.stream));  // the communicator reads `send` on a stream of its own
  RETURN_IF_ERROR(comm.AllGather(send, 2 * SZ, CommType::kF32, recv, CommLayer::kLightning));
  // Rank r's block s is chunk ZigzagChunk(cp, r, s): into stream order.
  for (int64_t r = 0; r < V.cp; ++r)
    for (int64_t slot = 0; slot < 2; ++slot)
      CUDA(cudaMemcpyAsync(W.cp_state_stream.f32() + ZigzagChunk(V.cp, r, slot) * SZ,
                           recv + (2 * r + slot) * SZ, SZ * 4, cudaMemcpyDeviceToDevice,
                           cx.stream));
  return absl::OkStatus();
}

// Each local chunk runs from a zero state (its output and its end state S_c); the 2cp states are
// gathered and scanned into every chunk's carry-in P_c; a chunk that continues a document adds
// the carry's part to the tokens before its first document start. P is kept for the backward.
absl::Status CudaLightning::StatesForward(const CpLevel& V, Communicator& comm, const void* qkv,
                                          int64_t H, const float* log_decay, void* out, float* P) {
  const int64_t ch = V.chunk, Dh = c.head_dim(), hw = H * Dh, SZ = H * Dh * Dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  float* S = W.cp_state_send.f32();
  for (int slot = 0; slot < 2; ++slot) {
    const void* q = At(qkv, slot * ch * 3 * hw);
    KC(kc::LightningForward(q, At(q, hw), At(q, 2 * hw), log_decay, V.piece_cu[slot].i32(),
                            static_cast<int64_t>(V.piece_cu_host[slot].size()) - 1, nullptr, scale,
                            {ch, H, Dh, 3 * hw}, At(out, slot * ch * hw), S + slot * SZ, kAct,
                            cx.Ws(), cx.stream));
  }
  RETURN_IF_ERROR(GatherStates(V, comm, S, H));
  KC(kc::LightningStateScan(W.cp_state_stream.f32(), V.chunk_has_start.i32(), V.chunk_len.i32(),
                            log_decay, 2 * V.cp, H, Dh, W.cp_state_scan.f32(), cx.stream));
  for (int slot = 0; slot < 2; ++slot) {
    float* Ps = P + slot * SZ;
    CUDA(cudaMemcpyAsync(Ps, W.cp_state_scan.f32() + V.slot_chunk[slot] * SZ, SZ * 4,
                         cudaMemcpyDeviceToDevice, cx.stream));
    if (!V.continues[slot]) continue;
    KC(kc::LightningCarryCorrection(At(qkv, slot * ch * 3 * hw), log_decay, Ps, scale,
                                    {ch, H, Dh, 3 * hw}, V.first_segment[slot],
                                    At(out, slot * ch * hw), kAct, cx.stream));
  }
  return absl::OkStatus();
}

// The carry-ins' gradients from the corrected tokens (dP_c, zero for a chunk that does not
// continue a document) are gathered and reverse-scanned into every chunk's end-state gradient;
// each local chunk's backward then runs with its carry-in and that end-state gradient.
absl::Status CudaLightning::StatesBackward(const CpLevel& V, Communicator& comm, const void* qkv,
                                           int64_t H, const float* log_decay, const float* P,
                                           const void* dout, void* dqkv) {
  const int64_t ch = V.chunk, Dh = c.head_dim(), hw = H * Dh, SZ = H * Dh * Dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  float* dP = W.cp_state_send.f32();
  CUDA(cudaMemsetAsync(dP, 0, 2 * SZ * 4, cx.stream));
  // The correction's backward also adds its dq part into dqkv, which the chunk backward below
  // overwrites (its carry-in accounts for that part): start from zeros so nothing stale is read.
  CUDA(cudaMemsetAsync(dqkv, 0, V.T * 3 * hw * kAb, cx.stream));
  for (int slot = 0; slot < 2; ++slot) {
    if (!V.continues[slot]) continue;
    KC(kc::LightningCarryCorrectionBackward(At(qkv, slot * ch * 3 * hw), log_decay, P + slot * SZ,
                                            scale, {ch, H, Dh, 3 * hw}, V.first_segment[slot],
                                            At(dout, slot * ch * hw), At(dqkv, slot * ch * 3 * hw),
                                            dP + slot * SZ, kAct, cx.Ws(), cx.stream));
  }
  RETURN_IF_ERROR(GatherStates(V, comm, dP, H));
  KC(kc::LightningStateScanBackward(W.cp_state_stream.f32(), V.chunk_has_start.i32(),
                                    V.chunk_len.i32(), log_decay, 2 * V.cp, H, Dh,
                                    W.cp_state_scan.f32(), cx.stream));
  for (int slot = 0; slot < 2; ++slot) {
    const void* q = At(qkv, slot * ch * 3 * hw);
    void* dq = At(dqkv, slot * ch * 3 * hw);
    KC(kc::LightningBackward(q, At(q, hw), At(q, 2 * hw), log_decay, V.piece_cu[slot].i32(),
                             static_cast<int64_t>(V.piece_cu_host[slot].size()) - 1,
                             V.continues[slot] ? P + slot * SZ : nullptr, scale,
                             {ch, H, Dh, 3 * hw}, At(dout, slot * ch * hw),
                             W.cp_state_scan.f32() + V.slot_chunk[slot] * SZ, dq, At(dq, hw),
                             At(dq, 2 * hw), nullptr, kAct, cx.Ws(), cx.stream));
  }
  return absl::OkStatus();
}

absl::Status CudaLightning::AllGatherForward(const LayerIdx& L, LightningCache& C) {
  const int64_t H = c.n_heads, Dh = c.head_dim();
  RETURN_IF_ERROR(cx.F32(C.cp_P, 2 * H * Dh * Dh));
  return StatesForward(B.lv, *cx.cp.comm, C.qkv_n.get(), H, L.log_decay, C.o.get(), C.cp_P.f32());
}

// Reads d o from W.dy, writes dq, dk, dv into W.dqkv.
absl::Status CudaLightning::AllGatherBackward(const LayerIdx& L, LightningCache& C) {
  return StatesBackward(B.lv, *cx.cp.comm, C.qkv_n.get(), c.n_heads, L.log_decay, C.cp_P.f32(),
                        W.dy.get(), W.dqkv.get());
}

// ---- Context parallelism: hybrid (DESIGN.md section 3) ------------------------------------------

absl::Status CudaLightning::HybridForward(const LayerIdx& L, LayerActs& A, LightningCache& C) {
  const int64_t d = c.d_model, Dh = c.head_dim(), u = B.ulysses.members, Hl = c.n_heads / u;
  const int64_t hw = Hl * Dh, w = 3 * hw, Tg = B.group_lv.T;
  const int64_t member = CpGroups{B.cp, u}.Member(B.rank);
  RETURN_IF_ERROR(cx.Act(A.cp_full, Tg, w));
  RETURN_IF_ERROR(cx.F32(C.cp_P, 2 * hw * Dh));
  void* q = C.qkv_n.get();
  RETURN_IF_ERROR(cx.PackByHeads(
      B.ulysses, {{q, 3 * d, Dh, Dh}, {At(q, d), 3 * d, Dh, Dh}, {At(q, 2 * d), 3 * d, Dh, Dh}}));
  RETURN_IF_ERROR(cx.ExchangeToGroup(B.ulysses, cx.W.cp_block.get(), A.cp_full.get(), w,
                                     CommLayer::kLightning));
  RETURN_IF_ERROR(StatesForward(B.group_lv, *cx.cp.ring, A.cp_full.get(), Hl,
                                L.log_decay + member * Hl, cx.W.cp_tmp.get(), C.cp_P.f32()));
  RETURN_IF_ERROR(cx.ExchangeFromGroup(B.ulysses, cx.W.cp_tmp.get(), cx.W.cp_block.get(), hw,
                                       CommLayer::kLightning));
  return cx.UnpackToTokens(B.ulysses, cx.W.cp_block.get(), {{C.o.get(), d, Dh, Dh}});
}

// d o (W.dy) to the group's tokens (W.cp_tmp), the core's backward into W.cp_block (free once d o
// is received), the gradients back (received into A.cp_full, whose last reader the core's
// backward was) into W.dqkv.
absl::Status CudaLightning::HybridBackward(const LayerIdx& L, LayerActs& A, LightningCache& C) {
  const int64_t d = c.d_model, Dh = c.head_dim(), u = B.ulysses.members, Hl = c.n_heads / u;
  const int64_t hw = Hl * Dh, w = 3 * hw;
  const int64_t member = CpGroups{B.cp, u}.Member(B.rank);
  RETURN_IF_ERROR(cx.PackByHeads(B.ulysses, {{W.dy.get(), d, Dh, Dh}}));
  RETURN_IF_ERROR(cx.ExchangeToGroup(B.ulysses, cx.W.cp_block.get(), cx.W.cp_tmp.get(), hw,
                                     CommLayer::kLightning));
  RETURN_IF_ERROR(StatesBackward(B.group_lv, *cx.cp.ring, A.cp_full.get(), Hl,
                                 L.log_decay + member * Hl, C.cp_P.f32(), cx.W.cp_tmp.get(),
                                 cx.W.cp_block.get()));
  RETURN_IF_ERROR(cx.ExchangeFromGroup(B.ulysses, cx.W.cp_block.get(), A.cp_full.get(), w,
                                       CommLayer::kLightning));
  void* dq = W.dqkv.get();
  return cx.UnpackToTokens(
      B.ulysses, A.cp_full.get(),
      {{dq, 3 * d, Dh, Dh}, {At(dq, d), 3 * d, Dh, Dh}, {At(dq, 2 * d), 3 * d, Dh, Dh}});
}

// ---- Memory

KindFields CudaLightning::CacheFields(LayerActs& A, LightningCache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Hl = H / B.cp;
  // Under All2All both families hold their core's head-split inputs in A.cp_full, at their own
  // width (as a field of both it is one family's at a time, like the rest; outside the arena it
  // grew from one width to the other and the allocator kept the first block unused).
  const int64_t full_rows = B.cp > 1 ? B.T_full : 0;
  // The forward's kept block states: cp = 1 only.
  const int64_t kept =
      B.cp == 1 ? static_cast<int64_t>(kc::LightningSavedBytes({T, H, c.head_dim(), 3 * d})) : 0;
  const int64_t full = cx.LightningAllGather() ? 0 : full_rows * 3 * Hl * c.head_dim() * kAb;
  return {{&C.qkv_raw, T * 3 * d * kAb},
          {&C.qkv_n, T * 3 * d * kAb},
          {&C.gate, T * d * kAb},
          {&C.o, T * d * kAb},
          {&C.y, cx.fp8 ? 0 : T * d * kAb},
          {&C.rstd_q, T * H * 4},
          {&C.rstd_k, T * H * 4},
          {&C.rstd_o, T * H * 4},
          {&C.lstates, kept},
          {&A.cp_full, full}};
}

KindFields CudaLightning::WorkFields() {
  const int64_t T = B.T, d = c.d_model;
  return {{&W.dy, T * d * kAb}, {&W.dgate, T * d * kAb}, {&W.dqkv, T * 3 * d * kAb}};
}

absl::Status CudaLightning::SizeCpScratch(const CpLayout& L, size_t* need) {
  const int64_t H = c.n_heads, Dh = c.head_dim(), Hl = H / B.cp, Tf = B.T_full;
  const bool has_lt = c.NumLayersOfKind('L') > 0;
  if (has_lt && cx.cp.lightning_mode == CpMode::kAll2All)
    *need = std::max(*need, kc::LightningWorkspaceBytes({Tf, Hl, Dh, 3 * Hl * Dh}));
  // The AllGather core runs on each local chunk of its level and the carry correction's backward
  // on each continuing chunk's first segment; a shorter sequence can need more workspace than a
  // longer one (its blocks of chunks are shorter), so each size counts.
  const CpLevel* lightning_level = cx.LightningAllGather() ? &B.lv
                                   : cx.LightningHybrid()  ? &B.group_lv
                                                           : nullptr;
  const int64_t lh = cx.LightningHybrid() ? H / L.ulysses : H;  // its heads
  if (has_lt && lightning_level) {
    const CpLevel& V = *lightning_level;
    const int64_t stride = 3 * lh * Dh;
    *need = std::max(*need, kc::LightningWorkspaceBytes({V.chunk, lh, Dh, stride}));
    for (int slot = 0; slot < 2; ++slot)
      if (V.continues[slot])
        *need =
            std::max(*need, kc::LightningWorkspaceBytes({V.first_segment[slot], lh, Dh, stride}));
  }
  const int64_t SZ = H * Dh * Dh;
  RETURN_IF_ERROR(cx.F32(W.cp_state_send, 2 * SZ));
  for (DevBuf* x : {&W.cp_state_recv, &W.cp_state_stream, &W.cp_state_scan})
    RETURN_IF_ERROR(cx.F32(*x, 2 * B.cp * SZ));
  return absl::OkStatus();
}

}  // namespace cuda_model_detail
}  // namespace spindle
