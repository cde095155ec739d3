// The state CudaModel's layer families share (see cuda_model.cc): the configuration, the device's
// stream, allocator and GEMMs, the parameters as the layers read them (the bf16 working copy, the
// FP8 copies, the fp32 gradients), the batch and CP levels on the device with the CP context and
// its modes, and the gradient scratch every layer's backward shares (Work), with the GEMM, FP8
// and Ulysses helpers over them. CudaModel::Impl, which owns all of it, derives from it; each
// family (cuda_lightning.h, cuda_mla.h, cuda_dense_ffn.h, cuda_moe_ffn.h) is handed it and reaches
// nothing else of the model.
#pragma once

#include <memory>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "worker/engine/cuda/cuda_model_common.h"

namespace spindle {
namespace cuda_model_detail {

// Gradient scratch shared by every layer's backward (each family keeps its own besides).
struct Work {
  // dh: the gradient of a layer's normed input (the FFN's, then the attention's); ws: the one
  // workspace of every kernel that needs scratch (they run one after another), sized by Upload.
  DevBuf dh, ws;
  int64_t ws_bytes = 0;
  // CP (All2All, and the hybrid modes' Ulysses exchanges) scratch, sized by Upload: cp_block, the
  // local tokens' side of an exchange (the packed send blocks, or the received rows of the local
  // tokens) and, while it is free, the core's input gradients over the whole sequence; cp_tmp, a
  // whole-sequence [T_full, H/cp * width] output or output gradient.
  DevBuf cp_block, cp_tmp;
  // The attention families' gradients (Lightning: dy, dgate, dqkv; MLA: dO through dqa) hold one
  // family's at a time (KindArena).
  KindArena arena;
  // FP8: an output gradient's E5M2 codes, for the two GEMMs of one linear's backward; and the
  // row-major codes of the activation being produced (the caches' q_* keep only their
  // transposes): read by the forward GEMMs right after their producer, and by nothing later but a
  // recomputing layer's FFN, whose backward runs first after the recomputed forward wrote them.
  Fp8Act q_dy;
  DevBuf fp8_rows;
  // Blockwise FP8: the bf16 output of a norm whose only readers are FP8 GEMMs ([T, d], written
  // and not read): the norm's forward runs for its statistics, the blockwise quantizer then reads
  // them with its inputs (kernels/cuda/fp8.h).
  DevBuf norm_y;
  // FP8: the output gradients' amaxes (fp32, by GradAmax), each reduced by the kernel that writes
  // the gradient and read by its quantization (BwdQ); allocated for the whole backward.
  enum GradAmax { kAmaxDg, kAmaxDu, kAmaxDx, kAmaxDgate, kAmaxDqkv, kGradAmaxes };
  DevBuf grad_amax;
  float* Amax(GradAmax which) { return grad_amax.f32() + which; }
  // Every buffer back to the allocator.
  void Release() {
    for (DevBuf* b :
         {&dh, &ws, &cp_block, &cp_tmp, &arena.mem, &q_dy.mem, &fp8_rows, &norm_y, &grad_amax})
      b->Release();
    ws_bytes = 0;
    arena.kind = 0;
  }
};

// Where a GEMM's rows go: `ld` elements of `type` apart, overwritten or (add) added to.
struct Rows {
  void* p;
  int64_t ld;
  KDType type = kAct;
  bool add = false;
};

// What the layer families share, with the helpers over it. The families read the parameters and
// the batch and write the gradients and scratch; CudaModel::Impl sets the rest (Create, SetCp,
// SetPrecision, Upload).
struct LayerContext {
  ModelConfig c;
  std::unique_ptr<Model> host;  // the CPU model: parameter layout, initial values, host mirror
  cudaStream_t stream = nullptr;
  DeviceCopies copies{&stream};  // the CP exchanges' copies on `stream`
  std::unique_ptr<kc::Blas> blas;
  kc::CachingAllocator alloc;
  // The parameters on the device (CudaModel::Impl allocates them): fp32 masters p and gradients
  // g; bf16 working copy `w`, parameter i at element w_at[i] (-1: none; under fp8 the FP8
  // linears, whose GEMMs read fp8_w, have no bf16 copy).
  float *p = nullptr, *g = nullptr;
  void* w = nullptr;
  std::vector<int64_t> w_at;
  // train.precision fp8 (SetPrecision): the blocks' linears but MLA's per-head ones (q or q_b,
  // kv_b; worker/engine/numerics.h) multiply FP8 codes; fp8_w holds each one's weight copy (by
  // parameter index), fp8_e the MoE layers' expert weights.
  bool fp8 = false;
  // train.fp8_recipe "blockwise" (with fp8): every FP8 operand in block scales (Fp8Block::scales).
  bool fp8_blockwise = false;
  bool fp8_fast_forward = true;  // see SetFp8FastForward
  kc::GroupedGemmOptions expert_gemm;  // see SetExpertGemm
  std::vector<Fp8Block> fp8_w;
  std::vector<Fp8ExpertBlock> fp8_e;
  BatchDev B;
  // Context parallelism: the context of SetCp, whose communicators take device buffers (NCCL's as
  // they are; a host communicator's through a StagedCommunicator).
  CpContext cp;
  Work W;

  ParamSet& P() { return host->params(); }
  // Parameter i's bf16 copy; null for an FP8 linear under fp8 (a kernel handed it faults loudly).
  const void* Wb(int i) { return w_at[i] >= 0 ? At(w, w_at[i]) : nullptr; }
  float* G(int i) { return g + P().info(i).offset; }
  float* Master(int i) { return p + P().info(i).offset; }

  // ---- GEMMs (row-major; bf16 in, fp32 accumulate) --------------------------------------------
  // y[T, out] (+)= x[T, in] W[out, in]^T; x rows `ldx` apart.
  // residual (nullable, with acc): y = residual + x W^T, y only written.
  absl::Status Fwd(const void* x, int64_t ldx, const void* Wt, void* y, int64_t T, int64_t in,
                   int64_t out, bool acc, const void* residual = nullptr) {
    kc::GemmArgs a;
    a.trans_b = true;
    a.M = T, a.N = out, a.K = in, a.beta = acc ? 1.0f : 0.0f;
    a.A = x, a.lda = ldx, a.B = Wt, a.ldb = in, a.C = y, a.ldc = out, a.C_in = residual;
    return FromKernel(blas->Gemm(a, stream));
  }
  // dx[T, in] (+)= dy[T, out] W[out, in] (dy rows `out` apart).
  absl::Status InputGrad(const void* dy, const void* Wt, Rows dx, int64_t T, int64_t in,
                         int64_t out) {
    kc::GemmArgs a;
    a.M = T, a.N = in, a.K = out, a.beta = dx.add ? 1.0f : 0.0f;
    a.A = dy, a.lda = out, a.B = Wt, a.ldb = in, a.C = dx.p, a.ldc = dx.ld, a.c_type = dx.type;
    return FromKernel(blas->Gemm(a, stream));
  }
  // dx[T, in] (+)= dy[T, out] W[out, in]  and  dW[out, in] += dy^T x (fp32).
  absl::Status Bwd(const void* x, int64_t ldx, const void* Wt, const void* dy, void* dx, float* dW,
                   int64_t T, int64_t in, int64_t out, bool acc_dx) {
    if (dx) RETURN_IF_ERROR(InputGrad(dy, Wt, {dx, in, kAct, acc_dx}, T, in, out));
    kc::GemmArgs b;
    b.trans_a = true;
    b.M = out, b.N = in, b.K = T, b.beta = 1.0f;
    b.A = dy, b.lda = out, b.B = x, b.ldb = ldx, b.C = dW, b.ldc = in;
    b.c_type = KDType::kFloat32;
    return FromKernel(blas->Gemm(b, stream));
  }
  // A cached FP8 activation [rows, cols] (E4M3) about to be produced: its transpose in q's own
  // block, its row-major codes in W.fp8_rows. W.fp8_rows is sized once for the widest such input
  // (so it never moves within a step).
  absl::Status QAct(Fp8Act& q, int64_t rows, int64_t cols) {
    const int64_t widest = std::max({c.d_model, c.ffn_dim, c.n_heads * c.mla.v_head_dim});
    RETURN_IF_ERROR(W.fp8_rows.Ensure(&alloc, std::max(rows * cols, B.T * widest)));
    return q.Ensure(&alloc, rows, cols, KDType::kFp8E4M3, W.fp8_rows.get(), fp8_blockwise);
  }
  // Blockwise: where a producer writes q's codes and block scales, both layouts or (transposes
  // false, as QOut) the row-major ones alone.
  static kc::Fp8BlockOutput QBlockOut(const Fp8Act& q, bool transposes) {
    kc::Fp8BlockOutput o = q.BlockOutput();
    if (!transposes) o.codes_t = nullptr, o.scales_t = nullptr;
    return o;
  }
  // Blockwise: the bf16 scratch a norm's forward writes its unread output to (Work::norm_y).
  absl::Status NormScratch(void** y) {
    RETURN_IF_ERROR(Act(W.norm_y, B.T, c.d_model));
    *y = W.norm_y.get();
    return absl::OkStatus();
  }
  // Where producer `site` writes q's codes: both layouts, or (transposes false: a forward that no
  // backward reads, that of a recomputing layer or a forward-only pass) the row-major codes the
  // forward's GEMMs read alone; its amax in a recomputing layer's kept slot (X.fp8_amax) if any.
  static kc::Fp8Output QOut(const Fp8Act& q, bool transposes, const LayerActs& X, Fp8Site site) {
    kc::Fp8Output o = q.Output();
    if (!transposes) o.codes_t = nullptr;
    if (X.fp8_amax.get() != nullptr) o.amax = X.fp8_amax.f32() + site;
    return o;
  }
  // Under FP8, a recomputing layer's recomputed forward (x_out null) with its first forward's
  // statistics and amaxes in X: the producers run their second pass alone.
  bool Requantizes(const LayerActs& X, const void* x_out) const {
    return fp8 && x_out == nullptr && X.fp8_amax.get() != nullptr;
  }

  // The same on FP8 codes (fp8): y[T, out] (+)= x W^T from x's codes and weight w's copy.
  absl::Status FwdQ(const Fp8Block& x, int w, void* y, int64_t T, int64_t in, int64_t out, bool acc,
                    const void* residual = nullptr) {
    kc::GemmArgs a;
    a.trans_b = true;
    a.M = T, a.N = out, a.K = in, a.beta = acc ? 1.0f : 0.0f;
    a.A = x.codes(), a.lda = in, a.B = fp8_w[w].codes(), a.ldb = in, a.C = y, a.ldc = out;
    a.C_in = residual;
    a.ab_type = x.format, a.b_type = KDType::kFp8E4M3;
    a.a_scale = x.inverse_scale(), a.b_scale = fp8_w[w].inverse_scale();
    a.fast_accum = fp8_fast_forward;
    if (fp8_blockwise) {  // x in 1 x 128 blocks, W in 128 x 128 (no fast accumulation)
      a.a_scale = x.scales, a.a_scale_mode = kc::Fp8ScaleMode::kRow128;
      a.b_scale = fp8_w[w].scales, a.b_scale_mode = kc::Fp8ScaleMode::kBlock128;
      a.fast_accum = false;
    }
    return FromKernel(blas->Gemm(a, stream));
  }
  // dy (bf16 [T, out]) quantized to E5M2 with its transpose (W.q_dy), then dx (+)= dy W (dx
  // nullable) from the weight's transposed codes and dW += dy^T x from both transposes.
  // dy_amax (nullable): max |dy| already reduced by dy's producer (a device float), which spares
  // the quantization its own pass over dy.
  absl::Status BwdQ(const Fp8Block& x, int w, const void* dy, void* dx, float* dW, int64_t T,
                    int64_t in, int64_t out, bool acc_dx, float* dy_amax = nullptr) {
    Fp8Act& q = W.q_dy;
    RETURN_IF_ERROR(q.Ensure(&alloc, T, out, KDType::kFp8E5M2, nullptr, fp8_blockwise));
    if (fp8_blockwise) return BwdBlockwise(x, w, dy, dx, dW, T, in, out, acc_dx);
    if (dy_amax != nullptr) {
      kc::Fp8Output o = q.Output();
      o.amax = dy_amax;
      KC(kc::Fp8QuantizeFromAmax(dy, T, out, kAct, o, stream));
    } else {
      KC(kc::Fp8Quantize(dy, T, out, kAct, q.Output(), stream));
    }
    kc::GemmArgs a;
    a.trans_b = true;
    a.ab_type = KDType::kFp8E5M2, a.b_type = KDType::kFp8E4M3, a.a_scale = q.inverse_scale();
    if (dx) {
      a.M = T, a.N = in, a.K = out, a.beta = acc_dx ? 1.0f : 0.0f;
      a.A = q.codes(), a.lda = out, a.B = fp8_w[w].codes_t(), a.ldb = out, a.C = dx, a.ldc = in;
      a.b_scale = fp8_w[w].inverse_scale();
      KC(blas->Gemm(a, stream));
    }
    a.M = out, a.N = in, a.K = T, a.beta = 1.0f;
    a.A = q.codes_t(), a.lda = T, a.B = x.codes_t(), a.ldb = T, a.C = dW, a.ldc = in;
    a.c_type = KDType::kFloat32, a.b_type = x.format, a.b_scale = x.inverse_scale();
    return FromKernel(blas->Gemm(a, stream));
  }
  // BwdQ under the blockwise recipe: dy's E5M2 codes in 1 x 128 blocks along its rows and along
  // its transpose's (the tokens), from its stored bf16 (no amax: a block's scale is its own);
  // dx (+)= dy (1x128) times W^T's codes (128x128), dW += dy^T (1x128 along the tokens) times
  // x^T (1x128 along the tokens).
  absl::Status BwdBlockwise(const Fp8Block& x, int w, const void* dy, void* dx, float* dW,
                            int64_t T, int64_t in, int64_t out, bool acc_dx) {
    Fp8Act& q = W.q_dy;
    KC(kc::Fp8QuantizeBlockwise(dy, T, out, kAct, q.BlockOutput(), stream));
    kc::GemmArgs a;
    a.trans_b = true;
    a.ab_type = KDType::kFp8E5M2, a.b_type = KDType::kFp8E4M3;
    a.a_scale_mode = kc::Fp8ScaleMode::kRow128;
    if (dx) {
      a.M = T, a.N = in, a.K = out, a.beta = acc_dx ? 1.0f : 0.0f;
      a.A = q.codes(), a.lda = out, a.B = fp8_w[w].codes_t(), a.ldb = out, a.C = dx, a.ldc = in;
      a.a_scale = q.scales;
      a.b_scale = fp8_w[w].scales_t, a.b_scale_mode = kc::Fp8ScaleMode::kBlock128;
      KC(blas->Gemm(a, stream));
    }
    a.M = out, a.N = in, a.K = T, a.beta = 1.0f;
    a.A = q.codes_t(), a.lda = T, a.B = x.codes_t(), a.ldb = T, a.C = dW, a.ldc = in;
    a.c_type = KDType::kFloat32, a.b_type = x.format;
    a.a_scale = q.scales_t;
    a.b_scale = x.scales_t, a.b_scale_mode = kc::Fp8ScaleMode::kRow128;
    return FromKernel(blas->Gemm(a, stream));
  }
  // FP8: where the kernel writing an output gradient reduces its amax for the quantization that
  // reads it (Work::GradAmax; kAmaxDx: the residual stream's dx, written by each RMSNorm backward,
  // read by w2's and then the attention output projection's); null without FP8.
  float* GradAmax(Work::GradAmax which) { return fp8 ? W.Amax(which) : nullptr; }
  // dst[rows, width] <- src[rows, width] with row strides (elements).
  absl::Status Copy2D(void* dst, int64_t dst_stride, const void* src, int64_t src_stride,
                      int64_t width, int64_t rows) {
    return FromKernel(
        kc::CopyRows(dst, dst_stride, 0, src, src_stride, 0, rows, 1, width, kAct, stream));
  }
  kc::Workspace Ws() { return {W.ws.get(), static_cast<size_t>(W.ws_bytes)}; }
  absl::Status Act(DevBuf& b, int64_t rows, int64_t cols) {
    return b.Ensure(&alloc, rows * cols * kAb);
  }
  absl::Status F32(DevBuf& b, int64_t n) { return b.Ensure(&alloc, n * 4); }

  // ---- Context parallelism: the modes in force --------------------------------------------------
  bool LightningAllGather() const { return B.cp > 1 && cp.lightning_mode == CpMode::kAllGather; }
  bool LightningHybrid() const { return B.cp > 1 && cp.lightning_mode == CpMode::kHybrid; }
  bool MlaAllGather() const { return B.cp > 1 && cp.mla_mode == CpMode::kAllGather; }
  bool MlaRing() const { return B.cp > 1 && cp.mla_mode == CpMode::kRing; }
  bool MlaHybrid() const { return B.cp > 1 && cp.mla_mode == CpMode::kHybrid; }
  // Whether MLA rebuilds its keys and values from latent rows per key block (AllGather, Ring,
  // hybrid) rather than keeping them for the whole local sequence.
  bool MlaLatentKeys() const { return MlaAllGather() || MlaRing() || MlaHybrid(); }
  // Whether MLA's ring passes keys and values (else the latent rows): CpContext::mla_payload.
  bool MlaRingKv() const { return cp.mla_payload == MlaRingPayload::kKv; }

  // ---- Context parallelism: the Ulysses exchanges (All2All, and the hybrid modes' groups) ----
  // The Ulysses steps (cp/cp_ulysses.h) on this engine's buffers and T local tokens:
  // local views -> W.cp_block (block j: [T][the views' heads of member j side by side]);
  absl::Status PackByHeads(const UlyssesComm& g, const std::vector<UlyssesView>& views) {
    return UlyssesPackByHeads(copies, B.T, c.n_heads, g.members, views, W.cp_block.get());
  }
  // recv's blocks [j0, j1) -> the local views, block j0's first head at the views' head 0;
  absl::Status UnpackToTokens(const UlyssesComm& g, const void* recv,
                              const std::vector<UlyssesView>& views, int64_t j0 = 0,
                              int64_t j1 = -1) {
    return UlyssesUnpackToTokens(copies, recv, B.T, c.n_heads, g.members, views, j0, j1);
  }
  // rows of `width` elements of `elem` bytes, run by run, between member blocks and group rows;
  absl::Status CopyRuns(const UlyssesComm& g, const void* src, bool src_grouped, void* dst,
                        bool dst_grouped, int64_t width, int64_t elem = kAb) {
    return UlyssesCopyRuns(copies, g, B.T, src, src_grouped, dst, dst_grouped, width * elem);
  }
  // the group's all-to-all from the member blocks `send` into `full` [members T, width] in the
  // group's row order, or back (distinct send and receive memory).
  absl::Status ExchangeToGroup(const UlyssesComm& g, const void* send, void* full, int64_t width,
                               CommLayer layer) {
    return UlyssesExchange(copies, g, B.T, send, false, full, true, width * kAb, layer);
  }
  absl::Status ExchangeFromGroup(const UlyssesComm& g, const void* full, void* recv, int64_t width,
                                 CommLayer layer) {
    return UlyssesExchange(copies, g, B.T, full, true, recv, false, width * kAb, layer);
  }
};

}  // namespace cuda_model_detail
}  // namespace spindle
