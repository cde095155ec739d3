// The CUDA model's MLA attention family (cuda_mla.h): one layer's block following
// worker/engine/model.cc step for step, the attention's backward in groups of heads, and the
// family's buffers. Its context-parallel attention is cuda_mla_cp.cc's and cuda_mla_ring.cc's.
#include "worker/engine/cuda/cuda_mla.h"

namespace spindle {
namespace cuda_model_detail {

absl::Status CudaMla::Forward(const LayerIdx& L, LayerActs& A, MlaCache& C, const void* x_in,
                              bool attention_kept, bool transposes, bool requantize) {
  const int64_t T = B.T, d = c.d_model;
  RETURN_IF_ERROR(Attention(L, A, C, attention_kept));
  const int64_t hv = c.n_heads * c.mla.v_head_dim;
  if (cx.fp8) {  // the attention's output has no producer of ours to fuse the cast into
    RETURN_IF_ERROR(cx.QAct(C.q_O, T, hv));
    if (cx.fp8_blockwise) {  // from the stored bf16, in one pass (recomputed or not)
      KC(kc::Fp8QuantizeBlockwise(C.O.get(), T, hv, kAct, cx.QBlockOut(C.q_O, transposes),
                                  cx.stream));
    } else {
      const kc::Fp8Output q = cx.QOut(C.q_O, transposes, A, kSiteO);
      KC(requantize ? kc::Fp8QuantizeFromAmax(C.O.get(), T, hv, kAct, q, cx.stream)
                    : kc::Fp8Quantize(C.O.get(), T, hv, kAct, q, cx.stream));
    }
    RETURN_IF_ERROR(cx.FwdQ(C.q_O, L.mo, A.x_mid.get(), T, hv, d, true, x_in));
  } else {
    RETURN_IF_ERROR(cx.Fwd(C.O.get(), hv, cx.Wb(L.mo), A.x_mid.get(), T, hv, d, true, x_in));
  }
  return absl::OkStatus();
}

absl::Status CudaMla::Attention(const LayerIdx& L, LayerActs& A, MlaCache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(cx.Act(C.Q, T, H * qk));
  if (m.q_lora_rank > 0) {
    const int64_t qr = m.q_lora_rank;
    RETURN_IF_ERROR(cx.Act(C.qa, T, qr));
    RETURN_IF_ERROR(cx.Act(C.qa_n, T, qr));
    RETURN_IF_ERROR(cx.F32(C.rstd_qa, T));
    RETURN_IF_ERROR(cx.fp8 ? cx.FwdQ(A.q_h, L.q_a, C.qa.get(), T, d, qr, false)
                           : cx.Fwd(A.h.get(), d, cx.Wb(L.q_a), C.qa.get(), T, d, qr, false));
    KC(kc::RmsNormForward(C.qa.get(), cx.Wb(L.q_a_norm), C.qa_n.get(), C.rstd_qa.f32(), T, qr, eps,
                          kAct, cx.stream));
    RETURN_IF_ERROR(cx.Fwd(C.qa_n.get(), qr, cx.Wb(L.q_b), C.Q.get(), T, qr, H * qk, false));
  } else {
    RETURN_IF_ERROR(cx.Fwd(A.h.get(), d, cx.Wb(L.q), C.Q.get(), T, d, H * qk, false));
  }
  KC(kc::RopeApply(At(C.Q.get(), nope), B.pos.i32(), T, H, rd, H * qk, qk, theta, false, kAct,
                   cx.stream));
  RETURN_IF_ERROR(cx.Act(C.kva, T, kv + rd));
  RETURN_IF_ERROR(cx.Act(C.c, T, kv));
  RETURN_IF_ERROR(cx.Act(C.c_n, T, kv));
  RETURN_IF_ERROR(cx.F32(C.rstd_c, T));
  RETURN_IF_ERROR(cx.fp8 ? cx.FwdQ(A.q_h, L.kv_a, C.kva.get(), T, d, kv + rd, false)
                         : cx.Fwd(A.h.get(), d, cx.Wb(L.kv_a), C.kva.get(), T, d, kv + rd, false));
  RETURN_IF_ERROR(cx.Copy2D(C.c.get(), kv, C.kva.get(), kv + rd, kv, T));
  KC(kc::RmsNormForward(C.c.get(), cx.Wb(L.kv_norm), C.c_n.get(), C.rstd_c.f32(), T, kv, eps, kAct,
                        cx.stream));
  // The shared rotary key, rotated in place inside kva.
  KC(kc::RopeApply(At(C.kva.get(), kv), B.pos.i32(), T, 1, rd, kv + rd, rd, theta, false, kAct,
                   cx.stream));
  if (cx.MlaLatentKeys()) {
    RETURN_IF_ERROR(cx.Act(C.O, T, H * vd));
    if (cx.MlaRing()) return RingModeForward(L, C, attention_kept);
    if (cx.MlaHybrid()) return HybridForward(L, A, C, attention_kept);
    return AllGatherForward(L, C, attention_kept);
  }
  RETURN_IF_ERROR(cx.Act(C.kvb, T, H * (nope + vd)));
  RETURN_IF_ERROR(
      cx.Fwd(C.c_n.get(), kv, cx.Wb(L.kv_b), C.kvb.get(), T, kv, H * (nope + vd), false));
  // K = [k_nope of each head, the shared rotary key].
  RETURN_IF_ERROR(cx.Act(C.K, T, H * qk));
  RETURN_IF_ERROR(cx.Copy2D(C.K.get(), qk, C.kvb.get(), nope + vd, nope, T * H));
  KC(kc::CopyRows(At(C.K.get(), nope), H * qk, qk, At(C.kva.get(), kv), kv + rd, 0, T, H, rd, kAct,
                  cx.stream));
  RETURN_IF_ERROR(cx.Act(C.O, T, H * vd));
  if (B.cp > 1) return CoreForward(A, C, attention_kept);
  RETURN_IF_ERROR(cx.F32(C.stats, H * T));
  if (attention_kept) return absl::OkStatus();
  const kc::SdpaDims dims = MlaDims(c, T);
  KC(sdpa->Forward(C.Q.get(), C.K.get(), At(C.kvb.get(), nope), C.O.get(), C.stats.f32(),
                   B.cu_host.data(), static_cast<int64_t>(B.cu_host.size()) - 1,
                   1.0f / std::sqrt(static_cast<float>(qk)), dims, kAct, cx.stream));
  return absl::OkStatus();
}

int64_t CudaMla::GradHeadsPerGroup() const {
  const int64_t H = c.n_heads;
  if (cx.MlaLatentKeys()) return H;
  if (mla_grad_heads_per_group == 0) return CudaMlaGradHeadsPerGroup(c, B.T, B.cp);
  // All2All: a rank's block of heads, or all of them.
  if (B.cp > 1) return mla_grad_heads_per_group >= H ? H : H / B.cp;
  return LargestDivisorAtMost(H, mla_grad_heads_per_group);
}

absl::Status CudaMla::GroupAttentionBackward(MlaCache& C, int64_t h0, int64_t Hg) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, nope = m.qk_nope_dim, vd = m.v_head_dim;
  const int64_t qk = nope + m.qk_rope_dim, kvw = nope + vd;
  kc::SdpaDims dims = MlaDims(c, T);
  const void *q = C.Q.get(), *k = C.K.get(), *kvb = C.kvb.get();
  if (Hg < H) {
    RETURN_IF_ERROR(cx.Copy2D(W.gQ.get(), Hg * qk, At(q, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(cx.Copy2D(W.gK.get(), Hg * qk, At(k, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(cx.Copy2D(W.gkvb.get(), Hg * kvw, At(kvb, h0 * kvw), H * kvw, Hg * kvw, T));
    q = W.gQ.get(), k = W.gK.get(), kvb = W.gkvb.get();
    dims.H = Hg;
    dims.q = dims.k = {Hg * qk, qk};
    dims.v = {Hg * kvw, kvw};
  }
  return AttentionBackward(q, k, At(kvb, nope), At(C.O.get(), h0 * vd), C.stats.f32() + h0 * T,
                           At(W.dO.get(), h0 * vd), W.dQ.get(), W.dK.get(), At(W.dkvb.get(), nope),
                           B.cu_host, 1.0f / std::sqrt(static_cast<float>(qk)), dims);
}

absl::Status CudaMla::QueryGrads(const LayerIdx& L, LayerActs& A, MlaCache& C, int64_t h0,
                                 int64_t Hg, Rows dx) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  KC(kc::RopeApply(At(W.dQ.get(), nope), B.pos.i32(), T, Hg, rd, Hg * qk, qk,
                   static_cast<float>(c.rope_theta), true, kAct, cx.stream));
  const bool lora = m.q_lora_rank > 0;
  const int64_t in = lora ? m.q_lora_rank : d, rows = h0 * qk * in;  // the weight's rows
  const int w = lora ? L.q_b : L.q;
  RETURN_IF_ERROR(cx.Bwd(lora ? C.qa_n.get() : A.h.get(), in, At(cx.Wb(w), rows), W.dQ.get(),
                         nullptr, cx.G(w) + rows, T, in, Hg * qk, false));
  return cx.InputGrad(W.dQ.get(), At(cx.Wb(w), rows), dx, T, in, Hg * qk);
}

// The attention's gradients, at cp = 1 and under All2All in groups of heads (GradHeadsPerGroup;
// under All2All a group is a rank's block of the exchanged gradients), each group's taken back
// through kv_b and q_b (or q) at once; the latent's and q_a's gradients add up over the
// groups in fp32 (W.sum_lat, W.sum_q) when there are several, else go to W.dkva and W.dqa_n (or
// W.dh) directly. Then the shared tail: kv_norm, kv_a, q_a.
absl::Status CudaMla::Backward(const LayerIdx& L, LayerActs& A, MlaCache& C, const void* dout) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd, kvw = nope + vd, qr = m.q_lora_rank;
  const int64_t Hg = GradHeadsPerGroup(), dqw = qr > 0 ? qr : d;
  const bool grouped = Hg < H;
  const float theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(cx.Act(W.dO, T, H * vd));
  RETURN_IF_ERROR(cx.Act(W.dQ, T, Hg * qk));
  RETURN_IF_ERROR(cx.Act(W.dK, T, Hg * qk));
  RETURN_IF_ERROR(cx.Act(W.dkvb, T, Hg * kvw));
  RETURN_IF_ERROR(cx.Act(W.dkva, T, w));
  RETURN_IF_ERROR(cx.Act(W.dc_n, T, kv));
  RETURN_IF_ERROR(cx.Act(W.dc, T, kv));
  if (qr > 0) {
    RETURN_IF_ERROR(cx.Act(W.dqa_n, T, qr));
    RETURN_IF_ERROR(cx.Act(W.dqa, T, qr));
  }
  // q's input gradient: the normed q_a output, or without a q LoRA the normed input (which kv_a's
  // gradient then adds to).
  Rows dq_in{qr > 0 ? W.dqa_n.get() : cx.W.dh.get(), dqw};
  RETURN_IF_ERROR(cx.fp8 ? cx.BwdQ(C.q_O, L.mo, dout, W.dO.get(), cx.G(L.mo), T, H * vd, d, false,
                                   cx.GradAmax(Work::kAmaxDx))
                         : cx.Bwd(C.O.get(), H * vd, cx.Wb(L.mo), dout, W.dO.get(), cx.G(L.mo), T,
                                  H * vd, d, false));
  if (cx.MlaLatentKeys()) {
    // The latent gradients [d c_n | d k_r (rotated)] of this rank's tokens into W.dkva, dQ into
    // W.dQ; dW_kv_b accumulated over the gathered (or passed) keys.
    RETURN_IF_ERROR(cx.MlaRing()     ? RingModeBackward(L, C)
                    : cx.MlaHybrid() ? HybridBackward(L, A, C)
                                     : AllGatherBackward(L, C));
    RETURN_IF_ERROR(QueryGrads(L, A, C, 0, H, dq_in));
  } else {
    Rows lat{W.dkva.get(), w};
    if (grouped && B.cp == 1) {
      for (DevBuf* b : {&W.gQ, &W.gK}) RETURN_IF_ERROR(cx.Act(*b, T, Hg * qk));
      RETURN_IF_ERROR(cx.Act(W.gkvb, T, Hg * kvw));
    }
    if (grouped) {
      RETURN_IF_ERROR(cx.F32(W.sum_lat, T * w));
      RETURN_IF_ERROR(cx.F32(W.sum_q, T * dqw));
      CUDA(cudaMemsetAsync(W.sum_lat.get(), 0, T * w * 4, cx.stream));
      CUDA(cudaMemsetAsync(W.sum_q.get(), 0, T * dqw * 4, cx.stream));
      lat = {W.sum_lat.get(), w, KDType::kFloat32, true};
      dq_in = {W.sum_q.get(), dqw, KDType::kFloat32, true};
    }
    if (B.cp > 1) RETURN_IF_ERROR(CoreBackward(A, C));
    for (int64_t h0 = 0; h0 < H; h0 += Hg) {
      if (B.cp == 1) {
        RETURN_IF_ERROR(GroupAttentionBackward(C, h0, Hg));
      } else {  // the group's ranks' blocks of the received gradients (one, or all of them)
        const int64_t Hl = H / B.cp;
        RETURN_IF_ERROR(UnpackGrads(A.cp_full.get(), Hg, h0 / Hl, (h0 + Hg) / Hl));
      }
      RETURN_IF_ERROR(
          KeyGradsToLatentRows(L, C.c_n.get(), kv, W.dK.get(), W.dkvb.get(), T, h0, Hg, lat));
      RETURN_IF_ERROR(QueryGrads(L, A, C, h0, Hg, dq_in));
    }
    if (grouped) {
      KC(kc::CastRows(W.dkva.get(), kAct, w, W.sum_lat.get(), KDType::kFloat32, w, T, w,
                      cx.stream));
      if (qr > 0)
        KC(kc::CastRows(W.dqa_n.get(), kAct, qr, W.sum_q.get(), KDType::kFloat32, qr, T, qr,
                        cx.stream));
    }
  }
  RETURN_IF_ERROR(cx.Copy2D(W.dc_n.get(), kv, W.dkva.get(), w, kv, T));
  KC(kc::RmsNormBackward(C.c.get(), cx.Wb(L.kv_norm), C.rstd_c.f32(), W.dc_n.get(), nullptr,
                         W.dc.get(), cx.G(L.kv_norm), T, kv, kAct, cx.Ws(), cx.stream));
  RETURN_IF_ERROR(cx.Copy2D(W.dkva.get(), w, W.dc.get(), kv, kv, T));
  KC(kc::RopeApply(At(W.dkva.get(), kv), B.pos.i32(), T, 1, rd, w, rd, theta, true, kAct,
                   cx.stream));
  // Without a q LoRA, q's gradient is in W.dh already (one group) or in W.sum_q.
  const bool q_in_dh = qr == 0 && dq_in.type == kAct;
  RETURN_IF_ERROR(
      cx.fp8 ? cx.BwdQ(A.q_h, L.kv_a, W.dkva.get(), cx.W.dh.get(), cx.G(L.kv_a), T, d, w, q_in_dh)
             : cx.Bwd(A.h.get(), d, cx.Wb(L.kv_a), W.dkva.get(), cx.W.dh.get(), cx.G(L.kv_a), T, d,
                      w, q_in_dh));
  if (qr == 0) {
    if (!q_in_dh)
      KC(kc::CastRows(cx.W.dh.get(), kAct, d, W.sum_q.get(), KDType::kFloat32, d, T, d, cx.stream,
                      /*accumulate=*/true));
    return absl::OkStatus();
  }
  KC(kc::RmsNormBackward(C.qa.get(), cx.Wb(L.q_a_norm), C.rstd_qa.f32(), W.dqa_n.get(), nullptr,
                         W.dqa.get(), cx.G(L.q_a_norm), T, qr, kAct, cx.Ws(), cx.stream));
  if (cx.fp8) return cx.BwdQ(A.q_h, L.q_a, W.dqa.get(), cx.W.dh.get(), cx.G(L.q_a), T, d, qr, true);
  return cx.Bwd(A.h.get(), d, cx.Wb(L.q_a), W.dqa.get(), cx.W.dh.get(), cx.G(L.q_a), T, d, qr,
                true);
}

absl::Status CudaMla::AttentionBackward(const void* q, const void* k, const void* v, const void* o,
                                        const float* stats, const void* dout, void* dq, void* dk,
                                        void* dv, const std::vector<int32_t>& cu_host, float scale,
                                        kc::SdpaDims dims) {
  const int64_t H = dims.H, T = dims.T;
  const int64_t g = attention_heads_per_call > 0 ? LargestDivisorAtMost(H, attention_heads_per_call)
                                                 : CudaAttentionHeadsPerCall(T, H, dims.Dqk);
  dims.H = g;
  const int64_t n_seg = static_cast<int64_t>(cu_host.size()) - 1;
  for (int64_t h0 = 0; h0 < H; h0 += g) {
    KC(sdpa->Backward(At(q, h0 * dims.q.head_stride), At(k, h0 * dims.k.head_stride),
                      At(v, h0 * dims.v.head_stride), At(o, h0 * dims.out.head_stride),
                      stats + h0 * T, At(dout, h0 * dims.out.head_stride),
                      At(dq, h0 * dims.q.head_stride), At(dk, h0 * dims.k.head_stride),
                      At(dv, h0 * dims.v.head_stride), cu_host.data(), n_seg, scale, dims, kAct,
                      cx.stream));
  }
  return absl::OkStatus();
}

// ---- Memory ------------------------------------------------------------------------------------

KindFields CudaMla::CacheFields(LayerActs& A, MlaCache& C) {
  const int64_t T = B.T, H = c.n_heads, Hl = H / B.cp;
  // Under All2All both families hold their core's head-split inputs in A.cp_full, at their own
  // width (see CudaLightning::CacheFields).
  const int64_t full_rows = B.cp > 1 ? B.T_full : 0;
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, kv = m.kv_lora_rank, qr = m.q_lora_rank;
  // q_a and its norm only with a q LoRA; kv_b's output and K are rebuilt per key block under
  // MLA AllGather and Ring (Work's ag_kvb, ag_K).
  const int64_t q_lora = qr > 0 ? T : 0, keys = cx.MlaLatentKeys() ? 0 : T;
  // Under MLA hybrid cp_full holds the group's queries for this member's heads (T H qk a rank).
  const int64_t full = cx.MlaHybrid()       ? T * H * qk * kAb
                       : cx.MlaLatentKeys() ? 0
                                            : full_rows * Hl * (2 * qk + m.v_head_dim) * kAb;
  return {{&A.cp_full, full},
          {&C.Q, T * H * qk * kAb},
          {&C.kva, T * (kv + m.qk_rope_dim) * kAb},
          {&C.c, T * kv * kAb},
          {&C.c_n, T * kv * kAb},
          {&C.rstd_c, T * 4},
          {&C.qa, q_lora * qr * kAb},
          {&C.qa_n, q_lora * qr * kAb},
          {&C.rstd_qa, q_lora * 4},
          {&C.kvb, keys * H * (m.qk_nope_dim + m.v_head_dim) * kAb},
          {&C.K, keys * H * qk * kAb}};
}

KindFields CudaMla::WorkFields() {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, kv = m.kv_lora_rank, qr = m.q_lora_rank;
  const int64_t kvw = m.qk_nope_dim + m.v_head_dim, w = kv + m.qk_rope_dim;
  // In head groups: a group's gradients, the copies of its inputs and the fp32 sums.
  // (Under All2All the groups read the received blocks: no copies.)
  const int64_t Hg = GradHeadsPerGroup(), groups = Hg < H ? T : 0;
  const int64_t copies = B.cp == 1 ? groups : 0;
  return {{&W.dO, T * H * m.v_head_dim * kAb},
          {&W.dQ, T * Hg * qk * kAb},
          {&W.dK, T * Hg * qk * kAb},
          {&W.dkvb, T * Hg * kvw * kAb},
          {&W.gQ, copies * Hg * qk * kAb},
          {&W.gK, copies * Hg * qk * kAb},
          {&W.gkvb, copies * Hg * kvw * kAb},
          {&W.sum_lat, groups * w * 4},
          {&W.sum_q, groups * (qr > 0 ? qr : d) * 4},
          {&W.dkva, T * w * kAb},
          {&W.dc_n, T * kv * kAb},
          {&W.dc, T * kv * kAb},
          {&W.dqa_n, T * qr * kAb},
          {&W.dqa, T * qr * kAb}};
}

absl::Status CudaMla::SizeCpScratch(const CpLayout& L) {
  const int64_t T = B.T, H = c.n_heads;
  const int64_t qk = c.mla.qk_nope_dim + c.mla.qk_rope_dim, vd = c.mla.v_head_dim;
  const bool has_m = c.NumLayersOfKind('M') > 0, has_m_hy = has_m && cx.MlaHybrid();
  // MLA AllGather: the latent gather (bf16 [cp, T, w]) and the gradients' fp32 reduce-scatter
  // ([cp, T, w] in, [T, w] out) share two device blocks; MLA hybrid the same over its Ulysses
  // group. MLA Ring and hybrid: the ring's blocks in flight and gradient accumulators, at the
  // ring level's tokens. All rebuild keys per key block of their level.
  const int64_t lat_w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  const int64_t gather_ranks = cx.cp.mla_mode == CpMode::kAllGather ? B.cp
                               : has_m_hy                           ? L.ulysses
                                                                    : 0;
  if (has_m && gather_ranks > 0) {
    RETURN_IF_ERROR(W.ag_send.Ensure(&cx.alloc, gather_ranks * T * lat_w * 4));
    RETURN_IF_ERROR(W.ag_recv.Ensure(&cx.alloc, gather_ranks * T * lat_w * 4));
  }
  const CpLevel& mla_level = has_m_hy ? B.group_lv : B.lv;
  if (has_m && (cx.MlaRing() || has_m_hy)) {
    // The payload's width: the latent's, or the keys' and values' of the heads a rank computes.
    const int64_t ring_w =
        MlaRingPayloadWidth(c.mla, cx.cp.mla_payload, has_m_hy ? H / L.ulysses : H);
    for (DevBuf& x : W.ring_block) RETURN_IF_ERROR(cx.Act(x, mla_level.T, ring_w));
    for (DevBuf* x : {&W.ring_acc[0], &W.ring_acc[1], &W.ring_share, &W.ring_own})
      RETURN_IF_ERROR(cx.F32(*x, mla_level.T * ring_w));
  }
  if (has_m && cx.MlaLatentKeys()) {
    const int64_t ch = mla_level.chunk;
    const int64_t rows = std::max(ch, kCudaMlaKeyBlock);
    const int64_t kvw = c.mla.qk_nope_dim + vd;
    for (DevBuf* x : {&W.ag_K, &W.ag_dK}) RETURN_IF_ERROR(cx.Act(*x, rows, H * qk));
    for (DevBuf* x : {&W.ag_kvb, &W.ag_dkvb}) RETURN_IF_ERROR(cx.Act(*x, rows, H * kvw));
    RETURN_IF_ERROR(cx.Act(W.ag_dlat, rows, lat_w));
    // The cross piece's per-block output, dq and statistics: one query block's.
    const int64_t qrows = std::min(ch, kCudaMlaKeyBlock);
    RETURN_IF_ERROR(cx.Act(W.ag_o, qrows, H * vd));
    RETURN_IF_ERROR(cx.Act(W.ag_dq, qrows, H * qk));
    RETURN_IF_ERROR(cx.F32(W.ag_acc, (cx.MlaAllGather() ? 1 : 2) * ch * H * vd));
    RETURN_IF_ERROR(cx.F32(W.ag_stats, StatsSlot(H, qrows)));
  }
  return absl::OkStatus();
}

void CudaMla::Release() {
  for (DevBuf* b : {&W.dO, &W.dQ, &W.dK, &W.dkvb, &W.dc_n, &W.dc, &W.dkva, &W.dqa_n, &W.dqa})
    b->Release();
  for (DevBuf* b : {&W.gQ, &W.gK, &W.gkvb, &W.sum_lat, &W.sum_q}) b->Release();
  for (DevBuf* b : {&W.ag_send, &W.ag_recv, &W.ag_K, &W.ag_kvb, &W.ag_dK, &W.ag_dkvb, &W.ag_dlat})
    b->Release();
  for (DevBuf* b : {&W.ag_o, &W.ag_stats, &W.ag_acc, &W.ag_dq, &W.ring_share, &W.ring_own})
    b->Release();
  for (DevBuf& b : W.ring_block) b.Release();
  for (DevBuf& b : W.ring_acc) b.Release();
}

}  // namespace cuda_model_detail
}  // namespace spindle
