// The ring loop of MLA's Ring level (see cp_ring.h).
#include "worker/engine/cp/cp_ring.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/attention.h"
#include "worker/engine/cp/cp_buffers.h"

namespace spindle {
namespace k = kernels::cpu;
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Whether a query of chunk qc may see a key of chunk kc: never a later chunk; its own chunk
// always (a token sees itself); an earlier chunk when the document of its last token continues
// to the first token of qc (documents are contiguous runs of the stream).
bool ChunkSees(const CpLayout& L, int64_t qc, int64_t kc) {
  if (kc > qc) return false;
  if (kc == qc) return true;
  return L.doc[kc * L.chunk + L.chunk - 1] == L.doc[qc * L.chunk];
}

bool BlockVisible(const CpLayout& L, int64_t q_rank, int64_t k_rank) {
  for (int qs = 0; qs < 2; ++qs)
    for (int ks = 0; ks < 2; ++ks)
      if (ChunkSees(L, L.ChunkOf(q_rank, qs), L.ChunkOf(k_rank, ks))) return true;
  return false;
}

// Document ids and stream indices of rank b's tokens on the level.
void BlockMask(const CpLayout& L, int64_t b, int64_t n, RingScratch& s) {
  s.kdoc.resize(n);
  s.kidx.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t i = L.StreamIndex(b, t);
    s.kidx[t] = static_cast<int32_t>(i);
    s.kdoc[t] = L.doc[i];
  }
}

// (O, lse) <- the log-sum-exp merge of (O, lse) and (Ob, lseb), in fp32; a side with lse = -inf
// saw no key.
void Merge(float* O, float* lse, const float* Ob, const float* lseb, int64_t rows, int64_t vd) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const float lb = lseb[i];
    if (lb == kNegInf) continue;
    const float la = lse[i];
    float* o = O + i * vd;
    const float* ob = Ob + i * vd;
    if (la == kNegInf) {
      std::copy(ob, ob + vd, o);
      lse[i] = lb;
      continue;
    }
    const float m = std::max(la, lb);
    const float wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
    const float ca = wa / sum, cb = wb / sum;
    for (int64_t j = 0; j < vd; ++j) o[j] = ca * o[j] + cb * ob[j];
    lse[i] = m + std::log(sum);
  }
}

void AddInto(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

absl::Status RingAttentionForward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                  const float* Q, const float* own, float* O, float* lse,
                                  RingScratch& s) {
  const CpLayout& L = *lv.layout;
  const Batch& b = *lv.local;
  const int64_t R = L.cp, me = L.rank, n = b.T, W = payload.width();
  const int next = static_cast<int>((me + 1) % R), prev = static_cast<int>((me + R - 1) % R);
  const k::AttentionDims dims{n, n, d.H, d.qk, d.vd};
  float* Ob = Grow(s.O, n * d.H * d.vd);
  float* lseb = Grow(s.lse, n * d.H);
  const float* cur = own;
  for (int64_t step = 0; step < R; ++step) {
    const int64_t owner = (me - step + R) % R;
    CommHandle h;
    float* nxt = nullptr;
    if (step + 1 < R) {
      nxt = Grow(s.block[step % 2], n * W);
      h = lv.comm->SendRecvAsync(cur, next, nxt, prev, n * W * 4, CommLayer::kMla);
    }
    if (step == 0 || BlockVisible(L, me, owner)) {
      BlockMask(L, owner, n, s);
      const float* K;
      const float* V;
      payload.Expand(cur, n, &K, &V);
      const k::AttentionMask mask{b.doc.data(), b.idx.data(), s.kdoc.data(), s.kidx.data()};
      // The diagonal block first: every query sees itself there, so it starts the merge.
      k::AttentionForward(Q, K, V, mask, d.scale, dims, step == 0 ? O : Ob, step == 0 ? lse : lseb);
      if (step > 0) Merge(O, lse, Ob, lseb, n * d.H, d.vd);
    }
    if (absl::Status st = h.Wait(); !st.ok()) return st;
    if (nxt) cur = nxt;
  }
  return absl::OkStatus();
}

absl::Status RingAttentionBackward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                   const float* Q, const float* own, const float* O,
                                   const float* lse, const float* dO, float* dQ, float* d_own,
                                   RingScratch& s) {
  const CpLayout& L = *lv.layout;
  const Batch& b = *lv.local;
  const int64_t R = L.cp, me = L.rank, n = b.T, W = payload.width();
  const int next = static_cast<int>((me + 1) % R), prev = static_cast<int>((me + R - 1) % R);
  const k::AttentionDims dims{n, n, d.H, d.qk, d.vd};
  const int64_t nq = n * d.H * d.qk, nb = n * W;
  float* dQb = Grow(s.dQ, nq);
  float* dKb = Grow(s.dK, n * d.H * d.qk);
  float* dVb = Grow(s.dV, n * d.H * d.vd);
  float* tmp = Grow(s.tmp, nb);
  Grow(s.acc[0], nb);
  Grow(s.acc[1], nb);
  // acc[out]: the accumulator this rank sends next; acc[1 - out] receives the one it gets.
  int out = 0;
  CommHandle acc_h;  // the accumulator exchange in flight
  const float* cur = own;
  for (int64_t step = 0; step < R; ++step) {
    const int64_t owner = (me - step + R) % R;
    CommHandle h;
    float* nxt = nullptr;
    if (step + 1 < R) {
      nxt = Grow(s.block[step % 2], nb);
      h = lv.comm->SendRecvAsync(cur, next, nxt, prev, nb * 4, CommLayer::kMla);
    }
    // This rank's queries' share of the block's gradient: into d_own on the diagonal, into the
    // accumulator to send on step 1 (nothing received yet), else beside the received one.
    float* share = step == 0 ? d_own : step == 1 ? s.acc[out].data() : tmp;
    const bool visible = step == 0 || BlockVisible(L, me, owner);
    if (visible) {
      BlockMask(L, owner, n, s);
      const float* K;
      const float* V;
      payload.Expand(cur, n, &K, &V);
      const k::AttentionMask mask{b.doc.data(), b.idx.data(), s.kdoc.data(), s.kidx.data()};
      k::AttentionBackward(Q, K, V, O, lse, dO, mask, d.scale, dims, step == 0 ? dQ : dQb, dKb,
                           dVb);
      if (step > 0) AddInto(dQ, dQb, nq);
      payload.Contract(cur, n, dKb, dVb, share);
    } else if (step == 1) {
      std::fill(share, share + nb, 0.0f);
    }
    if (step >= 1) {
      if (step >= 2) {
        // The accumulator of this block arrived in acc[1 - out] during the step.
        if (absl::Status st = acc_h.Wait(); !st.ok()) return st;
        out = 1 - out;
        if (visible) AddInto(s.acc[out].data(), tmp, nb);
      }
      acc_h = lv.comm->SendRecvAsync(s.acc[out].data(), next, s.acc[1 - out].data(), prev, nb * 4,
                                     CommLayer::kMla);
    }
    if (absl::Status st = h.Wait(); !st.ok()) return st;
    if (nxt) cur = nxt;
  }
  if (R > 1) {
    // The accumulator of this rank's own block, back from its trip.
    if (absl::Status st = acc_h.Wait(); !st.ok()) return st;
    AddInto(d_own, s.acc[1 - out].data(), nb);
  }
  return absl::OkStatus();
}

}  // namespace spindle
