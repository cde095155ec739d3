// Causal softmax attention inside documents on CPU (the MLA core), returning the log-sum-exp.
//
// Query i may attend key j iff q_doc[i] == k_doc[j] and k_pos[j] <= q_pos[i], where pos is the
// token's index in the packed stream (not its RoPE position) and doc its document id. Both q_pos
// and k_pos are ascending and doc ids are non-decreasing along them; blocks of keys that no query
// of a block can see are skipped. This one form covers local causal attention (q = k = the local
// tokens) and context-parallel attention on gathered keys.
//
// Layout: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], out [Tq, H, Dv], all dense row-major;
// lse [Tq, H] (natural log, of the scaled scores). A query with no visible key gets out = 0 and
// lse = -inf, and contributes no gradient.
#pragma once

#include <cstdint>

namespace spindle::kernels::cpu {

struct AttentionDims {
  int64_t Tq, Tk, H, Dqk, Dv;
};

struct AttentionMask {
  const int32_t* q_doc;
  const int32_t* q_pos;
  const int32_t* k_doc;
  const int32_t* k_pos;
};

void AttentionForward(const float* q, const float* k, const float* v, const AttentionMask& mask,
                      float scale, const AttentionDims& dims, float* out, float* lse);

// dq, dk, dv overwritten. Uses the saved out and lse (no second softmax pass over rows).
void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                       const float* lse, const float* dout, const AttentionMask& mask, float scale,
                       const AttentionDims& dims, float* dq, float* dk, float* dv);

}  // namespace spindle::kernels::cpu
