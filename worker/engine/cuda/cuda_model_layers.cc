// CudaModel's layers (see cuda_model.h): one layer's residual structure, its norms and residual
// sums, around the families of its attention (Lightning or MLA) and its FFN (dense or MoE),
// following worker/engine/model.cc step for step.
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

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
  if (fp8 && fp8_blockwise) {
    // Blockwise: the norm for its statistics (and the bf16 h MLA reads; else into scratch), then
    // its fp32 output quantized from x and rstd in 1 x 128 blocks. A recomputed forward without
    // the bf16 h quantizes from the kept rstd alone: a block's scale is its own, so that pass is
    // the first forward's quantization (no amax is kept or needed).
    RETURN_IF_ERROR(QAct(C.q_h, T, d));
    if (!(requantize && !bf16_h)) {
      void* y = C.h.get();
      if (!bf16_h) RETURN_IF_ERROR(NormScratch(&y));
      KC(kc::RmsNormForward(x_in, Wb(L.attn_norm), y, C.rstd1.f32(), T, d, eps, kAct, stream));
    }
    KC(kc::RmsNormQuantizeBlockwise(x_in, Wb(L.attn_norm), C.rstd1.f32(), T, d, kAct,
                                    QBlockOut(C.q_h, transposes), stream));
  } else if (fp8) {
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
    RETURN_IF_ERROR(mla.Forward(L, C, C.mla, x_in, attention_kept, transposes, requantize));
  }
  RETURN_IF_ERROR(F32(C.rstd2, T));
  // A MoE layer's router and gathers read h2 in bf16 (the gathers quantize the experts' rows).
  if (fp8 && fp8_blockwise && !L.moe) {  // as the attention norm's above
    RETURN_IF_ERROR(QAct(C.q_h2, T, d));
    if (!requantize) {
      void* y = nullptr;
      RETURN_IF_ERROR(NormScratch(&y));
      KC(kc::RmsNormForward(C.x_mid.get(), Wb(L.ffn_norm), y, C.rstd2.f32(), T, d, eps, kAct,
                            stream));
    }
    KC(kc::RmsNormQuantizeBlockwise(C.x_mid.get(), Wb(L.ffn_norm), C.rstd2.f32(), T, d, kAct,
                                    QBlockOut(C.q_h2, transposes), stream));
  } else if (fp8 && !L.moe) {
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
    // A recomputed forward leaves the MoE FFN to the backward, which runs its forward first
    // (so a first forward whose FFN is not kept writes no transposed codes under blockwise).
    if (x_out == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(moe.Forward(L, C, C.moe, x_out,
                                moe.moe_counting ? &moe.moe_stats[L.index] : nullptr,
                                /*transposes=*/ffn_kept));
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
    RETURN_IF_ERROR(mla.Backward(L, C, C.mla, dx));
  }
  KC(kc::RmsNormBackward(x_in, Wb(L.attn_norm), C.rstd1.f32(), W.dh.get(), dx, dx, G(L.attn_norm),
                         T, d, kAct, Ws(), stream, GradAmax(Work::kAmaxDx)));
  return absl::OkStatus();
}

}  // namespace spindle
