// The CUDA model's dense FFN family (cuda_dense_ffn.h), following worker/engine/model.cc step for
// step.
#include "worker/engine/cuda/cuda_dense_ffn.h"

namespace spindle {
namespace cuda_model_detail {

absl::Status CudaDenseFfn::Hidden(const LayerIdx& L, LayerActs& A, DenseFfnCache& C,
                                  bool transposes, bool requantize, const void* h, void* g, void* u,
                                  void* a, int64_t n) {
  const int64_t d = c.d_model, F = c.ffn_dim;
  if (cx.fp8) {
    RETURN_IF_ERROR(cx.FwdQ(A.q_h2, L.w1, g, n, d, F, false));
    RETURN_IF_ERROR(cx.FwdQ(A.q_h2, L.w3, u, n, d, F, false));
    RETURN_IF_ERROR(cx.QAct(C.q_a, n, F));
    if (cx.fp8_blockwise) {  // from g and u in one pass, recomputed or not (no statistics)
      KC(kc::SwiGluQuantizeBlockwise(g, u, n, F, kAct, cx.QBlockOut(C.q_a, transposes),
                                     cx.stream));
      return absl::OkStatus();
    }
    const kc::Fp8Output q = cx.QOut(C.q_a, transposes, A, kSiteA);
    KC(requantize ? kc::SwiGluQuantizeFp8(g, u, n, F, kAct, q, cx.stream)
                  : kc::SwiGluForwardFp8(g, u, nullptr, n, F, kAct, q, cx.stream));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(cx.Fwd(h, d, cx.Wb(L.w1), g, n, d, F, false));
  RETURN_IF_ERROR(cx.Fwd(h, d, cx.Wb(L.w3), u, n, d, F, false));
  KC(kc::SwiGluForward(g, u, a, n * F, kAct, cx.stream));
  return absl::OkStatus();
}

absl::Status CudaDenseFfn::Forward(const LayerIdx& L, LayerActs& A, DenseFfnCache& C, void* x_out,
                                   bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model, F = c.ffn_dim;
  if (!ffn_kept && x_out == nullptr) return absl::OkStatus();
  const int64_t rows = ffn_kept || cx.fp8 ? T : std::min(T, ffn_block_rows);
  for (DevBuf* b : {&C.g, &C.u}) RETURN_IF_ERROR(cx.Act(*b, rows, F));
  if (!cx.fp8) RETURN_IF_ERROR(cx.Act(C.a, rows, F));
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t n = std::min(rows, T - t0);
    RETURN_IF_ERROR(Hidden(L, A, C, /*transposes=*/ffn_kept, /*requantize=*/false,
                           At(A.h2.get(), t0 * d), C.g.get(), C.u.get(), C.a.get(), n));
    if (x_out == nullptr) continue;
    RETURN_IF_ERROR(cx.fp8 ? cx.FwdQ(C.q_a, L.w2, x_out, n, F, d, true, A.x_mid.get())
                           : cx.Fwd(C.a.get(), F, cx.Wb(L.w2), At(x_out, t0 * d), n, F, d, true,
                                    At(A.x_mid.get(), t0 * d)));
  }
  return absl::OkStatus();
}

absl::Status CudaDenseFfn::Backward(const LayerIdx& L, LayerActs& A, DenseFfnCache& C,
                                    const void* dx, bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model, F = c.ffn_dim;
  const int64_t rows = cx.fp8 ? T : std::min(T, ffn_block_rows);
  for (DevBuf* b : {&W.da, &W.dg, &W.du}) RETURN_IF_ERROR(cx.Act(*b, rows, F));
  if (!ffn_kept)
    for (DevBuf* b : {&C.g, &C.u}) RETURN_IF_ERROR(cx.Act(*b, rows, F));
  if (!ffn_kept && !cx.fp8) RETURN_IF_ERROR(cx.Act(C.a, rows, F));
  RETURN_IF_ERROR(cx.Act(cx.W.dh, T, d));
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t n = std::min(rows, T - t0);
    const void* h = At(A.h2.get(), t0 * d);
    const int64_t off = ffn_kept ? t0 * F : 0;
    void *g = At(C.g.get(), off), *u = At(C.u.get(), off), *a = At(C.a.get(), off);
    // A recomputing layer's hidden layer, recomputed (SwiGLU's second pass alone under FP8).
    if (!ffn_kept)
      RETURN_IF_ERROR(
          Hidden(L, A, C, /*transposes=*/true, cx.Requantizes(A, nullptr), h, g, u, a, n));
    void* dh = At(cx.W.dh.get(), t0 * d);
    if (cx.fp8) {  // one block; SwiGLU's backward reduces the amaxes of dg and du on the way
      RETURN_IF_ERROR(cx.BwdQ(C.q_a, L.w2, dx, W.da.get(), cx.G(L.w2), n, F, d, false,
                              cx.W.Amax(Work::kAmaxDx)));
      KC(kc::SwiGluBackward(g, u, W.da.get(), W.dg.get(), W.du.get(), n * F, kAct, cx.stream,
                            cx.W.Amax(Work::kAmaxDg)));  // and kAmaxDu
      RETURN_IF_ERROR(cx.BwdQ(A.q_h2, L.w1, W.dg.get(), dh, cx.G(L.w1), n, d, F, false,
                              cx.W.Amax(Work::kAmaxDg)));
      RETURN_IF_ERROR(cx.BwdQ(A.q_h2, L.w3, W.du.get(), dh, cx.G(L.w3), n, d, F, true,
                              cx.W.Amax(Work::kAmaxDu)));
      continue;
    }
    RETURN_IF_ERROR(
        cx.Bwd(a, F, cx.Wb(L.w2), At(dx, t0 * d), W.da.get(), cx.G(L.w2), n, F, d, false));
    KC(kc::SwiGluBackward(g, u, W.da.get(), W.dg.get(), W.du.get(), n * F, kAct, cx.stream));
    RETURN_IF_ERROR(cx.Bwd(h, d, cx.Wb(L.w1), W.dg.get(), dh, cx.G(L.w1), n, d, F, false));
    RETURN_IF_ERROR(cx.Bwd(h, d, cx.Wb(L.w3), W.du.get(), dh, cx.G(L.w3), n, d, F, true));
  }
  return absl::OkStatus();
}

}  // namespace cuda_model_detail
}  // namespace spindle
