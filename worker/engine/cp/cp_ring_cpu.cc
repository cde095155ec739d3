// The Ring level's block operations on the CPU (see cp_ring_cpu.h), run by the ring loop of
// cp_ring.h.
#include "worker/engine/cp/cp_ring_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/attention.h"
#include "worker/engine/cp/cp_buffers.h"

namespace spindle {
namespace k = kernels::cpu;
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// The local queries against whole blocks, every pair masked by document and stream order.
class CpuRingOps : public RingBlockOps {
 public:
  CpuRingOps(const RingLevel& lv, const RingDims& d, RingPayload& payload, RingScratch& s)
      : lv_(lv), d_(d), payload_(payload), s_(s), n_(lv.local->T) {}

  int64_t block_bytes() const override { return n_ * payload_.width() * 4; }
  int64_t grad_bytes() const override { return block_bytes(); }

  absl::StatusOr<RingBuffers> Buffers(bool backward) override {
    const int64_t nb = n_ * payload_.width();
    RingBuffers b;
    for (int i = 0; i < 2; ++i) b.block[i] = Grow(s_.block[i], nb);
    if (backward) {
      for (int i = 0; i < 2; ++i) b.acc[i] = Grow(s_.acc[i], nb);
      b.share = Grow(s_.tmp, nb);
    }
    return b;
  }

  // Forward: Q, O, lse (the output starts on the diagonal).
  void SetForward(const float* Q, float* O, float* lse) { Q_ = Q, O_ = O, lse_ = lse; }
  // Backward: also dO and dQ (written on the diagonal, added to after).
  void SetBackward(const float* Q, const float* O, const float* lse, const float* dO, float* dQ) {
    Q_ = Q, Oc_ = O, lsec_ = lse, dO_ = dO, dQ_ = dQ;
  }

  absl::Status Forward(const void* block, int64_t owner, bool diagonal) override {
    const k::AttentionMask mask = Mask(owner);
    const float *K, *V;
    payload_.Expand(static_cast<const float*>(block), n_, &K, &V);
    float* O = diagonal ? O_ : Grow(s_.O, n_ * d_.H * d_.vd);
    float* lse = diagonal ? lse_ : Grow(s_.lse, n_ * d_.H);
    k::AttentionForward(Q_, K, V, mask, d_.scale, Dims(), O, lse);
    if (!diagonal) Merge(O_, lse_, O, lse, n_ * d_.H, d_.vd);
    return absl::OkStatus();
  }

  absl::Status Backward(const void* block, int64_t owner, bool diagonal, void* d_block) override {
    const k::AttentionMask mask = Mask(owner);
    const float* b = static_cast<const float*>(block);
    const float *K, *V;
    payload_.Expand(b, n_, &K, &V);
    const int64_t nq = n_ * d_.H * d_.qk;
    float* dQ = diagonal ? dQ_ : Grow(s_.dQ, nq);
    float* dK = Grow(s_.dK, n_ * d_.H * d_.qk);
    float* dV = Grow(s_.dV, n_ * d_.H * d_.vd);
    k::AttentionBackward(Q_, K, V, Oc_, lsec_, dO_, mask, d_.scale, Dims(), dQ, dK, dV);
    if (!diagonal) AddInto(dQ_, dQ, nq);
    payload_.Contract(b, n_, dK, dV, static_cast<float*>(d_block));
    return absl::OkStatus();
  }

  absl::Status ZeroGrad(void* g) override {
    float* p = static_cast<float*>(g);
    std::fill(p, p + n_ * payload_.width(), 0.0f);
    return absl::OkStatus();
  }
  absl::Status AddGrad(void* dst, const void* src) override {
    AddInto(static_cast<float*>(dst), static_cast<const float*>(src), n_ * payload_.width());
    return absl::OkStatus();
  }
  absl::Status Fence() override { return absl::OkStatus(); }  // the work is done on return

 private:
  k::AttentionDims Dims() const { return {n_, n_, d_.H, d_.qk, d_.vd}; }
  // Document ids and stream indices of rank `owner`'s tokens on the level, for the mask.
  k::AttentionMask Mask(int64_t owner) {
    const CpLayout& L = *lv_.layout;
    s_.kdoc.resize(n_);
    s_.kidx.resize(n_);
    for (int64_t t = 0; t < n_; ++t) {
      const int64_t i = L.StreamIndex(owner, t);
      s_.kidx[t] = static_cast<int32_t>(i);
      s_.kdoc[t] = L.doc[i];
    }
    const Batch& b = *lv_.local;
    return {b.doc.data(), b.idx.data(), s_.kdoc.data(), s_.kidx.data()};
  }

  const RingLevel& lv_;
  const RingDims d_;
  RingPayload& payload_;
  RingScratch& s_;
  const int64_t n_;
  const float* Q_ = nullptr;
  float* O_ = nullptr;
  float* lse_ = nullptr;
  const float* Oc_ = nullptr;
  const float* lsec_ = nullptr;
  const float* dO_ = nullptr;
  float* dQ_ = nullptr;
};

}  // namespace

absl::Status RingAttentionForward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                  const float* Q, const float* own, float* O, float* lse,
                                  RingScratch& s) {
  CpuRingOps ops(lv, d, payload, s);
  ops.SetForward(Q, O, lse);
  return RingForward(*lv.layout, *lv.comm, ops, own);
}

absl::Status RingAttentionBackward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                   const float* Q, const float* own, const float* O,
                                   const float* lse, const float* dO, float* dQ, float* d_own,
                                   RingScratch& s) {
  CpuRingOps ops(lv, d, payload, s);
  ops.SetBackward(Q, O, lse, dO, dQ);
  return RingBackward(*lv.layout, *lv.comm, ops, own, d_own);
}

}  // namespace spindle
