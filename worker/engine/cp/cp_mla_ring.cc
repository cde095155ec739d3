// MLA's Ring and hybrid modes (see cp_attention.h): the ring loop of cp_ring.h on this rank's
// tokens (Ring), or on its Ulysses group's tokens for H / u heads after the Ulysses exchange of
// cp_ulysses.h (hybrid), with the payload the plan chose.
#include <cstring>
#include <memory>

#include "worker/engine/cp/cp_attention.h"
#include "worker/engine/cp/cp_buffers.h"
#include "worker/engine/cp/cp_mla_payload.h"
#include "worker/engine/cp/cp_ulysses.h"

namespace spindle {
namespace {

MlaHeads Heads(const MlaCpArgs& a, int64_t H) { return {H, a.qk - a.rd, a.rd, a.vd, a.kv}; }

// The payload for H heads starting at head h0 (kv_b's rows of those heads; dW_kv_b may be null
// in the forward).
std::unique_ptr<RingPayload> MakePayload(const MlaCpArgs& a, int64_t H, int64_t h0,
                                         const float* W_kv_b, float* dW_kv_b) {
  if (a.payload == MlaRingPayload::kKv) return std::make_unique<KvRingPayload>(H, a.qk, a.vd);
  const int64_t rows = h0 * (a.qk - a.rd + a.vd) * a.kv;
  return std::make_unique<LatentRingPayload>(Heads(a, H), W_kv_b + rows,
                                             dW_kv_b ? dW_kv_b + rows : nullptr);
}

int64_t PayloadWidth(const MlaCpArgs& a, int64_t H) {
  return a.payload == MlaRingPayload::kKv ? H * (a.qk + a.vd) : a.kv + a.rd;
}

// This member's heads in the hybrid mode.
struct HybridHeads {
  int64_t u, Hl, h0;
};
HybridHeads HeadsOfMember(const MlaCpArgs& a) {
  const CpGroups g = a.layout->groups();
  const int64_t Hl = a.H / g.u;
  return {g.u, Hl, g.Member(a.layout->rank) * Hl};
}

}  // namespace

absl::Status MlaRingForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                            const float* V, const float* latent, const float* W_kv_b, float* O,
                            float* lse, std::vector<float>* saved) {
  const int64_t T = a.local->T, H = a.H;
  // saved: this rank's block, [K | V] or the latent.
  saved->resize(T * PayloadWidth(a, H));
  if (a.payload == MlaRingPayload::kKv) {
    std::memcpy(saved->data(), K, T * H * a.qk * sizeof(float));
    std::memcpy(saved->data() + T * H * a.qk, V, T * H * a.vd * sizeof(float));
  } else {
    std::memcpy(saved->data(), latent, saved->size() * sizeof(float));
  }
  std::unique_ptr<RingPayload> pl = MakePayload(a, H, 0, W_kv_b, nullptr);
  return RingAttentionForward({a.local, a.layout, a.comm}, {H, a.qk, a.vd, a.scale}, *pl, Q,
                              saved->data(), O, lse, s.ring);
}

absl::Status MlaRingBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                             const float* Q, const float* O, const float* lse, const float* W_kv_b,
                             const float* dO, float* dQ, float* dK, float* dV, float* d_latent,
                             float* dW_kv_b) {
  const int64_t T = a.local->T, H = a.H;
  std::unique_ptr<RingPayload> pl = MakePayload(a, H, 0, W_kv_b, dW_kv_b);
  const bool kv = a.payload == MlaRingPayload::kKv;
  float* d_own = kv ? Grow(s.e, T * PayloadWidth(a, H)) : d_latent;
  if (absl::Status st = RingAttentionBackward({a.local, a.layout, a.comm}, {H, a.qk, a.vd, a.scale},
                                              *pl, Q, saved.data(), O, lse, dO, dQ, d_own, s.ring);
      !st.ok())
    return st;
  if (kv) {
    std::memcpy(dK, d_own, T * H * a.qk * sizeof(float));
    std::memcpy(dV, d_own + T * H * a.qk, T * H * a.vd * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status MlaHybridForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                              const float* V, const float* latent, const float* W_kv_b, float* O,
                              std::vector<float>* saved) {
  const CpBatch& G = *a.hybrid.group;
  const HybridHeads hh = HeadsOfMember(a);
  const UlyssesGroup g = HybridUlyssesGroup(*a.layout);
  const int64_t T = a.local->T, H = a.H, Hl = hh.Hl, Tg = G.local.T, qk = a.qk, vd = a.vd;
  const int64_t W = PayloadWidth(a, Hl);
  // saved: Qg [Tg, Hl, qk], the group's block [Tg, W], Og [Tg, Hl, vd], lse_g [Tg, Hl].
  saved->resize(Tg * (Hl * qk + W + Hl * vd + Hl));
  float* Qg = saved->data();
  float* own = Qg + Tg * Hl * qk;
  float* Og = own + Tg * W;
  float* lse = Og + Tg * Hl * vd;
  Communicator& uc = *a.hybrid.ulysses;
  if (a.payload == MlaRingPayload::kKv) {
    if (absl::Status st = UlyssesToHeads(
            uc, g, T, H,
            {{const_cast<float*>(Q), qk}, {const_cast<float*>(K), qk}, {const_cast<float*>(V), vd}},
            {{Qg, qk}, {own, qk}, {own + Tg * Hl * qk, vd}}, s.send, s.recv, CommLayer::kMla);
        !st.ok())
      return st;
  } else {
    if (absl::Status st = UlyssesToHeads(uc, g, T, H, {{const_cast<float*>(Q), qk}}, {{Qg, qk}},
                                         s.send, s.recv, CommLayer::kMla);
        !st.ok())
      return st;
    float* blocks = Grow(s.recv, hh.u * T * W);
    if (absl::Status st = uc.AllGather(latent, T * W, CommType::kF32, blocks, CommLayer::kMla);
        !st.ok())
      return st;
    MemberBlocksToRows(blocks, g, T, W, own);
  }
  std::unique_ptr<RingPayload> pl = MakePayload(a, Hl, hh.h0, W_kv_b, nullptr);
  if (absl::Status st = RingAttentionForward({&G.local, &G.layout, a.hybrid.ring},
                                             {Hl, qk, vd, a.scale}, *pl, Qg, own, Og, lse, s.ring);
      !st.ok())
    return st;
  return UlyssesToTokens(uc, g, T, H, {{Og, vd}}, {{O, vd}}, s.send, s.recv, CommLayer::kMla);
}

absl::Status MlaHybridBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                               const float* W_kv_b, const float* dO, float* dQ, float* dK,
                               float* dV, float* d_latent, float* dW_kv_b) {
  const CpBatch& G = *a.hybrid.group;
  const HybridHeads hh = HeadsOfMember(a);
  const UlyssesGroup g = HybridUlyssesGroup(*a.layout);
  const int64_t T = a.local->T, H = a.H, Hl = hh.Hl, Tg = G.local.T, qk = a.qk, vd = a.vd;
  const int64_t W = PayloadWidth(a, Hl);
  const float* Qg = saved.data();
  const float* own = Qg + Tg * Hl * qk;
  const float* Og = own + Tg * W;
  const float* lse = Og + Tg * Hl * vd;
  Communicator& uc = *a.hybrid.ulysses;
  float* dOg = Grow(s.c, Tg * Hl * vd);
  if (absl::Status st = UlyssesToHeads(uc, g, T, H, {{const_cast<float*>(dO), vd}}, {{dOg, vd}},
                                       s.send, s.recv, CommLayer::kMla);
      !st.ok())
    return st;
  float* dQg = Grow(s.a, Tg * Hl * qk);
  float* d_own = Grow(s.e, Tg * W);
  std::unique_ptr<RingPayload> pl = MakePayload(a, Hl, hh.h0, W_kv_b, dW_kv_b);
  if (absl::Status st =
          RingAttentionBackward({&G.local, &G.layout, a.hybrid.ring}, {Hl, qk, vd, a.scale}, *pl,
                                Qg, own, Og, lse, dOg, dQg, d_own, s.ring);
      !st.ok())
    return st;
  if (a.payload == MlaRingPayload::kKv)
    return UlyssesToTokens(uc, g, T, H, {{dQg, qk}, {d_own, qk}, {d_own + Tg * Hl * qk, vd}},
                           {{dQ, qk}, {dK, qk}, {dV, vd}}, s.send, s.recv, CommLayer::kMla);
  if (absl::Status st =
          UlyssesToTokens(uc, g, T, H, {{dQg, qk}}, {{dQ, qk}}, s.send, s.recv, CommLayer::kMla);
      !st.ok())
    return st;
  // Each member's heads contributed to every group token's latent: summed back to the owners.
  float* blocks = Grow(s.b, hh.u * T * W);
  RowsToMemberBlocks(d_own, g, T, W, blocks);
  return uc.ReduceScatterSum(blocks, T * W, d_latent, CommLayer::kMla);
}

}  // namespace spindle
