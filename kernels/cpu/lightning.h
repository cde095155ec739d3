// Lightning (linear) attention on CPU: the chunked algorithm with per-head decay, document
// resets, a carry-in state and an end-state output (what context parallelism needs).
//
// Per head h with decay a_h = exp(log_decay[h]) and state S (Dh x Dh, rows indexed by k, columns
// by v), for each token t in order:
//     S_t = a_h * S_{t-1} + k_t^T v_t          (S_{-1} = carry_in, or 0)
//     o_t = scale * q_t S_t                     (inclusive of token t)
// and S is reset to zero at the start of every segment but the first. Segments are the document
// pieces of the sequence: cu_seqlens[0] = 0 < cu_seqlens[1] < ... < cu_seqlens[n_segments] = T.
// carry_in (nullable = zeros) is the state flowing into segment 0, i.e. the caller passes it only
// when segment 0 continues a document begun before this sequence. end_state (nullable) receives
// the state after token T-1 (the state of the last segment, including carry-in if n_segments==1).
//
// Layout: q, k, v are [T, H, Dh] views with token stride `qkv_stride` (elements) and head stride
// Dh, so they can live inside one fused [T, 3*H*Dh] projection output. out is dense [T, H, Dh].
// States are [H, Dh, Dh] fp32. The chunk size is an implementation detail (64).
#pragma once

#include <cstdint>

namespace spindle::kernels::cpu {

struct LightningDims {
  int64_t T, H, Dh;
  int64_t qkv_stride;  // token stride of q, k, v (and of dq, dk, dv)
};

void LightningForward(const float* q, const float* k, const float* v, const float* log_decay,
                      const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                      float scale, const LightningDims& dims, float* out, float* end_state);

// Gradients of LightningForward. dout is dense [T, H, Dh]; d_end_state (nullable = zeros) is the
// gradient flowing into end_state. dq, dk, dv (token stride qkv_stride) are overwritten;
// d_carry_in (nullable) is overwritten with the gradient w.r.t. carry_in. It does not depend on
// the carry's value, so with carry_in = null it is the gradient w.r.t. a zero carry-in, which CP
// uses.
void LightningBackward(const float* q, const float* k, const float* v, const float* log_decay,
                       const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                       float scale, const LightningDims& dims, const float* dout,
                       const float* d_end_state, float* dq, float* dk, float* dv,
                       float* d_carry_in);

// CP helpers (AllGather mode). The carry-in contribution for the first `n_tokens` tokens of a
// chunk, added to out:  out_t += a_h^(t+1) * scale * q_t P  for t < n_tokens (t is 0-based).
void LightningCarryCorrection(const float* q, const float* log_decay, const float* P, float scale,
                              const LightningDims& dims, int64_t n_tokens, float* out);
// Its backward: dq_t += a_h^(t+1) * scale * dout_t P^T (accumulated), dP += sum_t
// a_h^(t+1) * scale * q_t^T dout_t (accumulated).
void LightningCarryCorrectionBackward(const float* q, const float* log_decay, const float* P,
                                      float scale, const LightningDims& dims, int64_t n_tokens,
                                      const float* dout, float* dq, float* dP);

}  // namespace spindle::kernels::cpu
