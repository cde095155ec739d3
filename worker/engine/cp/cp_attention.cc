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

namespace spindle {
namespace k = kernels::cpu;
namespace {

float* Grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

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

// ---- Sequence-split <-> head-split transposition (Ulysses) --------------------------------------
// A tensor of the local tokens, [T, H, width] dense, or of the whole sequence for this rank's
// heads, [T_full, H/cp, width] dense. Blocks exchanged with rank j hold, tensor after tensor,
// [T][H/cp][width] (local token order of the rank whose tokens they are).
struct Part {
  float* p;
  int64_t width;
};

int64_t StreamIndex(const CpLayout& L, int64_t rank, int64_t t_local) {
  const int64_t slot = t_local / L.chunk;
  return L.ChunkOf(rank, slot) * L.chunk + t_local % L.chunk;
}

int64_t BlockSize(const std::vector<Part>& parts, int64_t T, int64_t Hl) {
  int64_t w = 0;
  for (const Part& p : parts) w += p.width;
  return T * Hl * w;
}

// Local tokens, all heads -> send blocks per destination rank (its heads).
void PackByHeads(const std::vector<Part>& local, int64_t T, int64_t H, int64_t cp, float* send) {
  const int64_t Hl = H / cp, block = BlockSize(local, T, Hl);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t j = 0; j < cp; ++j)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = send + j * block;
      for (const Part& p : local) {
        float* row = dst + t * Hl * p.width;
        std::memcpy(row, p.p + (t * H + j * Hl) * p.width, Hl * p.width * sizeof(float));
        dst += T * Hl * p.width;
      }
    }
}

// Received blocks (rank i's tokens, my heads) -> whole-sequence tensors in stream order.
void UnpackToStream(const float* recv, const CpLayout& L, int64_t T, int64_t Hl,
                    const std::vector<Part>& full) {
  const int64_t block = BlockSize(full, T, Hl);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < L.cp; ++i)
    for (int64_t t = 0; t < T; ++t) {
      const float* src = recv + i * block;
      const int64_t s = StreamIndex(L, i, t);
      for (const Part& p : full) {
        std::memcpy(p.p + s * Hl * p.width, src + t * Hl * p.width, Hl * p.width * sizeof(float));
        src += T * Hl * p.width;
      }
    }
}

// Whole-sequence tensors (my heads) -> send blocks holding each rank's tokens.
void PackByRanks(const std::vector<Part>& full, const CpLayout& L, int64_t T, int64_t Hl,
                 float* send) {
  const int64_t block = BlockSize(full, T, Hl);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < L.cp; ++i)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = send + i * block;
      const int64_t s = StreamIndex(L, i, t);
      for (const Part& p : full) {
        std::memcpy(dst + t * Hl * p.width, p.p + s * Hl * p.width, Hl * p.width * sizeof(float));
        dst += T * Hl * p.width;
      }
    }
}

// Received blocks (my tokens, rank j's heads) -> local tensors, all heads.
void UnpackToTokens(const float* recv, int64_t T, int64_t H, int64_t cp,
                    const std::vector<Part>& local) {
  const int64_t Hl = H / cp, block = BlockSize(local, T, Hl);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t j = 0; j < cp; ++j)
    for (int64_t t = 0; t < T; ++t) {
      const float* src = recv + j * block;
      for (const Part& p : local) {
        std::memcpy(p.p + (t * H + j * Hl) * p.width, src + t * Hl * p.width,
                    Hl * p.width * sizeof(float));
        src += T * Hl * p.width;
      }
    }
}

// Lightning reads q, k, v with token stride d; the transposition works on dense copies.
void CopyStrided(const float* src, int64_t stride, int64_t T, int64_t width, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * width, src + t * stride, width * sizeof(float));
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
      const float S = recv[(L.RankOfChunk(c) * 2 + L.SlotOfChunk(c)) * SZ + e];
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

// ---- Lightning, All2All -----------------------------------------------------------------------

absl::Status LightningAll2AllForward(const LightningCpArgs& a, CpScratch& s, float* out,
                                     std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, cp = L.cp, Hl = H / cp, T = a.local->T;
  const int64_t Tf = L.T_full, n3 = 3 * T * d;
  // Dense copies of q, k, v (the kernel's strided layout is the model's [T, d] anyway).
  float* loc = Grow(s.a, n3);
  CopyStrided(a.q, d, T, d, loc);
  CopyStrided(a.k, d, T, d, loc + T * d);
  CopyStrided(a.v, d, T, d, loc + 2 * T * d);
  float* send = Grow(s.send, n3);
  float* recv = Grow(s.recv, n3);
  PackByHeads({{loc, Dh}, {loc + T * d, Dh}, {loc + 2 * T * d, Dh}}, T, H, cp, send);
  if (absl::Status st = a.comm->AllToAll(send, n3 / cp, CommType::kF32, recv,
                                         CommLayer::kLightning);
      !st.ok())
    return st;
  saved->resize(n3);
  float* qf = saved->data();
  float* kf = qf + Tf * Hl * Dh;
  float* vf = kf + Tf * Hl * Dh;
  UnpackToStream(recv, L, T, Hl, {{qf, Dh}, {kf, Dh}, {vf, Dh}});
  float* of = Grow(s.c, Tf * Hl * Dh);
  const int64_t head0 = L.rank * Hl;
  k::LightningForward(qf, kf, vf, a.log_decay + head0, L.cu_seqlens.data(),
                      static_cast<int64_t>(L.cu_seqlens.size()) - 1, nullptr, a.scale,
                      {Tf, Hl, Dh, Hl * Dh}, of, nullptr);
  PackByRanks({{of, Dh}}, L, T, Hl, send);
  if (absl::Status st = a.comm->AllToAll(send, T * d / cp, CommType::kF32, recv,
                                         CommLayer::kLightning);
      !st.ok())
    return st;
  UnpackToTokens(recv, T, H, cp, {{out, Dh}});
  return absl::OkStatus();
}

absl::Status LightningAll2AllBackward(const LightningCpArgs& a, CpScratch& s,
                                      const std::vector<float>& saved, const float* dout,
                                      float* dq, float* dk, float* dv) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, Dh = a.Dh, d = H * Dh, cp = L.cp, Hl = H / cp, T = a.local->T;
  const int64_t Tf = L.T_full, n3 = 3 * T * d;
  float* send = Grow(s.send, n3);
  float* recv = Grow(s.recv, n3);
  PackByHeads({{const_cast<float*>(dout), Dh}}, T, H, cp, send);
  if (absl::Status st = a.comm->AllToAll(send, T * d / cp, CommType::kF32, recv,
                                         CommLayer::kLightning);
      !st.ok())
    return st;
  float* dof = Grow(s.c, Tf * Hl * Dh);
  UnpackToStream(recv, L, T, Hl, {{dof, Dh}});
  const float* qf = saved.data();
  const float* kf = qf + Tf * Hl * Dh;
  const float* vf = kf + Tf * Hl * Dh;
  float* g = Grow(s.e, n3);
  float* dqf = g;
  float* dkf = g + Tf * Hl * Dh;
  float* dvf = dkf + Tf * Hl * Dh;
  k::LightningBackward(qf, kf, vf, a.log_decay + L.rank * Hl, L.cu_seqlens.data(),
                       static_cast<int64_t>(L.cu_seqlens.size()) - 1, nullptr, a.scale,
                       {Tf, Hl, Dh, Hl * Dh}, dof, nullptr, dqf, dkf, dvf, nullptr);
  PackByRanks({{dqf, Dh}, {dkf, Dh}, {dvf, Dh}}, L, T, Hl, send);
  if (absl::Status st = a.comm->AllToAll(send, n3 / cp, CommType::kF32, recv,
                                         CommLayer::kLightning);
      !st.ok())
    return st;
  // dq, dk, dv have token stride d in the model: unpack into dense [T, d] each (they are).
  UnpackToTokens(recv, T, H, cp, {{dq, Dh}, {dk, Dh}, {dv, Dh}});
  return absl::OkStatus();
}

// ---- MLA, All2All -----------------------------------------------------------------------------

absl::Status MlaAll2AllForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                               const float* V, float* O, std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, cp = L.cp, Hl = H / cp, T = a.local->T, Tf = L.T_full;
  const int64_t qk = a.qk, vd = a.vd, n = T * H * (2 * qk + vd);
  float* send = Grow(s.send, n);
  float* recv = Grow(s.recv, n);
  PackByHeads({{const_cast<float*>(Q), qk}, {const_cast<float*>(K), qk}, {const_cast<float*>(V), vd}},
              T, H, cp, send);
  if (absl::Status st = a.comm->AllToAll(send, n / cp, CommType::kF32, recv, CommLayer::kMla);
      !st.ok())
    return st;
  // saved: Qf, Kf [Tf, Hl, qk], Vf, Of [Tf, Hl, vd], lse [Tf, Hl].
  saved->resize(Tf * Hl * (2 * qk + 2 * vd + 1));
  float* qf = saved->data();
  float* kf = qf + Tf * Hl * qk;
  float* vf = kf + Tf * Hl * qk;
  float* of = vf + Tf * Hl * vd;
  float* lse = of + Tf * Hl * vd;
  UnpackToStream(recv, L, T, Hl, {{qf, qk}, {kf, qk}, {vf, vd}});
  k::AttentionMask mask{L.doc.data(), L.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionForward(qf, kf, vf, mask, a.scale, {Tf, Tf, Hl, qk, vd}, of, lse);
  PackByRanks({{of, vd}}, L, T, Hl, send);
  if (absl::Status st =
          a.comm->AllToAll(send, T * H * vd / cp, CommType::kF32, recv, CommLayer::kMla);
      !st.ok())
    return st;
  UnpackToTokens(recv, T, H, cp, {{O, vd}});
  return absl::OkStatus();
}

absl::Status MlaAll2AllBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                                const float* dO, float* dQ, float* dK, float* dV) {
  const CpLayout& L = *a.layout;
  const int64_t H = a.H, cp = L.cp, Hl = H / cp, T = a.local->T, Tf = L.T_full;
  const int64_t qk = a.qk, vd = a.vd, n = T * H * (2 * qk + vd);
  float* send = Grow(s.send, n);
  float* recv = Grow(s.recv, n);
  PackByHeads({{const_cast<float*>(dO), vd}}, T, H, cp, send);
  if (absl::Status st =
          a.comm->AllToAll(send, T * H * vd / cp, CommType::kF32, recv, CommLayer::kMla);
      !st.ok())
    return st;
  const float* qf = saved.data();
  const float* kf = qf + Tf * Hl * qk;
  const float* vf = kf + Tf * Hl * qk;
  const float* of = vf + Tf * Hl * vd;
  const float* lse = of + Tf * Hl * vd;
  float* dof = Grow(s.c, Tf * Hl * vd);
  UnpackToStream(recv, L, T, Hl, {{dof, vd}});
  float* g = Grow(s.e, n);
  float* dqf = g;
  float* dkf = dqf + Tf * Hl * qk;
  float* dvf = dkf + Tf * Hl * qk;
  k::AttentionMask mask{L.doc.data(), L.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionBackward(qf, kf, vf, of, lse, dof, mask, a.scale, {Tf, Tf, Hl, qk, vd}, dqf, dkf,
                       dvf);
  PackByRanks({{dqf, qk}, {dkf, qk}, {dvf, vd}}, L, T, Hl, send);
  if (absl::Status st = a.comm->AllToAll(send, n / cp, CommType::kF32, recv, CommLayer::kMla);
      !st.ok())
    return st;
  UnpackToTokens(recv, T, H, cp, {{dQ, qk}, {dK, qk}, {dV, vd}});
  return absl::OkStatus();
}

// ---- MLA, AllGather ---------------------------------------------------------------------------

namespace {
// Keys the local queries can see: the stream prefix up to this rank's last token.
int64_t VisibleKeys(const CpLayout& L) { return (2 * L.cp - L.rank) * L.chunk; }
}  // namespace

absl::Status MlaAllGatherForward(const MlaCpArgs& a, CpScratch& s, const float* Q,
                                 const float* latent, const float* W_kv_b, float* O, float* lse,
                                 std::vector<float>* saved) {
  const CpLayout& L = *a.layout;
  const Batch& b = *a.local;
  const int64_t H = a.H, T = b.T, qk = a.qk, vd = a.vd, kv = a.kv, rd = a.rd, nope = qk - rd;
  const int64_t w = kv + rd, Tk = VisibleKeys(L), kvb_w = H * (nope + vd);
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
      const int64_t st = StreamIndex(L, i, t);
      if (st < Tk) std::memcpy(lat + st * w, recv + (i * T + t) * w, w * sizeof(float));
    }
  float* kvb = Grow(s.c, Tk * kvb_w);
  k::Gemm(false, true, Tk, kvb_w, kv, 1.0f, lat, w, W_kv_b, kv, 0.0f, kvb, kvb_w);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tk; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kvb + (t * H + h) * (nope + vd);
      float* kd = Kg + (t * H + h) * qk;
      std::memcpy(kd, src, nope * sizeof(float));
      std::memcpy(kd + nope, lat + t * w + kv, rd * sizeof(float));
      std::memcpy(Vg + (t * H + h) * vd, src + nope, vd * sizeof(float));
    }
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
  const int64_t H = a.H, T = b.T, qk = a.qk, vd = a.vd, kv = a.kv, rd = a.rd, nope = qk - rd;
  const int64_t w = kv + rd, Tk = VisibleKeys(L), kvb_w = H * (nope + vd);
  const float* lat = saved.data();
  const float* Kg = lat + Tk * w;
  const float* Vg = Kg + Tk * H * qk;
  float* dKg = Grow(s.a, Tk * H * qk);
  float* dVg = Grow(s.b, Tk * H * vd);
  k::AttentionMask mask{b.doc.data(), b.idx.data(), L.doc.data(), L.idx.data()};
  k::AttentionBackward(Q, Kg, Vg, O, lse, dO, mask, a.scale, {T, Tk, H, qk, vd}, dQ, dKg, dVg);
  // Gradient of every whole-sequence latent row, [T_full, w] in stream order (zero past Tk).
  float* dkvb = Grow(s.c, Tk * kvb_w);
  float* dlat = Grow(s.e, L.T_full * w);
  std::fill(dlat + Tk * w, dlat + L.T_full * w, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tk; ++t) {
    float* dkr = dlat + t * w + kv;
    std::fill(dkr, dkr + rd, 0.0f);
    for (int64_t h = 0; h < H; ++h) {
      float* dst = dkvb + (t * H + h) * (nope + vd);
      const float* dk = dKg + (t * H + h) * qk;
      std::memcpy(dst, dk, nope * sizeof(float));
      std::memcpy(dst + nope, dVg + (t * H + h) * vd, vd * sizeof(float));
      for (int64_t j = 0; j < rd; ++j) dkr[j] += dk[nope + j];
    }
  }
  k::Gemm(true, false, kvb_w, kv, Tk, 1.0f, dkvb, kvb_w, lat, w, 1.0f, dW_kv_b, kv);
  k::Gemm(false, false, Tk, kv, kvb_w, 1.0f, dkvb, kvb_w, W_kv_b, kv, 0.0f, dlat, w);
  // Back to owners: block i holds rank i's tokens in its local order; summed over ranks.
  float* send = Grow(s.send, L.cp * T * w);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < L.cp; ++i)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(send + (i * T + t) * w, dlat + StreamIndex(L, i, t) * w, w * sizeof(float));
  return a.comm->ReduceScatterSum(send, T * w, d_latent, CommLayer::kMla);
}

}  // namespace spindle
