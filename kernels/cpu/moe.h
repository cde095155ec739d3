// CPU reference kernels of the mixture-of-experts FFN (DESIGN.md section 2): the sigmoid router
// with its balancing bias and top-k, the grouping of (token, choice) pairs by expert, row gathers,
// and the weighted combine. The experts themselves are SwiGLUs run with Gemm/SwiGluForward over
// each expert's rows. The CUDA kernels (kernels/cuda/moe.h) follow these definitions.
//
// Conventions as in ops.h: row-major fp32, token-major activations; forward functions overwrite
// their outputs; nothing allocates. Expert ids and row maps are int32_t.
#pragma once

#include <cstdint>

namespace spindle::kernels::cpu {

// ---- Router -----------------------------------------------------------------------------------
// logits [T, E] are the router's fp32 output z. Per token: s = sigmoid(z); the chosen experts
// are the K largest s + bias (bias [E]; ties go to the lower expert id), written to idx [T, K] in
// descending order of s + bias; weights [T, K] = s[chosen_k] / sum_k s[chosen_k]. lse (nullable)
// [T] = logsumexp(z[t, :]), for the router z-loss. Requires 1 <= K <= E.
void MoeRouterForward(const float* logits, const float* bias, int32_t* idx, float* weights,
                      float* lse, int64_t T, int64_t E, int64_t K);
// dlogits [T, E] overwritten: the gradient through weights = s_chosen / sum(s_chosen) of dweights
// [T, K] (zero for experts not chosen), plus, when zloss_scale != 0, the z-loss term
// zloss_scale * 2 * lse[t] * softmax(z[t])[e] (the gradient of zloss_scale * lse^2).
void MoeRouterBackward(const float* logits, const int32_t* idx, const float* dweights,
                       const float* lse, float zloss_scale, float* dlogits, int64_t T, int64_t E,
                       int64_t K);

// ---- Grouping rows by expert ----------------------------------------------------------------
// Items i < n carry a key key[i] in [0, E). Groups them by key, each group keeping item order:
// counts[e] items have key e, and group e occupies rows [offsets[e], offsets[e] + counts[e]) of
// offsets[E] rows in all, where offsets[0] = 0 and offsets[e + 1] = offsets[e] + counts[e]
// rounded up to a multiple of `align` (>= 1). item_row[i] is item i's row; row_source[r] is
// (the item of row r) / `per_source` for the rows of items and -1 for the padding rows
// (offsets[E] entries). With per_source = K and the T * K (token, choice) pairs as items
// (key = idx), row_source names each row's token. counts, offsets: E and E + 1 entries.
void MoeGroupRows(const int32_t* key, int64_t n, int64_t per_source, int64_t E, int64_t align,
                  int64_t* counts, int64_t* offsets, int32_t* item_row, int32_t* row_source);

// out[r, :] = in[src[r], :] for r < rows, and zeros where src[r] < 0.
void GatherRows(const float* in, const int32_t* src, float* out, int64_t rows, int64_t D);

// ---- Combine --------------------------------------------------------------------------------
// out[t, :] (+)= sum_k w[t, k] * y[row[t * K + k], :]: each token's K expert outputs, weighted
// (w null: weight 1, the sum of the rows). Accumulates when `accumulate`, else overwrites.
void MoeCombine(const float* y, const int32_t* row, const float* w, float* out, int64_t T,
                int64_t K, int64_t D, bool accumulate);
// The backward of MoeCombine with weights: dy[row[t * K + k], :] = w[t, k] * dout[t, :]
// (overwritten; rows no pair names are left as they are) and dw[t, k] = dot(dout[t, :],
// y[row[t * K + k], :]) (overwritten).
void MoeCombineBackward(const float* dout, const float* y, const int32_t* row, const float* w,
                        float* dy, float* dw, int64_t T, int64_t K, int64_t D);

}  // namespace spindle::kernels::cpu
