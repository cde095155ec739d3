// CUDA kernels for every dense op of the model, mirroring kernels/cpu/ops.h (the reference).
//
// Conventions shared by every function here:
//  - Pointers are device pointers; activations are token-major [T, D] or [T, H, Dh], row-major.
//    Activation tensors are `void*` with a DType (bf16 in training, fp32 accepted); parameter
//    gradients, optimizer state and saved norm statistics are fp32.
//  - Forward functions overwrite their outputs. Backward functions overwrite input gradients and
//    ACCUMULATE (+=) into fp32 parameter gradients, as on CPU. Every reduction runs in a fixed
//    order for given sizes: results are bitwise reproducible from run to run (no float atomics).
//  - Work is enqueued on `stream`; nothing synchronises the host. Functions that need scratch
//    memory take a Workspace of at least the bytes their ...WorkspaceBytes() function returns.
//  - Errors (bad sizes, unsupported dtype, launch failure) come back as a Status; a failed
//    launch may leave outputs partly written.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// ---- Embedding ------------------------------------------------------------------------------
// out[t, :] = table[ids[t], :]; table and out share `dtype`. ids must be in [0, vocab).
Status EmbeddingForward(const int32_t* ids, const void* table, void* out, int64_t T, int64_t D,
                        DType dtype, cudaStream_t stream);
// dtable[ids[t], :] += dout[t, :] (dtable fp32). Sorts the ids (CUB radix sort) and sums every
// id's rows in token order: deterministic for repeated ids.
size_t EmbeddingBackwardWorkspaceBytes(int64_t T);
Status EmbeddingBackward(const int32_t* ids, const void* dout, float* dtable, int64_t T, int64_t D,
                         int64_t vocab, DType dtype, Workspace ws, cudaStream_t stream);

// ---- RMSNorm over the last dimension ----------------------------------------------------------
// y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) saved (fp32, size rows). x, w, y share dtype;
// x and y may alias. rows = T * H with D = Dh gives the per-head q/k norm. D <= 12288.
Status RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                      float eps, DType dtype, cudaStream_t stream);
// Fused residual add: h = x + residual (written, may alias x or residual), y = RMSNorm(h).
Status RmsNormResidualForward(const void* x, const void* residual, void* h, const void* w, void* y,
                              float* rstd, int64_t rows, int64_t D, float eps, DType dtype,
                              cudaStream_t stream);
// dx overwritten (may alias dy); dw (fp32) accumulated. When `dresidual` is non-null its value is
// added to dx (the gradient flowing past a fused residual add), and may alias dx. dx_amax
// (nullable, a device float): max |dx| as stored (the FP8 recipe's output-gradient amax, sparing
// the quantization a pass over dx).
size_t RmsNormBackwardWorkspaceBytes(int64_t rows, int64_t D);
Status RmsNormBackward(const void* x, const void* w, const float* rstd, const void* dy,
                       const void* dresidual, void* dx, float* dw, int64_t rows, int64_t D,
                       DType dtype, Workspace ws, cudaStream_t stream, float* dx_amax = nullptr);

// ---- Rotate-half RoPE on a strided [T, H, d] view, in place (see cpu::RopeApply) -----------------
Status RopeApply(void* x, const int32_t* pos, int64_t T, int64_t H, int64_t d,
                 int64_t token_stride, int64_t head_stride, float theta, bool inverse, DType dtype,
                 cudaStream_t stream);

// ---- Lightning q/k path fused: per-head RMSNorm then RoPE on the split qkv ------------------------
// qkv_in and qkv_out are dense [T, 3*H*Dh] (q, k, v blocks of H*Dh, head-major). For q and k:
// out = RoPE(RMSNorm_Dh(in) * w) with w_q, w_k of size Dh; rstd_q, rstd_k [T*H] saved. The v
// block is copied when copy_v (so qkv_out feeds LightningForward with qkv_stride 3*H*Dh).
// qkv_in and qkv_out must not alias. Dh even, <= 1024.
Status QkNormRopeForward(const void* qkv_in, const void* w_q, const void* w_k,
                         const int32_t* pos, void* qkv_out, float* rstd_q, float* rstd_k,
                         int64_t T, int64_t H, int64_t Dh, float eps, float theta, bool copy_v,
                         DType dtype, cudaStream_t stream);
// Backward: dqkv_out holds the gradients w.r.t. qkv_out; dqkv_in receives those w.r.t. qkv_in
// (q, k blocks; the v block is copied when copy_v). May alias. dw_q, dw_k accumulated. din_amax
// (nullable, a device float): max |dqkv_in| as stored, the v block's copy included (FP8).
size_t QkNormRopeBackwardWorkspaceBytes(int64_t T, int64_t H, int64_t Dh);
Status QkNormRopeBackward(const void* qkv_in, const void* w_q, const void* w_k, const float* rstd_q,
                          const float* rstd_k, const int32_t* pos, const void* dqkv_out,
                          void* dqkv_in, float* dw_q, float* dw_k, int64_t T, int64_t H, int64_t Dh,
                          float theta, bool copy_v, DType dtype, Workspace ws, cudaStream_t stream,
                          float* din_amax = nullptr);

// ---- SwiGLU: y = silu(g) * u over n values ---------------------------------------------------------
Status SwiGluForward(const void* g, const void* u, void* y, int64_t n, DType dtype,
                     cudaStream_t stream);
// dg, du overwritten; each may alias an input element for element. amax (nullable, 2 device
// floats): max |dg| and max |du| as stored, for the FP8 quantization of both (fp8.h's
// Fp8QuantizeFromAmax), reduced on the way instead of in a pass of their own.
Status SwiGluBackward(const void* g, const void* u, const void* dy, void* dg, void* du, int64_t n,
                      DType dtype, cudaStream_t stream, float* amax = nullptr);

// ---- Group RMSNorm + sigmoid gate (Lightning output), see cpu::GroupNormGateForward -------------
// o, gate, y [T, H*Dh], w [H*Dh] share dtype; rstd [T*H] fp32. H*Dh <= 12288.
Status GroupNormGateForward(const void* o, const void* w, const void* gate, void* y, float* rstd,
                            int64_t T, int64_t H, int64_t Dh, float eps, DType dtype,
                            cudaStream_t stream);
// do_ and dgate overwritten (do_ may alias dy, dgate may alias gate); dw (fp32) accumulated.
// dgate_amax (nullable, a device float): max |dgate| as stored (FP8).
size_t GroupNormGateBackwardWorkspaceBytes(int64_t T, int64_t H, int64_t Dh);
Status GroupNormGateBackward(const void* o, const void* w, const void* gate, const float* rstd,
                             const void* dy, void* do_, float* dw, void* dgate, int64_t T,
                             int64_t H, int64_t Dh, DType dtype, Workspace ws, cudaStream_t stream,
                             float* dgate_amax = nullptr);

// ---- Cross-entropy over rows of logits, fused with its gradient ------------------------------------
// One row block of the linear + cross-entropy: logits [T, V] (dtype) for T rows (a block of the
// sequence, produced by one GEMM). row_loss[t] (fp32) = logsumexp(logits[t]) - logits[t, target]
// for targets[t] >= 0, 0 for ignored rows. When dlogits is non-null it receives
// grad_scale * (softmax - onehot) (0 for ignored rows), and may alias logits. With z_loss > 0
// (train.z_loss) each valid row's objective adds z_loss * lse^2: dlogits then receive
// grad_scale * (softmax (1 + 2 z_loss lse) - onehot); row_loss stays the cross-entropy.
Status CrossEntropy(const void* logits, const int32_t* targets, int64_t T, int64_t V,
                    float grad_scale, float* row_loss, void* dlogits, DType dtype,
                    cudaStream_t stream, float z_loss = 0.0f);
// *sum = sum of x[0..n) (double, fixed order; one block). For losses and squared norms.
Status SumRows(const float* x, int64_t n, double* sum, cudaStream_t stream);

// ---- Multi-tensor optimizers --------------------------------------------------------------------------
// One parameter tensor: fp32 master p, gradient g, optimizer state m, v (n values each; AdamW's
// moments, or SGD's momentum buffer in m, v unused; state a rule does not use may be null), and
// an optional bf16 copy of the updated p (p_bf16, nullable) for the forward pass.
struct OptimizerTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  void* p_bf16;
  int64_t n;
  float weight_decay;  // per tensor (0 for norms, say)
};
struct AdamWHyper {
  float lr, beta1, beta2, eps;
  int64_t step;      // 1-based, for bias correction
  float grad_scale;  // g is multiplied by this first (clipping; 1 for none)
};
// Updates every tensor in as few launches as their count allows (tensor table in kernel args).
// Matches cpu::AdamWStep: p -= lr * (wd * p + mhat / (sqrt(vhat) + eps)).
Status AdamWMultiTensor(const OptimizerTensor* tensors, int64_t n_tensors, const AdamWHyper& hp,
                        cudaStream_t stream);
struct SgdHyper {
  float lr, momentum;  // momentum 0: no buffer (m unused)
  float grad_scale;    // g is multiplied by this first
};
// Matches cpu::SgdStep: d = g + wd * p; with momentum m = momentum * m + d, p -= lr * m; without,
// p -= lr * d.
Status SgdMultiTensor(const OptimizerTensor* tensors, int64_t n_tensors, const SgdHyper& hp,
                      cudaStream_t stream);

// ---- Glue of the model ---------------------------------------------------------------------------
// dst[t, h, j] = src[t, h, j] for j < width over [T, H] rows of strided views (token and head
// strides in elements; a source head stride of 0 broadcasts one row to every head).
Status CopyRows(void* dst, int64_t dst_token_stride, int64_t dst_head_stride, const void* src,
                int64_t src_token_stride, int64_t src_head_stride, int64_t T, int64_t H,
                int64_t width, DType dtype, cudaStream_t stream);
// out[t, j] = sum_h x[t * token_stride + h * head_stride + j] for j < d (out row stride
// out_stride): the gradient of a key part shared by all heads (MLA's rotary key). add_f32: out
// is fp32 and the sums are added to it (a sum over groups of heads, rounded once at the end).
Status SumHeads(const void* x, int64_t T, int64_t H, int64_t d, int64_t token_stride,
                int64_t head_stride, void* out, int64_t out_stride, DType dtype,
                cudaStream_t stream, bool add_f32 = false);
// *out = sum of x[i]^2 (double, fixed order for a given n).
size_t SquaredNormWorkspaceBytes();
Status SquaredNorm(const float* x, int64_t n, double* out, Workspace ws, cudaStream_t stream);
// y[i] = x[i] rounded to dtype (the bf16 copy of fp32 weights).
Status ConvertFromFloat(const float* x, void* y, int64_t n, DType dtype, cudaStream_t stream);
// dst[r, j] += src[r, j] for j < width (row strides in elements; fp32 arithmetic, one rounding).
Status AddRows(void* dst, int64_t dst_stride, const void* src, int64_t src_stride, int64_t rows,
               int64_t width, DType dtype, cudaStream_t stream);
// dst[r, j] = src[r, j] converted between fp32 and bf16 (any pair of the two); accumulate:
// dst[r, j] += src[r, j] (fp32 arithmetic, rounded once to dst's type).
Status CastRows(void* dst, DType dst_dtype, int64_t dst_stride, const void* src, DType src_dtype,
                int64_t src_stride, int64_t rows, int64_t width, cudaStream_t stream,
                bool accumulate = false);
// Merges two softmax attention results of the same n queries over disjoint key sets (a and b)
// into a, as if one attention had seen both: with l = log(exp(la) + exp(lb)),
// o_a = exp(la - l) o_a + exp(lb - l) o_b and la = l. o: [n, H, Dv] rows with token strides
// (heads dense inside a row), each fp32 or bf16 (an fp32 o_a accumulates many pieces with one
// rounding at the end); lse: natural-log log-sum-exp statistics [H, stride] (the Sdpa stats
// layout, element [h * stride + t]).
Status AttentionMerge(void* o_a, DType a_dtype, int64_t o_a_token_stride, float* lse_a,
                      int64_t lse_a_stride, const void* o_b, DType b_dtype,
                      int64_t o_b_token_stride, const float* lse_b, int64_t lse_b_stride, int64_t n,
                      int64_t H, int64_t Dv, cudaStream_t stream);

}  // namespace spindle::kernels::cuda
