// CudaModel's layers (see cuda_model.h): Lightning and MLA forward and backward, the FFN and one
// layer's residual structure, following worker/engine/model.cc step for step.
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

// ---- MLA -----------------------------------------------------------------------------------------

absl::Status CudaModel::Impl::MlaForward(const LayerIdx& L, Cache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(Act(C.Q, T, H * qk));
  if (m.q_lora_rank > 0) {
    const int64_t qr = m.q_lora_rank;
    RETURN_IF_ERROR(Act(C.qa, T, qr));
    RETURN_IF_ERROR(Act(C.qa_n, T, qr));
    RETURN_IF_ERROR(F32(C.rstd_qa, T));
    RETURN_IF_ERROR(fp8 ? FwdQ(C.q_h, L.q_a, C.qa.get(), T, d, qr, false)
                        : Fwd(C.h.get(), d, Wb(L.q_a), C.qa.get(), T, d, qr, false));
    KC(kc::RmsNormForward(C.qa.get(), Wb(L.q_a_norm), C.qa_n.get(), C.rstd_qa.f32(), T, qr, eps,
                          kAct, stream));
    RETURN_IF_ERROR(Fwd(C.qa_n.get(), qr, Wb(L.q_b), C.Q.get(), T, qr, H * qk, false));
  } else {
    RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.q), C.Q.get(), T, d, H * qk, false));
  }
  KC(kc::RopeApply(At(C.Q.get(), nope), B.pos.i32(), T, H, rd, H * qk, qk, theta, false, kAct,
                   stream));
  RETURN_IF_ERROR(Act(C.kva, T, kv + rd));
  RETURN_IF_ERROR(Act(C.c, T, kv));
  RETURN_IF_ERROR(Act(C.c_n, T, kv));
  RETURN_IF_ERROR(F32(C.rstd_c, T));
  RETURN_IF_ERROR(fp8 ? FwdQ(C.q_h, L.kv_a, C.kva.get(), T, d, kv + rd, false)
                      : Fwd(C.h.get(), d, Wb(L.kv_a), C.kva.get(), T, d, kv + rd, false));
  RETURN_IF_ERROR(Copy2D(C.c.get(), kv, C.kva.get(), kv + rd, kv, T));
  KC(kc::RmsNormForward(C.c.get(), Wb(L.kv_norm), C.c_n.get(), C.rstd_c.f32(), T, kv, eps, kAct,
                        stream));
  // The shared rotary key, rotated in place inside kva.
  KC(kc::RopeApply(At(C.kva.get(), kv), B.pos.i32(), T, 1, rd, kv + rd, rd, theta, false, kAct,
                   stream));
  if (MlaLatentKeys()) {
    RETURN_IF_ERROR(Act(C.O, T, H * vd));
    if (MlaRing()) return MlaRingForward(L, C, attention_kept);
    if (MlaHybrid()) return MlaHybridForward(L, C, attention_kept);
    return MlaAllGatherForward(L, C, attention_kept);
  }
  RETURN_IF_ERROR(Act(C.kvb, T, H * (nope + vd)));
  RETURN_IF_ERROR(Fwd(C.c_n.get(), kv, Wb(L.kv_b), C.kvb.get(), T, kv, H * (nope + vd), false));
  // K = [k_nope of each head, the shared rotary key].
  RETURN_IF_ERROR(Act(C.K, T, H * qk));
  RETURN_IF_ERROR(Copy2D(C.K.get(), qk, C.kvb.get(), nope + vd, nope, T * H));
  KC(kc::CopyRows(At(C.K.get(), nope), H * qk, qk, At(C.kva.get(), kv), kv + rd, 0, T, H, rd,
                  kAct, stream));
  RETURN_IF_ERROR(Act(C.O, T, H * vd));
  if (B.cp > 1) return MlaCoreForward(C, attention_kept);
  RETURN_IF_ERROR(F32(C.stats, H * T));
  if (attention_kept) return absl::OkStatus();
  const kc::SdpaDims dims = MlaDims(c, T);
  KC(sdpa->Forward(C.Q.get(), C.K.get(), At(C.kvb.get(), nope), C.O.get(), C.stats.f32(),
                   B.cu_host.data(), static_cast<int64_t>(B.cu_host.size()) - 1,
                   1.0f / std::sqrt(static_cast<float>(qk)), dims, kAct, stream));
  return absl::OkStatus();
}

int64_t CudaModel::Impl::MlaGradHeadsPerGroup() const {
  const int64_t H = c.n_heads;
  if (MlaLatentKeys()) return H;
  if (mla_grad_heads_per_group == 0) return CudaMlaGradHeadsPerGroup(c, B.T, B.cp);
  // All2All: a rank's block of heads, or all of them.
  if (B.cp > 1) return mla_grad_heads_per_group >= H ? H : H / B.cp;
  return LargestDivisorAtMost(H, mla_grad_heads_per_group);
}

absl::Status CudaModel::Impl::MlaGroupAttentionBackward(Cache& C, int64_t h0, int64_t Hg) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, nope = m.qk_nope_dim, vd = m.v_head_dim;
  const int64_t qk = nope + m.qk_rope_dim, kvw = nope + vd;
  kc::SdpaDims dims = MlaDims(c, T);
  const void *q = C.Q.get(), *k = C.K.get(), *kvb = C.kvb.get();
  if (Hg < H) {
    RETURN_IF_ERROR(Copy2D(W.gQ.get(), Hg * qk, At(q, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(Copy2D(W.gK.get(), Hg * qk, At(k, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(Copy2D(W.gkvb.get(), Hg * kvw, At(kvb, h0 * kvw), H * kvw, Hg * kvw, T));
    q = W.gQ.get(), k = W.gK.get(), kvb = W.gkvb.get();
    dims.H = Hg;
    dims.q = dims.k = {Hg * qk, qk};
    dims.v = {Hg * kvw, kvw};
  }
  return AttentionBackward(q, k, At(kvb, nope), At(C.O.get(), h0 * vd), C.stats.f32() + h0 * T,
                           At(W.dO.get(), h0 * vd), W.dQ.get(), W.dK.get(), At(W.dkvb.get(), nope),
                           B.cu_host, 1.0f / std::sqrt(static_cast<float>(qk)), dims);
}

absl::Status CudaModel::Impl::MlaQueryGrads(const LayerIdx& L, Cache& C, int64_t h0, int64_t Hg,
                                            Rows dx) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  KC(kc::RopeApply(At(W.dQ.get(), nope), B.pos.i32(), T, Hg, rd, Hg * qk, qk,
                   static_cast<float>(c.rope_theta), true, kAct, stream));
  const bool lora = m.q_lora_rank > 0;
  const int64_t in = lora ? m.q_lora_rank : d, rows = h0 * qk * in;  // the weight's rows
  const int w = lora ? L.q_b : L.q;
  RETURN_IF_ERROR(Bwd(lora ? C.qa_n.get() : C.h.get(), in, At(Wb(w), rows), W.dQ.get(), nullptr,
                      G(w) + rows, T, in, Hg * qk, false));
  return InputGrad(W.dQ.get(), At(Wb(w), rows), dx, T, in, Hg * qk);
}

// The attention's gradients, at cp = 1 and under All2All in groups of heads (MlaGradHeadsPerGroup;
// under All2All a group is a rank's block of the exchanged gradients), each group's taken back
// through kv_b and q_b (or q) at once; the latent's and q_a's gradients add up over the
// groups in fp32 (W.sum_lat, W.sum_q) when there are several, else go to W.dkva and W.dqa_n (or
// W.dh) directly. Then the shared tail: kv_norm, kv_a, q_a.
absl::Status CudaModel::Impl::MlaBackward(const LayerIdx& L, Cache& C, const void* dout) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd, kvw = nope + vd, qr = m.q_lora_rank;
  const int64_t Hg = MlaGradHeadsPerGroup(), dqw = qr > 0 ? qr : d;
  const bool grouped = Hg < H;
  const float theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(Act(W.dO, T, H * vd));
  RETURN_IF_ERROR(Act(W.dQ, T, Hg * qk));
  RETURN_IF_ERROR(Act(W.dK, T, Hg * qk));
  RETURN_IF_ERROR(Act(W.dkvb, T, Hg * kvw));
  RETURN_IF_ERROR(Act(W.dkva, T, w));
  RETURN_IF_ERROR(Act(W.dc_n, T, kv));
  RETURN_IF_ERROR(Act(W.dc, T, kv));
  if (qr > 0) {
    RETURN_IF_ERROR(Act(W.dqa_n, T, qr));
    RETURN_IF_ERROR(Act(W.dqa, T, qr));
  }
  // q's input gradient: the normed q_a output, or without a q LoRA the normed input (which kv_a's
  // gradient then adds to).
  Rows dq_in{qr > 0 ? W.dqa_n.get() : W.dh.get(), dqw};
  RETURN_IF_ERROR(
      fp8 ? BwdQ(C.q_O, L.mo, dout, W.dO.get(), G(L.mo), T, H * vd, d, false,
                 GradAmax(Work::kAmaxDx))
          : Bwd(C.O.get(), H * vd, Wb(L.mo), dout, W.dO.get(), G(L.mo), T, H * vd, d, false));
  if (MlaLatentKeys()) {
    // The latent gradients [d c_n | d k_r (rotated)] of this rank's tokens into W.dkva, dQ into
    // W.dQ; dW_kv_b accumulated over the gathered (or passed) keys.
    RETURN_IF_ERROR(MlaRing()     ? MlaRingBackward(L, C)
                    : MlaHybrid() ? MlaHybridBackward(L, C)
                                  : MlaAllGatherBackward(L, C));
    RETURN_IF_ERROR(MlaQueryGrads(L, C, 0, H, dq_in));
  } else {
    Rows lat{W.dkva.get(), w};
    if (grouped && B.cp == 1) {
      for (DevBuf* b : {&W.gQ, &W.gK}) RETURN_IF_ERROR(Act(*b, T, Hg * qk));
      RETURN_IF_ERROR(Act(W.gkvb, T, Hg * kvw));
    }
    if (grouped) {
      RETURN_IF_ERROR(F32(W.sum_lat, T * w));
      RETURN_IF_ERROR(F32(W.sum_q, T * dqw));
      CUDA(cudaMemsetAsync(W.sum_lat.get(), 0, T * w * 4, stream));
      CUDA(cudaMemsetAsync(W.sum_q.get(), 0, T * dqw * 4, stream));
      lat = {W.sum_lat.get(), w, KDType::kFloat32, true};
      dq_in = {W.sum_q.get(), dqw, KDType::kFloat32, true};
    }
    if (B.cp > 1) RETURN_IF_ERROR(MlaCoreBackward(C));
    for (int64_t h0 = 0; h0 < H; h0 += Hg) {
      if (B.cp == 1) {
        RETURN_IF_ERROR(MlaGroupAttentionBackward(C, h0, Hg));
      } else {  // the group's ranks' blocks of the received gradients (one, or all of them)
        const int64_t Hl = H / B.cp;
        RETURN_IF_ERROR(MlaUnpackGrads(C.cp_full.get(), Hg, h0 / Hl, (h0 + Hg) / Hl));
      }
      RETURN_IF_ERROR(
          MlaKeyGradsToLatentRows(L, C.c_n.get(), kv, W.dK.get(), W.dkvb.get(), T, h0, Hg, lat));
      RETURN_IF_ERROR(MlaQueryGrads(L, C, h0, Hg, dq_in));
    }
    if (grouped) {
      KC(kc::CastRows(W.dkva.get(), kAct, w, W.sum_lat.get(), KDType::kFloat32, w, T, w, stream));
      if (qr > 0)
        KC(kc::CastRows(W.dqa_n.get(), kAct, qr, W.sum_q.get(), KDType::kFloat32, qr, T, qr,
                        stream));
    }
  }
  RETURN_IF_ERROR(Copy2D(W.dc_n.get(), kv, W.dkva.get(), w, kv, T));
  KC(kc::RmsNormBackward(C.c.get(), Wb(L.kv_norm), C.rstd_c.f32(), W.dc_n.get(), nullptr,
                         W.dc.get(), G(L.kv_norm), T, kv, kAct, Ws(), stream));
  RETURN_IF_ERROR(Copy2D(W.dkva.get(), w, W.dc.get(), kv, kv, T));
  KC(kc::RopeApply(At(W.dkva.get(), kv), B.pos.i32(), T, 1, rd, w, rd, theta, true, kAct, stream));
  // Without a q LoRA, q's gradient is in W.dh already (one group) or in W.sum_q.
  const bool q_in_dh = qr == 0 && dq_in.type == kAct;
  RETURN_IF_ERROR(
      fp8 ? BwdQ(C.q_h, L.kv_a, W.dkva.get(), W.dh.get(), G(L.kv_a), T, d, w, q_in_dh)
          : Bwd(C.h.get(), d, Wb(L.kv_a), W.dkva.get(), W.dh.get(), G(L.kv_a), T, d, w, q_in_dh));
  if (qr == 0) {
    if (!q_in_dh)
      KC(kc::CastRows(W.dh.get(), kAct, d, W.sum_q.get(), KDType::kFloat32, d, T, d, stream,
                      /*accumulate=*/true));
    return absl::OkStatus();
  }
  KC(kc::RmsNormBackward(C.qa.get(), Wb(L.q_a_norm), C.rstd_qa.f32(), W.dqa_n.get(), nullptr,
                         W.dqa.get(), G(L.q_a_norm), T, qr, kAct, Ws(), stream));
  if (fp8) return BwdQ(C.q_h, L.q_a, W.dqa.get(), W.dh.get(), G(L.q_a), T, d, qr, true);
  return Bwd(C.h.get(), d, Wb(L.q_a), W.dqa.get(), W.dh.get(), G(L.q_a), T, d, qr, true);
}

// ---- One layer -----------------------------------------------------------------------------------

// x_out = x_mid + FFN(norm(x_mid)), x_mid = x_in + Attn(norm(x_in)). x_out null (a recomputed
// forward): everything the backward reads, without the output itself, which is the next layer's
// input and kept, and without the FFN, which the backward recomputes block by block.
absl::Status CudaModel::Impl::LayerForward(const LayerIdx& L, Cache& C, const void* x_in,
                                           void* x_out, bool ffn_kept, bool attention_kept) {
  const int64_t T = B.T, d = c.d_model;
  const float eps = static_cast<float>(c.norm_eps);
  // Under FP8 only MLA reads the bf16 h (its q projection stays bf16); Lightning's GEMMs take
  // the codes.
  const bool bf16_h = !fp8 || L.kind != 'L';
  // Under FP8 the first forward of a recomputing layer (and a forward-only pass) writes no
  // transposed codes: no backward reads them (the recomputed forward writes its own).
  const bool transposes = ffn_kept || x_out == nullptr;
  // A recomputed forward with the first forward's statistics and amaxes at hand quantizes in one
  // pass (MLA's attention norm still runs both: its second writes the bf16 h).
  const bool requantize = Requantizes(C, x_out);
  if (bf16_h) RETURN_IF_ERROR(Act(C.h, T, d));
  RETURN_IF_ERROR(F32(C.rstd1, T));
  if (fp8) {
    RETURN_IF_ERROR(QAct(C.q_h, T, d));
    const kc::Fp8Output q = QOut(C.q_h, transposes, C, kSiteH);
    if (requantize && !bf16_h) {
      KC(kc::RmsNormQuantizeFp8(x_in, Wb(L.attn_norm), C.rstd1.f32(), T, d, kAct, q, stream));
    } else {
      KC(kc::RmsNormForwardFp8(x_in, Wb(L.attn_norm), bf16_h ? C.h.get() : nullptr, C.rstd1.f32(),
                               T, d, eps, kAct, q, stream));
    }
  } else {
    KC(kc::RmsNormForward(x_in, Wb(L.attn_norm), C.h.get(), C.rstd1.f32(), T, d, eps, kAct,
                          stream));
  }
  RETURN_IF_ERROR(Act(C.x_mid, T, d));
  if (L.kind == 'L') {
    RETURN_IF_ERROR(lightning.Forward(L, C, C.lt, x_in, transposes, requantize));
  } else {
    RETURN_IF_ERROR(MlaForward(L, C, attention_kept));
    const int64_t hv = c.n_heads * c.mla.v_head_dim;
    if (fp8) {  // the attention's output has no producer of ours to fuse the cast into
      RETURN_IF_ERROR(QAct(C.q_O, T, hv));
      const kc::Fp8Output q = QOut(C.q_O, transposes, C, kSiteO);
      KC(requantize ? kc::Fp8QuantizeFromAmax(C.O.get(), T, hv, kAct, q, stream)
                    : kc::Fp8Quantize(C.O.get(), T, hv, kAct, q, stream));
      RETURN_IF_ERROR(FwdQ(C.q_O, L.mo, C.x_mid.get(), T, hv, d, true, x_in));
    } else {
      RETURN_IF_ERROR(Fwd(C.O.get(), hv, Wb(L.mo), C.x_mid.get(), T, hv, d, true, x_in));
    }
  }
  RETURN_IF_ERROR(F32(C.rstd2, T));
  // A MoE layer's router and gathers read h2 in bf16 (the gathers quantize the experts' rows).
  if (fp8 && !L.moe) {
    RETURN_IF_ERROR(QAct(C.q_h2, T, d));
    const kc::Fp8Output q = QOut(C.q_h2, transposes, C, kSiteH2);
    if (requantize) {
      KC(kc::RmsNormQuantizeFp8(C.x_mid.get(), Wb(L.ffn_norm), C.rstd2.f32(), T, d, kAct, q,
                                stream));
    } else {
      KC(kc::RmsNormForwardFp8(C.x_mid.get(), Wb(L.ffn_norm), nullptr, C.rstd2.f32(), T, d, eps,
                               kAct, q, stream));
    }
  } else {
    RETURN_IF_ERROR(Act(C.h2, T, d));
    KC(kc::RmsNormForward(C.x_mid.get(), Wb(L.ffn_norm), C.h2.get(), C.rstd2.f32(), T, d, eps, kAct,
                          stream));
  }
  if (L.moe) {
    // A recomputed forward leaves the MoE FFN to the backward, which runs its forward first.
    if (x_out == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(
        moe.Forward(L, C, C.moe, x_out, moe.moe_counting ? &moe.moe_stats[L.index] : nullptr));
    KC(kc::AddRows(x_out, d, C.x_mid.get(), d, T, d, kAct, stream));
    return absl::OkStatus();
  }
  return ffn.Forward(L, C, C.ffn, x_out, ffn_kept);
}

// dx: in = gradient of x_out, out = gradient of x_in.
absl::Status CudaModel::Impl::LayerBackward(const LayerIdx& L, Cache& C, const void* x_in, void* dx,
                                            bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model;
  if (kind_union)
    RETURN_IF_ERROR(UseKind(W.arena, L.kind, WorkKindFields('L'), WorkKindFields('M')));
  if (L.moe) {
    // A layer that recomputes runs its MoE forward again (its exchanges too) before the backward.
    if (!ffn_kept) RETURN_IF_ERROR(moe.Forward(L, C, C.moe, nullptr, nullptr));
    RETURN_IF_ERROR(moe.Backward(L, C, C.moe, dx));
  } else {
    RETURN_IF_ERROR(ffn.Backward(L, C, C.ffn, dx, ffn_kept));
  }
  // dx = d x_mid = dx + RMSNorm backward of the FFN's input gradient W.dh (under FP8 with its
  // amax, for the attention's output projection).
  KC(kc::RmsNormBackward(C.x_mid.get(), Wb(L.ffn_norm), C.rstd2.f32(), W.dh.get(), dx, dx,
                         G(L.ffn_norm), T, d, kAct, Ws(), stream, GradAmax(Work::kAmaxDx)));
  if (L.kind == 'L') {
    RETURN_IF_ERROR(lightning.Backward(L, C, C.lt, dx));
  } else {
    RETURN_IF_ERROR(MlaBackward(L, C, dx));
  }
  KC(kc::RmsNormBackward(x_in, Wb(L.attn_norm), C.rstd1.f32(), W.dh.get(), dx, dx, G(L.attn_norm),
                         T, d, kAct, Ws(), stream, GradAmax(Work::kAmaxDx)));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::AttentionBackward(const void* q, const void* k, const void* v,
                                                const void* o, const float* stats, const void* dout,
                                                void* dq, void* dk, void* dv,
                                                const std::vector<int32_t>& cu_host, float scale,
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
                      stream));
  }
  return absl::OkStatus();
}

}  // namespace spindle
