// Lightning (linear) attention on CPU: chunked forward with document resets, carry-in and
// end-state; a two-pass chunked backward; the context-parallel carry correction and its backward.
//
// Work is split into (head, segment) items: segments are independent except for the carry-in of
// segment 0, so every item owns its slice of the outputs and no two threads write the same value.
// Inside a segment, chunks of kChunk tokens start at the segment's first token, so a document
// boundary never falls inside a chunk.
#include "kernels/cpu/lightning.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/thread_local_gemm.h"

namespace spindle::kernels::cpu {
namespace {

constexpr int64_t kChunk = 64;

using internal::ThreadLocalGemm;

// Per-thread buffers, sized once per call.
struct ChunkScratch {
  explicit ChunkScratch(int64_t dh)
      : a(kChunk * kChunk),
        b(kChunk * kChunk),
        rows(kChunk * dh),
        state(dh * dh),
        decay(kChunk + 1) {}
  std::vector<float> a, b;   // [kChunk, kChunk] score matrices
  std::vector<float> rows;   // [kChunk, Dh] rows scaled by a per-row decay
  std::vector<float> state;  // [Dh, Dh]
  std::vector<float> decay;  // decay[n] = a^n, n <= kChunk
};

void FillDecay(float log_decay, float* decay) {
  for (int64_t n = 0; n <= kChunk; ++n) decay[n] = std::exp(static_cast<float>(n) * log_decay);
}

// dst[i, :] = factor * decay[offset + sign * i] * src[i * ld + :] for i < len.
void ScaleRows(const float* src, int64_t ld, int64_t len, int64_t dh, const float* decay,
               int64_t offset, int64_t sign, float factor, float* dst) {
  for (int64_t i = 0; i < len; ++i) {
    const float f = factor * decay[offset + sign * i];
    const float* s = src + i * ld;
    float* d = dst + i * dh;
    for (int64_t j = 0; j < dh; ++j) d[j] = f * s[j];
  }
}

// m[i, j] *= a^(i-j) for j <= i, 0 for j > i (i, j < len; row stride kChunk).
void ApplyCausalDecay(float* m, int64_t len, const float* decay) {
  for (int64_t i = 0; i < len; ++i) {
    float* row = m + i * kChunk;
    for (int64_t j = 0; j <= i; ++j) row[j] *= decay[i - j];
    for (int64_t j = i + 1; j < len; ++j) row[j] = 0.0f;
  }
}

// State update across one chunk: S = a^len S + sum_j a^(len-1-j) k_j^T v_j.
void AdvanceState(const float* k, const float* v, int64_t ld, int64_t len, int64_t dh,
                  const float* decay, bool have_state, ChunkScratch& s) {
  ScaleRows(k, ld, len, dh, decay, len - 1, -1, 1.0f, s.rows.data());
  ThreadLocalGemm(true, false, dh, dh, len, 1.0f, s.rows.data(), dh, v, ld,
                  have_state ? decay[len] : 0.0f, s.state.data(), dh);
}

struct Segment {
  int64_t begin, end;
  bool first, last;
};

Segment GetSegment(const int32_t* cu_seqlens, int64_t n_segments, int64_t s) {
  return {cu_seqlens[s], cu_seqlens[s + 1], s == 0, s == n_segments - 1};
}

// Forward of one head over one segment.
void ForwardSegment(const float* q, const float* k, const float* v, const float* carry, float scale,
                    const LightningDims& d, const Segment& seg, float* out, float* end_state,
                    ChunkScratch& s) {
  const int64_t ld = d.qkv_stride, ldo = d.H * d.Dh, dh = d.Dh;
  const float* decay = s.decay.data();
  bool have_state = carry != nullptr;
  if (have_state) std::memcpy(s.state.data(), carry, sizeof(float) * dh * dh);
  for (int64_t c0 = seg.begin; c0 < seg.end; c0 += kChunk) {
    const int64_t len = std::min(kChunk, seg.end - c0);
    const float* qc = q + c0 * ld;
    const float* kc = k + c0 * ld;
    const float* vc = v + c0 * ld;
    float* oc = out + c0 * ldo;
    // Intra-chunk: (scale * Q K^T, decay-masked) V.
    ThreadLocalGemm(false, true, len, len, dh, scale, qc, ld, kc, ld, 0.0f, s.a.data(), kChunk);
    ApplyCausalDecay(s.a.data(), len, decay);
    ThreadLocalGemm(false, false, len, dh, len, 1.0f, s.a.data(), kChunk, vc, ld, 0.0f, oc, ldo);
    // Inter-chunk: scale * a^(i+1) q_i S.
    if (have_state) {
      ScaleRows(qc, ld, len, dh, decay, 1, 1, scale, s.rows.data());
      ThreadLocalGemm(false, false, len, dh, dh, 1.0f, s.rows.data(), dh, s.state.data(), dh, 1.0f,
                      oc, ldo);
    }
    if (c0 + len < seg.end || end_state != nullptr) {
      AdvanceState(kc, vc, ld, len, dh, decay, have_state, s);
      have_state = true;
    }
  }
  if (end_state != nullptr) {
    if (have_state) {
      std::memcpy(end_state, s.state.data(), sizeof(float) * dh * dh);
    } else {
      std::fill(end_state, end_state + dh * dh, 0.0f);
    }
  }
}

// Backward of one head over one segment. Reverse pass: everything but the inter-chunk part of dq,
// carrying dn = the gradient w.r.t. the state at the end of the current chunk. Forward pass:
// recompute the chunk-start states and add the inter-chunk part of dq.
void BackwardSegment(const float* q, const float* k, const float* v, const float* carry,
                     float scale, const LightningDims& d, const Segment& seg, const float* dout,
                     const float* d_end, float* dq, float* dk, float* dv, float* d_carry,
                     ChunkScratch& s, std::vector<float>& dn) {
  const int64_t ld = d.qkv_stride, ldo = d.H * d.Dh, dh = d.Dh;
  const float* decay = s.decay.data();
  const int64_t n_chunks = (seg.end - seg.begin + kChunk - 1) / kChunk;
  bool have_dn = d_end != nullptr;
  if (have_dn) std::memcpy(dn.data(), d_end, sizeof(float) * dh * dh);
  for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
    const int64_t c0 = seg.begin + ci * kChunk;
    const int64_t len = std::min(kChunk, seg.end - c0);
    const float* qc = q + c0 * ld;
    const float* kc = k + c0 * ld;
    const float* vc = v + c0 * ld;
    const float* gc = dout + c0 * ldo;
    float* dqc = dq + c0 * ld;
    float* dkc = dk + c0 * ld;
    float* dvc = dv + c0 * ld;
    // A = Q K^T and B = G V^T, both decay-masked: A[j, i] = a^(j-i) q_j.k_i for j >= i.
    ThreadLocalGemm(false, true, len, len, dh, 1.0f, qc, ld, kc, ld, 0.0f, s.a.data(), kChunk);
    ThreadLocalGemm(false, true, len, len, dh, 1.0f, gc, ldo, vc, ld, 0.0f, s.b.data(), kChunk);
    ApplyCausalDecay(s.a.data(), len, decay);
    ApplyCausalDecay(s.b.data(), len, decay);
    ThreadLocalGemm(false, false, len, dh, len, scale, s.b.data(), kChunk, kc, ld, 0.0f, dqc, ld);
    ThreadLocalGemm(true, false, len, dh, len, scale, s.b.data(), kChunk, qc, ld, 0.0f, dkc, ld);
    ThreadLocalGemm(true, false, len, dh, len, scale, s.a.data(), kChunk, gc, ldo, 0.0f, dvc, ld);
    if (have_dn) {
      // dk_i += a^(len-1-i) v_i dn^T, dv_i += a^(len-1-i) k_i dn.
      ScaleRows(vc, ld, len, dh, decay, len - 1, -1, 1.0f, s.rows.data());
      ThreadLocalGemm(false, true, len, dh, dh, 1.0f, s.rows.data(), dh, dn.data(), dh, 1.0f, dkc,
                      ld);
      ScaleRows(kc, ld, len, dh, decay, len - 1, -1, 1.0f, s.rows.data());
      ThreadLocalGemm(false, false, len, dh, dh, 1.0f, s.rows.data(), dh, dn.data(), dh, 1.0f, dvc,
                      ld);
    }
    if (ci > 0 || d_carry != nullptr) {
      // Gradient w.r.t. the state entering this chunk: a^len dn + scale sum_i a^(i+1) q_i^T g_i.
      ScaleRows(qc, ld, len, dh, decay, 1, 1, scale, s.rows.data());
      ThreadLocalGemm(true, false, dh, dh, len, 1.0f, s.rows.data(), dh, gc, ldo,
                      have_dn ? decay[len] : 0.0f, dn.data(), dh);
      have_dn = true;
    }
  }
  if (d_carry != nullptr) {
    if (have_dn) {
      std::memcpy(d_carry, dn.data(), sizeof(float) * dh * dh);
    } else {
      std::fill(d_carry, d_carry + dh * dh, 0.0f);
    }
  }
  if (n_chunks <= 1 && carry == nullptr) return;
  bool have_state = carry != nullptr;
  if (have_state) std::memcpy(s.state.data(), carry, sizeof(float) * dh * dh);
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    const int64_t c0 = seg.begin + ci * kChunk;
    const int64_t len = std::min(kChunk, seg.end - c0);
    if (have_state) {
      // dq_i += scale a^(i+1) g_i S^T.
      ScaleRows(dout + c0 * ldo, ldo, len, dh, decay, 1, 1, scale, s.rows.data());
      ThreadLocalGemm(false, true, len, dh, dh, 1.0f, s.rows.data(), dh, s.state.data(), dh, 1.0f,
                      dq + c0 * ld, ld);
    }
    if (ci + 1 < n_chunks) {
      AdvanceState(k + c0 * ld, v + c0 * ld, ld, len, dh, decay, have_state, s);
      have_state = true;
    }
  }
}

}  // namespace

void LightningForward(const float* q, const float* k, const float* v, const float* log_decay,
                      const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                      float scale, const LightningDims& dims, float* out, float* end_state) {
  const int64_t H = dims.H, dh = dims.Dh, ss = dh * dh;
  if (dims.T == 0 || n_segments == 0) {
    if (end_state != nullptr) {
      for (int64_t i = 0; i < H * ss; ++i) end_state[i] = carry_in ? carry_in[i] : 0.0f;
    }
    return;
  }
  const int64_t n_items = H * n_segments;
#pragma omp parallel
  {
    ChunkScratch scratch(dh);
    int64_t decay_head = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t h = item / n_segments, si = item % n_segments;
      if (h != decay_head) {
        FillDecay(log_decay[h], scratch.decay.data());
        decay_head = h;
      }
      const Segment seg = GetSegment(cu_seqlens, n_segments, si);
      ForwardSegment(q + h * dh, k + h * dh, v + h * dh,
                     seg.first && carry_in ? carry_in + h * ss : nullptr, scale, dims, seg,
                     out + h * dh, seg.last && end_state ? end_state + h * ss : nullptr, scratch);
    }
  }
}

void LightningBackward(const float* q, const float* k, const float* v, const float* log_decay,
                       const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                       float scale, const LightningDims& dims, const float* dout,
                       const float* d_end_state, float* dq, float* dk, float* dv,
                       float* d_carry_in) {
  const int64_t H = dims.H, dh = dims.Dh, ss = dh * dh;
  if (dims.T == 0 || n_segments == 0) {
    if (d_carry_in != nullptr) {
      for (int64_t i = 0; i < H * ss; ++i) d_carry_in[i] = d_end_state ? d_end_state[i] : 0.0f;
    }
    return;
  }
  const int64_t n_items = H * n_segments;
#pragma omp parallel
  {
    ChunkScratch scratch(dh);
    std::vector<float> dn(ss);
    int64_t decay_head = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t h = item / n_segments, si = item % n_segments;
      if (h != decay_head) {
        FillDecay(log_decay[h], scratch.decay.data());
        decay_head = h;
      }
      const Segment seg = GetSegment(cu_seqlens, n_segments, si);
      BackwardSegment(q + h * dh, k + h * dh, v + h * dh,
                      seg.first && carry_in ? carry_in + h * ss : nullptr, scale, dims, seg,
                      dout + h * dh, seg.last && d_end_state ? d_end_state + h * ss : nullptr,
                      dq + h * dh, dk + h * dh, dv + h * dh,
                      seg.first && d_carry_in ? d_carry_in + h * ss : nullptr, scratch, dn);
    }
  }
}

void LightningCarryCorrection(const float* q, const float* log_decay, const float* P, float scale,
                              const LightningDims& dims, int64_t n_tokens, float* out) {
  const int64_t H = dims.H, dh = dims.Dh, ld = dims.qkv_stride, ldo = H * dh;
  const int64_t n_blocks = (n_tokens + kChunk - 1) / kChunk;
#pragma omp parallel
  {
    std::vector<float> rows(kChunk * dh);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < H * n_blocks; ++item) {
      const int64_t h = item / n_blocks, t0 = (item % n_blocks) * kChunk;
      const int64_t len = std::min(kChunk, n_tokens - t0);
      for (int64_t i = 0; i < len; ++i) {
        const float f = scale * std::exp(static_cast<float>(t0 + i + 1) * log_decay[h]);
        const float* src = q + (t0 + i) * ld + h * dh;
        for (int64_t j = 0; j < dh; ++j) rows[i * dh + j] = f * src[j];
      }
      ThreadLocalGemm(false, false, len, dh, dh, 1.0f, rows.data(), dh, P + h * dh * dh, dh, 1.0f,
                      out + t0 * ldo + h * dh, ldo);
    }
  }
}

void LightningCarryCorrectionBackward(const float* q, const float* log_decay, const float* P,
                                      float scale, const LightningDims& dims, int64_t n_tokens,
                                      const float* dout, float* dq, float* dP) {
  const int64_t H = dims.H, dh = dims.Dh, ld = dims.qkv_stride, ldo = H * dh;
#pragma omp parallel
  {
    std::vector<float> rows(kChunk * dh);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t0 = 0; t0 < n_tokens; t0 += kChunk) {
        const int64_t len = std::min(kChunk, n_tokens - t0);
        // dq_t += scale a^(t+1) dout_t P^T.
        for (int64_t i = 0; i < len; ++i) {
          const float f = scale * std::exp(static_cast<float>(t0 + i + 1) * log_decay[h]);
          const float* src = dout + (t0 + i) * ldo + h * dh;
          for (int64_t j = 0; j < dh; ++j) rows[i * dh + j] = f * src[j];
        }
        ThreadLocalGemm(false, true, len, dh, dh, 1.0f, rows.data(), dh, P + h * dh * dh, dh, 1.0f,
                        dq + t0 * ld + h * dh, ld);
        // dP += sum_t scale a^(t+1) q_t^T dout_t.
        for (int64_t i = 0; i < len; ++i) {
          const float f = scale * std::exp(static_cast<float>(t0 + i + 1) * log_decay[h]);
          const float* src = q + (t0 + i) * ld + h * dh;
          for (int64_t j = 0; j < dh; ++j) rows[i * dh + j] = f * src[j];
        }
        ThreadLocalGemm(true, false, dh, dh, len, 1.0f, rows.data(), dh, dout + t0 * ldo + h * dh,
                        ldo, 1.0f, dP + h * dh * dh, dh);
      }
    }
  }
}

}  // namespace spindle::kernels::cpu
