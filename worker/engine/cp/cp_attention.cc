// Context-parallel Lightning and MLA cores (see cp_attention.h). Every per-chunk or per-head
// piece of work here is a constant number of kernel calls per layer (two chunks per rank, one
// scan pass over all chunks and heads), never a loop over documents or ranks issuing kernels.
#include "worker/engine/cp/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"
#include "worker/engine/cp/cp_buffers.h"
#include "worker/engine/cp/cp_mla_payload.h"
#include "worker/engine/cp/cp_ulysses.h"

namespace spindle {
namespace k = kernels::cpu;
namespace {

// M[h] = scale * sum_{t < n} a_h^(base + sign * t) x[t, h, :]^T y[t, h, :]  (Dh x Dh, overwritten)
// for x, y of token stride `stride`: the end state of a segment (base = n - 1, sign = -1) and the
// carry-in gradient of a chunk's first segment (base = 1, sign = +1) as one GEMM per head.
void HeadOuter(const float* x, const float* y, int64_t stride, int64_t n, int64_t H, int64_t Dh,
               const float* log_decay, int64_t base, int64_t sign, float scale, float* M,
               std::vector<float>& tmp) {
  if (n <= 0) {
    std::fill(M, M + H * Dh * Dh, 0.0f);
    return;
  }
  float* xw = Grow(tmp, n * H * Dh);  // [H][n][Dh]
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < n; ++t) {
      const float w = scale * std::exp(log_decay[h] * static_cast<float>(base + sign * t));
      const float* src = x + t * stride + h * Dh;
      float* dst = xw + (h * n + t) * Dh;
      for (int64_t j = 0; j < Dh; ++j) dst[j] = w * src[j];
    }
  for (int64_t h = 0; h < H; ++h)
    k::Gemm(true, false, Dh, Dh, n, 1.0f, xw + h * n * Dh, Dh, y + h * Dh, stride, 0.0f,
            M + h * Dh * Dh, Dh);
}

}  // namespace

// ---- Lightning, AllGather ---------------------------------------------------------------------

absl::Status LightningAllGatherForward(const LightningCpArgs& a, CpScratch& s,
                                       const std::function<void()>& overlap, float* out,
                                       float* P) {
  const Batch& b = *a.local;
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, SZ = H * Dh * Dh, cp = L.cp;
  float* send = Grow(s.send, 2 * SZ);
  float* recv = Grow(s.recv, 2 * cp * SZ);
  for (int slot = 0; slot < 2; ++slot) {
    const Piece& p = b.pieces[slot];
    const int64_t start = p.cu_seqlens[p.n_segments() - 1], n = p.len - start;
    const int64_t off = (p.begin + start) * d;
    HeadOuter(a.k + off, a.v + off, d, n, H, Dh, a.log_decay, n - 1, -1, 1.0f, send + slot * SZ,
              s.a);
  }
  CommHandle h = a.comm->AllGatherAsync(send, 2 * SZ, CommType::kF32, recv, CommLayer::kLightning);
  for (const Piece& p : b.pieces) {
    const int64_t off = p.begin * d;
    k::LightningForward(a.q + off, a.k + off, a.v + off, a.log_decay, p.cu_seqlens.data(),
                        p.n_segments(), nullptr, a.scale, {p.len, H, Dh, d}, out + off, nullptr);
  }
  if (overlap) overlap();
  if (absl::Status st = h.Wait(); !st.ok()) return st;
  // Prefix over the 2cp chunks in stream order, all heads and state elements in one pass:
  // P_0 = 0, P_{c+1} = S_c + (b_c ? 0 : a^L P_c).
  const int64_t c_mine0 = L.ChunkOf(L.rank, 0), c_mine1 = L.ChunkOf(L.rank, 1);
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < SZ; ++e) {
    const float aL = std::exp(a.log_decay[e / (Dh * Dh)] * static_cast<float>(L.chunk));
    float run = 0.0f;
    for (int64_t c = 0; c < 2 * cp; ++c) {
      if (c == c_mine0) P[e] = run;
      if (c == c_mine1) P[SZ + e] = run;
#ifdef SPINDLE_TEST_FAULT_DROP_LIGHTNING_STATE
      // A broken layout for the parity canary's test (tests/CMakeLists.txt, parity_fault_test
      // only; never in a shipped binary): rank 1's chunk states are lost.
      const float S =
          L.RankOfChunk(c) == 1 ? 0.0f : recv[(L.RankOfChunk(c) * 2 + L.SlotOfChunk(c)) * SZ + e];
#else
      const float S = recv[(L.RankOfChunk(c) * 2 + L.SlotOfChunk(c)) * SZ + e];
#endif
      run = S + (L.chunks[c].has_start ? 0.0f : aL * run);
    }
  }
  for (int slot = 0; slot < 2; ++slot) {
    const CpChunk& ch = L.chunks[L.ChunkOf(L.rank, slot)];
    if (!ch.continues) continue;
    const Piece& p = b.pieces[slot];
    const int64_t off = p.begin * d;
    k::LightningCarryCorrection(a.q + off, a.log_decay, P + slot * SZ, a.scale, {p.len, H, Dh, d},
                                ch.first_segment, out + off);
  }
  return absl::OkStatus();
}

absl::Status LightningAllGatherBackward(const LightningCpArgs& a, CpScratch& s, const float* P,
                                        const float* dout, const std::function<void()>& overlap,
                                        float* dq, float* dk, float* dv) {
  const Batch& b = *a.local;
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, SZ = H * Dh * Dh, cp = L.cp;
  float* send = Grow(s.send, 2 * SZ);
  float* recv = Grow(s.recv, 2 * cp * SZ);
  // dP of each local chunk from its corrected outputs: scale * sum_t a^(t+1) q_t^T dout_t.
  for (int slot = 0; slot < 2; ++slot) {
    const CpChunk& ch = L.chunks[L.ChunkOf(L.rank, slot)];
    const int64_t off = b.pieces[slot].begin * d;
    HeadOuter(a.q + off, dout + off, d, ch.continues ? ch.first_segment : 0, H, Dh, a.log_decay, 1,
              1, a.scale, send + slot * SZ, s.a);
  }
  CommHandle h = a.comm->AllGatherAsync(send, 2 * SZ, CommType::kF32, recv, CommLayer::kLightning);
  if (overlap) overlap();
  if (absl::Status st = h.Wait(); !st.ok()) return st;
  // Reverse scan: G_{2cp-1} = 0, G_{c-1} = dP_c + (b_c ? 0 : a^L G_c) (dP_c = 0 unless c continues).
  float* G = Grow(s.b, 2 * SZ);
  const int64_t c_mine0 = L.ChunkOf(L.rank, 0), c_mine1 = L.ChunkOf(L.rank, 1);
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < SZ; ++e) {
    const float aL = std::exp(a.log_decay[e / (Dh * Dh)] * static_cast<float>(L.chunk));
    float run = 0.0f;
    for (int64_t c = 2 * cp - 1; c >= 0; --c) {
      if (c == c_mine0) G[e] = run;
      if (c == c_mine1) G[SZ + e] = run;
      const CpChunk& ch = L.chunks[c];
      const float dP = ch.continues ? recv[(L.RankOfChunk(c) * 2 + L.SlotOfChunk(c)) * SZ + e] : 0.0f;
      run = dP + (ch.has_start ? 0.0f : aL * run);
    }
  }
  for (int slot = 0; slot < 2; ++slot) {
    const CpChunk& ch = L.chunks[L.ChunkOf(L.rank, slot)];
    const Piece& p = b.pieces[slot];
    const int64_t off = p.begin * d;
    k::LightningBackward(a.q + off, a.k + off, a.v + off, a.log_decay, p.cu_seqlens.data(),
                         p.n_segments(), ch.continues ? P + slot * SZ : nullptr, a.scale,
                         {p.len, H, Dh, d}, dout + off, G + slot * SZ, dq + off, dk + off,
                         dv + off, nullptr);
  }
  return absl::OkStatus();
}

// ---- Lightning, All2All and hybrid -----------------------------------------------------------

namespace {

// The head-split core of a Ulysses mode on the group's gathered tokens: q, k, v [n T, Hl, Dh]
// dense in, outputs (or input gradients) out.
using LightningCore =
    std::function<absl::Status(const float* qf, const float* kf, const float* vf, float* of)>;
using LightningCoreBackward =
    std::function<absl::Status(const float* qf, const float* kf, const float* vf, const float* dof,
                               float* dqf, float* dkf, float* dvf)>;

// q, k, v (token stride d) to the group's tokens for this member's heads (kept in `saved`), the
// core, outputs back.
absl::Status LightningUlyssesForward(const LightningCpArgs& a, const UlyssesGroup& g,
                                     Communicator& comm, CpScratch& s, std::vector<float>* saved,
                                     const LightningCore& core, float* out) {
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, Hl = H / g.members, T = a.local->T;
  const int64_t Tg = g.members * T, n3 = 3 * T * d;
  float* loc = Grow(s.a, n3);
  CopyStrided(a.q, d, T, d, loc);
  CopyStrided(a.k, d, T, d, loc + T * d);
  CopyStrided(a.v, d, T, d, loc + 2 * T * d);
  saved->resize(n3);
  float* qf = saved->data();
  float* kf = qf + Tg * Hl * Dh;
  float* vf = kf + Tg * Hl * Dh;
  if (absl::Status st =
          UlyssesToHeads(comm, g, T, H, {{loc, Dh}, {loc + T * d, Dh}, {loc + 2 * T * d, Dh}},
                         {{qf, Dh}, {kf, Dh}, {vf, Dh}}, s.send, s.recv, CommLayer::kLightning);
      !st.ok())
    return st;
  float* of = Grow(s.c, Tg * Hl * Dh);
  if (absl::Status st = core(qf, kf, vf, of); !st.ok()) return st;
  return UlyssesToTokens(comm, g, T, H, {{of, Dh}}, {{out, Dh}}, s.send, s.recv,
                         CommLayer::kLightning);
}

absl::Status LightningUlyssesBackward(const LightningCpArgs& a, const UlyssesGroup& g,
                                      Communicator& comm, CpScratch& s,
                                      const std::vector<float>& saved, const float* dout,
                                      const LightningCoreBackward& core, float* dq, float* dk,
                                      float* dv) {
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, Hl = H / g.members, T = a.local->T;
  const int64_t Tg = g.members * T;
  float* dof = Grow(s.c, Tg * Hl * Dh);
  if (absl::Status st = UlyssesToHeads(comm, g, T, H, {{const_cast<float*>(dout), Dh}}, {{dof, Dh}},
                                       s.send, s.recv, CommLayer::kLightning);
      !st.ok())
    return st;
  const float* qf = saved.data();
  const float* kf = qf + Tg * Hl * Dh;
  const float* vf = kf + Tg * Hl * Dh;
  float* gr = Grow(s.e, 3 * T * d);
  float* dqf = gr;
  float* dkf = gr + Tg * Hl * Dh;
  float* dvf = dkf + Tg * Hl * Dh;
  if (absl::Status st = core(qf, kf, vf, dof, dqf, dkf, dvf); !st.ok()) return st;
  // dq, dk, dv have token stride d in the model: dense [T, d] each (they are).
  return UlyssesToTokens(comm, g, T, H, {{dqf, Dh}, {dkf, Dh}, {dvf, Dh}},
                         {{dq, Dh}, {dk, Dh}, {dv, Dh}}, s.send, s.recv, CommLayer::kLightning);
}

// The hybrid core's arguments: the Lightning AllGather mode on the group level for this member's
// heads.
LightningCpArgs HybridLevelArgs(const LightningCpArgs& a, const float* qf, const float* kf,
                                const float* vf) {
  const CpGroups g = a.layout->groups();
  const int64_t Hl = a.H / g.u, h0 = g.Member(a.layout->rank) * Hl;
  return {qf,
          kf,
          vf,
          a.log_decay + h0,
          Hl,
          a.Dh,
          a.scale,
          &a.hybrid.group->local,
          &a.hybrid.group->layout,
          a.hybrid.ring};
}

}  // namespace

absl::Status LightningAll2AllForward(const LightningCpArgs& a, CpScratch& s, float* out,
                                     std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const int64_t Hl = a.H / L.cp;
  return LightningUlyssesForward(
      a, WholeCpGroup(L), *a.comm, s, saved,
      [&](const float* qf, const float* kf, const float* vf, float* of) {
        k::LightningForward(qf, kf, vf, a.log_decay + L.rank * Hl, L.cu_seqlens.data(),
                            static_cast<int64_t>(L.cu_seqlens.size()) - 1, nullptr, a.scale,
                            {L.T_full, Hl, a.Dh, Hl * a.Dh}, of, nullptr);
        return absl::OkStatus();
      },
      out);
}

absl::Status LightningAll2AllBackward(const LightningCpArgs& a, CpScratch& s,
                                      const std::vector<float>& saved, const float* dout, float* dq,
                                      float* dk, float* dv) {
  const CpLayout& L = *a.layout;
  const int64_t Hl = a.H / L.cp;
  return LightningUlyssesBackward(
      a, WholeCpGroup(L), *a.comm, s, saved, dout,
      [&](const float* qf, const float* kf, const float* vf, const float* dof, float* dqf,
          float* dkf, float* dvf) {
        k::LightningBackward(qf, kf, vf, a.log_decay + L.rank * Hl, L.cu_seqlens.data(),
                             static_cast<int64_t>(L.cu_seqlens.size()) - 1, nullptr, a.scale,
                             {L.T_full, Hl, a.Dh, Hl * a.Dh}, dof, nullptr, dqf, dkf, dvf, nullptr);
        return absl::OkStatus();
      },
      dq, dk, dv);
}

absl::Status LightningHybridForward(const LightningCpArgs& a, CpScratch& s,
                                    const std::function<void()>& overlap, float* out, float* P,
                                    std::vector<float>* saved) {
  return LightningUlyssesForward(
      a, HybridUlyssesGroup(*a.layout), *a.hybrid.ulysses, s, saved,
      [&](const float* qf, const float* kf, const float* vf, float* of) {
        return LightningAllGatherForward(HybridLevelArgs(a, qf, kf, vf), s, overlap, of, P);
      },
      out);
}

absl::Status LightningHybridBackward(const LightningCpArgs& a, CpScratch& s, const float* P,
                                     const std::vector<float>& saved, const float* dout,
                                     const std::function<void()>& overlap, float* dq, float* dk,
                                     float* dv) {
  return LightningUlyssesBackward(
      a, HybridUlyssesGroup(*a.layout), *a.hybrid.ulysses, s, saved, dout,
      [&](const float* qf, const float* kf, const float* vf, const float* dof, float* dqf,
          float* dkf, float* dvf) {
        return LightningAllGatherBackward(HybridLevelArgs(a, qf, kf, vf), s, P, dof, overlap, dqf,
                                          dkf, dvf);
      },
      dq, dk, dv);
}

// ---- MLA, All2All -----------------------------------------------------------------------------

absl::Status MlaAll2AllForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                               const float* V, float* O, std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, cp = L.cp, Hl = H / cp, T = a.local->T, Tf = L.T_full;
  const int64_t qk = a.qk, vd = a.vd;
  const UlyssesGroup g = WholeCpGroup(L);
  // saved: Qf, Kf [Tf, Hl, qk], Vf, Of [Tf, Hl, vd], lse [Tf, Hl].
  saved->resize(Tf * Hl * (2 * qk + 2 * vd + 1));
  float* qf = saved->data();
  float* kf = qf + Tf * Hl * qk;
  float* vf = kf + Tf * Hl * qk;
  float* of = vf + Tf * Hl * vd;
  float* lse = of + Tf * Hl * vd;
  if (absl::Status st = UlyssesToHeads(
          *a.comm, g, T, H,
          {{const_cast<float*>(Q), qk}, {const_cast<float*>(K), qk}, {const_cast<float*>(V), vd}},
          {{qf, qk}, {kf, qk}, {vf, vd}}, s.send, s.recv, CommLayer::kMla);
      !st.ok())
    return st;
  k::AttentionMask mask{L.doc.data(), L.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionForward(qf, kf, vf, mask, a.scale, {Tf, Tf, Hl, qk, vd}, of, lse);
  return UlyssesToTokens(*a.comm, g, T, H, {{of, vd}}, {{O, vd}}, s.send, s.recv, CommLayer::kMla);
}

absl::Status MlaAll2AllBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                                const float* dO, float* dQ, float* dK, float* dV) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, cp = L.cp, Hl = H / cp, T = a.local->T, Tf = L.T_full;
  const int64_t qk = a.qk, vd = a.vd;
  const UlyssesGroup g = WholeCpGroup(L);
  float* dof = Grow(s.c, Tf * Hl * vd);
  if (absl::Status st = UlyssesToHeads(*a.comm, g, T, H, {{const_cast<float*>(dO), vd}},
                                       {{dof, vd}}, s.send, s.recv, CommLayer::kMla);
      !st.ok())
    return st;
  const float* qf = saved.data();
  const float* kf = qf + Tf * Hl * qk;
  const float* vf = kf + Tf * Hl * qk;
  const float* of = vf + Tf * Hl * vd;
  const float* lse = of + Tf * Hl * vd;
  float* gr = Grow(s.e, T * H * (2 * qk + vd));
  float* dqf = gr;
  float* dkf = dqf + Tf * Hl * qk;
  float* dvf = dkf + Tf * Hl * qk;
  k::AttentionMask mask{L.doc.data(), L.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionBackward(qf, kf, vf, of, lse, dof, mask, a.scale, {Tf, Tf, Hl, qk, vd}, dqf, dkf,
                       dvf);
  return UlyssesToTokens(*a.comm, g, T, H, {{dqf, qk}, {dkf, qk}, {dvf, vd}},
                         {{dQ, qk}, {dK, qk}, {dV, vd}}, s.send, s.recv, CommLayer::kMla);
}

// ---- MLA, AllGather ---------------------------------------------------------------------------

namespace {
// Keys the local queries can see: the stream prefix up to this rank's last token.
int64_t VisibleKeys(const CpLayout& L) { return (2 * L.cp - L.rank) * L.chunk; }

MlaHeads Heads(const MlaCpArgs& a) { return {a.H, a.qk - a.rd, a.rd, a.vd, a.kv}; }
}  // namespace

absl::Status MlaAllGatherForward(const MlaCpArgs& a, CpScratch& s, const float* Q,
                                 const float* latent, const float* W_kv_b, float* O, float* lse,
                                 std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const Batch& b = *a.local;
  const int64_t H = a.H, T = b.T, qk = a.qk, vd = a.vd;
  const int64_t w = a.kv + a.rd, Tk = VisibleKeys(L);
  float* recv = Grow(s.recv, L.cp * T * w);
  if (absl::Status st = a.comm->AllGather(latent, T * w, CommType::kF32, recv, CommLayer::kMla);
      !st.ok())
    return st;
  // saved: latent_g [Tk, w] in stream order, K_g [Tk, H, qk], V_g [Tk, H, vd].
  saved->resize(Tk * (w + H * qk + H * vd));
  float* lat = saved->data();
  float* Kg = lat + Tk * w;
  float* Vg = Kg + Tk * H * qk;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < L.cp; ++i)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t st = L.StreamIndex(i, t);
      if (st < Tk) std::memcpy(lat + st * w, recv + (i * T + t) * w, w * sizeof(float));
    }
  MlaExpandLatent(lat, Tk, W_kv_b, Heads(a), s.c, Kg, Vg);
  k::AttentionMask mask{b.doc.data(), b.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionForward(Q, Kg, Vg, mask, a.scale, {T, Tk, H, qk, vd}, O, lse);
  return absl::OkStatus();
}

absl::Status MlaAllGatherBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                                  const float* Q, const float* O, const float* lse,
                                  const float* W_kv_b, const float* dO, float* dQ,
                                  float* d_latent, float* dW_kv_b) {
  const CpLayout& L = *a.layout;
  const Batch& b = *a.local;
  const int64_t H = a.H, T = b.T, qk = a.qk, vd = a.vd;
  const int64_t w = a.kv + a.rd, Tk = VisibleKeys(L);
  const float* lat = saved.data();
  const float* Kg = lat + Tk * w;
  const float* Vg = Kg + Tk * H * qk;
  float* dKg = Grow(s.a, Tk * H * qk);
  float* dVg = Grow(s.b, Tk * H * vd);
  k::AttentionMask mask{b.doc.data(), b.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionBackward(Q, Kg, Vg, O, lse, dO, mask, a.scale, {T, Tk, H, qk, vd}, dQ, dKg, dVg);
  // Gradient of every whole-sequence latent row, [T_full, w] in stream order (zero past Tk).
  float* dlat = Grow(s.e, L.T_full * w);
  std::fill(dlat + Tk * w, dlat + L.T_full * w, 0.0f);
  MlaContractLatent(lat, Tk, dKg, dVg, W_kv_b, Heads(a), s.c, dlat, dW_kv_b);
  // Back to owners: block i holds rank i's tokens in its local order; summed over ranks.
  float* send = Grow(s.send, L.cp * T * w);
  RowsToMemberBlocks(dlat, WholeCpGroup(L), T, w, send);
  return a.comm->ReduceScatterSum(send, T * w, d_latent, CommLayer::kMla);
}

}  // namespace spindle
