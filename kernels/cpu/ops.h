// CPU reference kernels (fp32, OpenMP, OpenBLAS) for every dense op of the model.
//
// Conventions shared by every function here:
//  - Tensors are raw row-major fp32 pointers; activations are token-major: [T, D] or [T, H, Dh].
//  - Forward functions overwrite their outputs. Backward functions OVERWRITE input gradients
//    (dx, dq, ...) and ACCUMULATE (+=) into parameter gradients (dw, dtable), so that several
//    micro-batches and CP ranks can add into one gradient buffer.
//  - Sizes are int64_t; nothing allocates on the heap in the hot path except where stated.
//  - Token ids and positions are int32_t. A target of -1 is ignored by the loss.
#pragma once

#include <cstdint>

namespace spindle::kernels::cpu {

// ---- Embedding ------------------------------------------------------------------------------
// out[t, :] = table[ids[t], :]. ids must be in [0, vocab): callers validate data beforehand.
void EmbeddingForward(const int32_t* ids, const float* table, float* out, int64_t T, int64_t D);
// dtable[ids[t], :] += dout[t, :] (race-free for repeated ids).
void EmbeddingBackward(const int32_t* ids, const float* dout, float* dtable, int64_t T, int64_t D,
                       int64_t vocab);

// ---- RMSNorm over the last dimension ----------------------------------------------------------
// y[r, :] = x[r, :] * rstd[r] * w[:], rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps).
// Used with rows = T for the model norms and rows = T * H, D = Dh for per-head q/k norms
// (one weight of size Dh shared by every head). rstd (size rows) is saved for the backward.
// x and y may alias.
void RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                    int64_t D, float eps);
// dx overwritten (may alias dy), dw accumulated. x is the forward input, rstd the saved statistic.
void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                     float* dw, int64_t rows, int64_t D);

// ---- Rotate-half RoPE (GPT-NeoX) on a strided [T, H, d] view, in place -----------------------
// For each token t, head h and j < d/2 the pair (x[j], x[j + d/2]) is rotated by the angle
// pos[t] * theta^(-2j/d). Element (t, h, j) lives at x[t * token_stride + h * head_stride + j],
// so q and k can be rotated inside a fused qkv buffer. The backward is the same call with
// inverse = true (rotation by the negative angle) applied to the gradient.
void RopeApply(float* x, const int32_t* pos, int64_t T, int64_t H, int64_t d, int64_t token_stride,
               int64_t head_stride, float theta, bool inverse);

// ---- Linear: y[T, out] = x[T, in] * W[out, in]^T ------------------------------------------------
void LinearForward(const float* x, const float* W, float* y, int64_t T, int64_t in, int64_t out);
// dx[T, in] = dy * W (overwritten; skipped when dx is null); dW[out, in] += dy^T * x.
void LinearBackward(const float* x, const float* W, const float* dy, float* dx, float* dW,
                    int64_t T, int64_t in, int64_t out);
// Plain row-major SGEMM: C = alpha * op(A) * op(B) + beta * C, op = transpose when the flag is set.
// A is [M, K] (or [K, M] transposed), B is [K, N] (or [N, K] transposed), C is [M, N].
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// ---- SwiGLU: y = silu(g) * u, elementwise over n values -----------------------------------------
void SwiGluForward(const float* g, const float* u, float* y, int64_t n);
// dg, du overwritten. Each may alias an input element for element (dg == g, du == u, ...).
void SwiGluBackward(const float* g, const float* u, const float* dy, float* dg, float* du,
                    int64_t n);

// ---- Group RMSNorm + sigmoid gate (Lightning output) ---------------------------------------------
// o, gate, y are [T, H * Dh]. Per token and head: n = o * rstd (rstd over the Dh values of that
// head), y = n * w[h * Dh + j] * sigmoid(gate). rstd is [T * H], saved for the backward.
void GroupNormGateForward(const float* o, const float* w, const float* gate, float* y, float* rstd,
                          int64_t T, int64_t H, int64_t Dh, float eps);
// do_, dgate overwritten; dw accumulated. do_ may alias dy and dgate may alias gate.
void GroupNormGateBackward(const float* o, const float* w, const float* gate, const float* rstd,
                           const float* dy, float* do_, float* dw, float* dgate, int64_t T,
                           int64_t H, int64_t Dh);

// ---- Cross-entropy over rows of logits, fused with its gradient ---------------------------------
// For each row t with targets[t] >= 0: loss_t = logsumexp(logits[t]) - logits[t, targets[t]].
// Returns the SUM of loss_t (double) and adds the number of valid rows to *n_valid.
// When dlogits is non-null it receives grad_scale * (softmax(logits[t]) - onehot(target)) for
// valid rows and zeros for ignored rows; dlogits may alias logits (computed in place).
// Targets must be < V (validated by callers).
// z-loss (PaLM's, train.z_loss): each valid row's objective adds z_loss * lse_t^2 (lse_t its
// logsumexp), so dlogits receive grad_scale * (softmax (1 + 2 z_loss lse_t) - onehot); the
// returned sum stays the cross-entropy's, and the rows' sum of lse_t^2 is added to *lse_squared
// (nullable).
double CrossEntropy(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                    float grad_scale, float* dlogits, int64_t* n_valid, float z_loss = 0.0f,
                    double* lse_squared = nullptr);

// ---- Optimizers (one flat parameter buffer at a time) --------------------------------------------
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based step count, used for bias correction
};
// Decoupled weight decay: p -= lr * (wd * p + mhat / (sqrt(vhat) + eps)).
void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp);
// p -= lr * (g + wd * p) with optional momentum buffer (nullable when momentum == 0):
// buf = momentum * buf + (g + wd * p); p -= lr * buf.
void SgdStep(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
             float weight_decay);
// Sum of squares (double accumulation), for the global gradient norm.
double SumSquares(const float* x, int64_t n);
// x *= s.
void Scale(float* x, int64_t n, float s);

}  // namespace spindle::kernels::cpu
