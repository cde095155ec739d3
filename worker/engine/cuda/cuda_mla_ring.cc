// The CUDA model's MLA Ring and hybrid modes (cuda_mla.h; DESIGN.md section 3): the ring loop of
// cp/cp_ring.h, written once for both engines, over block operations on the GPU.
//
// A block is one rank's latent rows [c_n | rotated k_r] (bf16 [T, kv + rd], its two zigzag chunks
// in local order), each key block's keys and values rebuilt from it with kv_b as under MLA
// AllGather; or, under the kv payload (CpContext::mla_payload, where keys and values are the
// narrower), those keys and values themselves ([T, H qk] then [T, H v_head], built once by their
// owner). Its gradient travels in fp32, in the block's layout; a kv block's gradient goes back
// through kv_b at its owner. The ring visits, for each local query chunk, the
// chunks of the block it holds that the chunk's queries may see (RingChunkSees): a chunk with
// itself (the diagonal, on step 0) is causal attention with the chunk's documents
// (Sdpa::Forward), which writes the chunk's output and statistics; an earlier chunk is full
// attention of the first segment's queries (those of the document the chunk's first token
// continues) over that document's keys in it (Sdpa::ForwardFull), in key and query blocks of
// kCudaMlaKeyBlock rows, merged by the statistics into an fp32 running output of the first
// segment (W.ag_acc, a slot per local chunk), cast back into the output after the last block. The
// backward walks the same pairs with the merged output and statistics, so each pair's gradients
// are its share: dq written by the diagonal and added to after, each pair's key gradients taken
// back through kv_b (dW_kv_b accumulated) into the block's latent gradient.
//
// Ring: the level is the CP group, the heads all of them, the queries the layer's own. Hybrid:
// the queries go to this rank's Ulysses group's tokens for its H/u heads and the group's latent
// rows are gathered (the group's block); the level is the ring of groups (CpLevel group_lv) with
// those heads' kv_b rows; the output comes back by the inverse exchange, and the backward
// reduce-scatters the group block's latent gradient to its members.
#include "worker/engine/cp/cp_ring.h"
#include "worker/engine/cuda/cuda_mla.h"

namespace spindle {
namespace cuda_model_detail {

// What one ring pass works on: the level, the heads [h0, h0 + Hh), and the queries, output,
// statistics ([2 slots][Hh, chunk] at StatsSlot offsets) and, for the backward, the output
// gradient and the query gradient (written), all [V.T, Hh, width] rows.
struct MlaRingArgs {
  const CpLevel* V;
  int64_t h0, Hh;
  const void* Q;
  void* O;
  float* stats;
  const void* dO = nullptr;
  void* dQ = nullptr;
};

struct CudaMla::RingOps : RingBlockOps {
  RingOps(CudaMla& m, const LayerIdx& L, const MlaRingArgs& a) : m(m), L(L), a(a), V(*a.V) {
    const MlaConfig& c = m.c.mla;
    H = a.Hh, nope = c.qk_nope_dim, qk = nope + c.qk_rope_dim, vd = c.v_head_dim;
    kv = m.cx.MlaRingKv();
    w = MlaRingPayloadWidth(c, m.cx.cp.mla_payload, H);
    T = V.T, ch = V.chunk, SS = StatsSlot(H, ch);
    scale = 1.0f / std::sqrt(static_cast<float>(qk));
  }

  int64_t block_bytes() const override { return T * w * kAb; }
  int64_t grad_bytes() const override { return T * w * 4; }

  absl::StatusOr<RingBuffers> Buffers(bool) override {
    MlaWork& W = m.W;
    RingBuffers b;
    for (int i = 0; i < 2; ++i) b.block[i] = W.ring_block[i].get(), b.acc[i] = W.ring_acc[i].get();
    b.share = W.ring_share.get();
    return b;
  }

  // The pieces of the local queries against `block` (rank `owner`'s): for each local chunk qs,
  // diag(qs, rows) against itself (its own block, on the diagonal step), before cross(qs, k, q0,
  // n, k0, k1) for every key block [k0, k1) and query block [q0, q0 + n) of its first segment
  // against an earlier chunk of the block it sees (rows k: the chunk's rows). The keys and values
  // of each are set up (Keys) before the call.
  template <typename Diag, typename Cross>
  absl::Status ForEachPiece(const void* block, int64_t owner, const Diag& diag,
                            const Cross& cross) {
    const CpLayout& lay = *V.layout;
    for (int qs = 0; qs < 2; ++qs) {
      const int64_t qc = lay.ChunkOf(lay.rank, qs);
      for (int ks : {qs, 1 - qs}) {
        const int64_t kc = lay.ChunkOf(owner, ks);
        if (!RingChunkSees(lay, qc, kc)) continue;
        const int64_t k = ks * ch;  // the chunk's first row in the block
        if (kc == qc) {
          RETURN_IF_ERROR(Keys(block, k, ch));
          RETURN_IF_ERROR(diag(qs, k));
          continue;
        }
        const int64_t nq = V.first_segment[qs];
        for (int64_t k0 = KeyStart(qs, kc); k0 < ch; k0 += kCudaMlaKeyBlock) {
          const int64_t k1 = std::min(ch, k0 + kCudaMlaKeyBlock);
          RETURN_IF_ERROR(Keys(block, k + k0, k1 - k0));
          for (int64_t q0 = 0; q0 < nq; q0 += kCudaMlaKeyBlock)
            RETURN_IF_ERROR(cross(qs, k, q0, std::min(kCudaMlaKeyBlock, nq - q0), k0, k1));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Forward(const void* block, int64_t owner, bool) override {
    MlaWork& W = m.W;
    auto q = [&](int qs) { return At(a.Q, qs * ch * H * qk); };
    auto o = [&](int qs) { return At(a.O, qs * ch * H * vd); };
    auto stats = [&](int qs) { return a.stats + qs * SS; };
    return ForEachPiece(
        block, owner,
        [&](int qs, int64_t) -> absl::Status {
          // The diagonal starts the chunk's output, which the earlier chunks merge into.
          KC(m.sdpa->Forward(q(qs), K_, V_, o(qs), stats(qs), V.piece_cu_host[qs].data(),
                             static_cast<int64_t>(V.piece_cu_host[qs].size()) - 1, scale, Dims(ch),
                             kAct, m.cx.stream));
          if (V.continues[qs])
            KC(kc::CastRows(Acc(qs), KDType::kFloat32, H * vd, o(qs), kAct, H * vd,
                            V.first_segment[qs], H * vd, m.cx.stream));
          return absl::OkStatus();
        },
        [&](int qs, int64_t, int64_t q0, int64_t n, int64_t k0, int64_t k1) -> absl::Status {
          kc::SdpaDims full = Dims(n);
          full.Tkv = k1 - k0;
          KC(m.sdpa->ForwardFull(At(q(qs), q0 * H * qk), K_, V_, W.ag_o.get(), W.ag_stats.f32(),
                                 scale, full, kAct, m.cx.stream));
          KC(kc::AttentionMerge(Acc(qs) + q0 * H * vd, KDType::kFloat32, H * vd, stats(qs) + q0, ch,
                                W.ag_o.get(), kAct, H * vd, W.ag_stats.f32(), n, n, H, vd,
                                m.cx.stream));
          return absl::OkStatus();
        });
  }

  absl::Status Backward(const void* block, int64_t owner, bool, void* d_block) override {
    MlaWork& W = m.W;
    float* dblk = static_cast<float*>(d_block);
    CUDA(cudaMemsetAsync(dblk, 0, grad_bytes(), m.cx.stream));
    auto q = [&](int qs) { return At(a.Q, qs * ch * H * qk); };
    auto o = [&](int qs) { return At(a.O, qs * ch * H * vd); };
    auto dout = [&](int qs) { return At(a.dO, qs * ch * H * vd); };
    auto dq = [&](int qs) { return At(a.dQ, qs * ch * H * qk); };
    auto stats = [&](int qs) { return a.stats + qs * SS; };
    return ForEachPiece(
        block, owner,
        [&](int qs, int64_t k) -> absl::Status {
          // The diagonal writes the chunk's dq; the other pieces add theirs.
          RETURN_IF_ERROR(m.AttentionBackward(q(qs), K_, V_, o(qs), stats(qs), dout(qs), dq(qs),
                                              W.ag_dK.get(), DV(), V.piece_cu_host[qs], scale,
                                              Dims(ch)));
          return KeyGrads(block, k, ch, dblk);
        },
        [&](int qs, int64_t k, int64_t q0, int64_t n, int64_t k0, int64_t k1) -> absl::Status {
          // The merged statistics of these queries, dense [H, n] as the n-query graph reads them.
          CUDA(cudaMemcpy2DAsync(W.ag_stats.f32(), n * 4, stats(qs) + q0, ch * 4, n * 4, H,
                                 cudaMemcpyDeviceToDevice, m.cx.stream));
          kc::SdpaDims full = Dims(n);
          full.Tkv = k1 - k0;
          KC(m.sdpa->BackwardFull(At(q(qs), q0 * H * qk), K_, V_, At(o(qs), q0 * H * vd),
                                  W.ag_stats.f32(), At(dout(qs), q0 * H * vd), W.ag_dq.get(),
                                  W.ag_dK.get(), DV(), scale, full, kAct, m.cx.stream));
          KC(kc::AddRows(At(dq(qs), q0 * H * qk), H * qk, W.ag_dq.get(), H * qk, n, H * qk, kAct,
                         m.cx.stream));
          return KeyGrads(block, k + k0, k1 - k0, dblk);
        });
  }

  absl::Status ZeroGrad(void* g) override {
    CUDA(cudaMemsetAsync(g, 0, grad_bytes(), m.cx.stream));
    return absl::OkStatus();
  }
  absl::Status AddGrad(void* dst, const void* src) override {
    KC(kc::AddRows(dst, w, src, w, T, w, KDType::kFloat32, m.cx.stream));
    return absl::OkStatus();
  }
  absl::Status Fence() override {
    CUDA(cudaStreamSynchronize(m.cx.stream));
    return absl::OkStatus();
  }

  // Block rows [r0, r0 + n)'s keys and values where the attention reads them (K_, V_): rebuilt
  // into W.ag_K and W.ag_kvb from latent rows, or the kv block's own rows.
  absl::Status Keys(const void* block, int64_t r0, int64_t n) {
    if (kv) {
      K_ = At(block, r0 * H * qk);
      V_ = At(block, T * H * qk + r0 * H * vd);
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(m.BuildKeysFrom(L, At(block, r0 * w), n, a.h0, H));
    K_ = m.W.ag_K.get();
    V_ = At(m.W.ag_kvb.get(), nope);
    return absl::OkStatus();
  }
  // The attention's dimensions for n queries: V and its gradient are kv_b's output's V columns,
  // or under the kv payload dense rows of H v_head.
  kc::SdpaDims Dims(int64_t n) const {
    kc::SdpaDims d = MlaDims(m.c, n, H);
    if (kv) d.v = {H * vd, vd};
    return d;
  }
  void* DV() const { return kv ? m.W.ag_dkvb.get() : At(m.W.ag_dkvb.get(), nope); }
  // The key gradients of block rows [r0, r0 + n) (W.ag_dK, and dV at DV()) added into the block's
  // fp32 gradient: through kv_b into the latent rows' (KeyGradsToLatent), or as they are.
  absl::Status KeyGrads(const void* block, int64_t r0, int64_t n, float* dblk) {
    if (!kv) return KeyGradsToLatent(At(block, r0 * w), n, dblk + r0 * w);
    KC(kc::CastRows(dblk + r0 * H * qk, KDType::kFloat32, H * qk, m.W.ag_dK.get(), kAct, H * qk, n,
                    H * qk, m.cx.stream, /*accumulate=*/true));
    KC(kc::CastRows(dblk + T * H * qk + r0 * H * vd, KDType::kFloat32, H * vd, m.W.ag_dkvb.get(),
                    kAct, H * vd, n, H * vd, m.cx.stream, /*accumulate=*/true));
    return absl::OkStatus();
  }
  // Local chunk qs's fp32 running output of its first segment.
  float* Acc(int qs) const { return m.W.ag_acc.f32() + qs * ch * H * vd; }
  // The first row of chunk kc that local chunk qs's first segment sees (its document's start).
  int64_t KeyStart(int qs, int64_t kc) const {
    return std::max<int64_t>(kc * ch, V.key_begin[qs]) - kc * ch;
  }
  // The key gradients of n block rows (W.ag_dK, and dV in W.ag_dkvb's V columns) -> dW_kv_b's rows
  // of the heads (accumulated) and the rows' latent gradients, added (fp32) into drows.
  absl::Status KeyGradsToLatent(const void* rows, int64_t n, float* drows) {
    MlaWork& W = m.W;
    RETURN_IF_ERROR(m.KeyGradsToLatentRows(L, rows, w, W.ag_dK.get(), W.ag_dkvb.get(), n, a.h0, H,
                                           {W.ag_dlat.get(), w}));
    KC(kc::CastRows(drows, KDType::kFloat32, w, W.ag_dlat.get(), kAct, w, n, w, m.cx.stream,
                    /*accumulate=*/true));
    return absl::OkStatus();
  }
  // After the forward: each continuing chunk's merged first segment into the output.
  absl::Status FinishForward() {
    for (int slot = 0; slot < 2; ++slot)
      if (V.continues[slot])
        KC(kc::CastRows(At(a.O, slot * ch * H * vd), kAct, H * vd, Acc(slot), KDType::kFloat32,
                        H * vd, V.first_segment[slot], H * vd, m.cx.stream));
    return absl::OkStatus();
  }

  CudaMla& m;
  const LayerIdx& L;
  const MlaRingArgs a;
  const CpLevel& V;
  bool kv = false;  // the kv payload (else the latent)
  // w: a block's values a token (the payload's width).
  int64_t H = 0, nope = 0, qk = 0, vd = 0, w = 0, T = 0, ch = 0, SS = 0;
  float scale = 1.0f;
  const void* K_ = nullptr;  // the current rows' keys and values (Keys)
  const void* V_ = nullptr;
};

// ---- Ring

absl::Status CudaMla::RingModeForward(const LayerIdx& L, MlaCache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, kv = m.kv_lora_rank, w = kv + m.qk_rope_dim;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim;
  // This rank's block, kept for the backward.
  if (cx.MlaRingKv()) {
    RETURN_IF_ERROR(cx.Act(C.ring_kv, T, MlaRingPayloadWidth(m, MlaRingPayload::kKv, H)));
    RETURN_IF_ERROR(KvBlock(L, C.c_n.get(), kv, At(C.kva.get(), kv), w, T, 0, H, C.ring_kv.get()));
  } else {
    RETURN_IF_ERROR(cx.Act(C.ag_lat, T, w));
    RETURN_IF_ERROR(cx.Copy2D(C.ag_lat.get(), w, C.c_n.get(), kv, kv, T));
    RETURN_IF_ERROR(cx.Copy2D(At(C.ag_lat.get(), kv), w, At(C.kva.get(), kv), w, m.qk_rope_dim, T));
  }
  RETURN_IF_ERROR(cx.F32(C.stats, 2 * StatsSlot(H, B.chunk)));
  if (attention_kept) return absl::OkStatus();
  RingOps ops(*this, L, {&B.lv, 0, H, C.Q.get(), C.O.get(), C.stats.f32()});
  RETURN_IF_ERROR(RingForward(*B.lv.layout, *cx.cp.comm, ops,
                              cx.MlaRingKv() ? C.ring_kv.get() : C.ag_lat.get()));
  return ops.FinishForward();
}

absl::Status CudaMla::RingModeBackward(const LayerIdx& L, MlaCache& C) {
  const int64_t T = B.T, kv = c.mla.kv_lora_rank, w = kv + c.mla.qk_rope_dim;
  RingOps ops(*this, L,
              {&B.lv, 0, c.n_heads, C.Q.get(), C.O.get(), C.stats.f32(), W.dO.get(), W.dQ.get()});
  if (cx.MlaRingKv()) {
    RETURN_IF_ERROR(
        RingBackward(*B.lv.layout, *cx.cp.comm, ops, C.ring_kv.get(), W.ring_own.get()));
    return KvGradsToLatent(L, W.ring_own.f32(), C.c_n.get(), kv, T, 0, c.n_heads,
                           std::max(B.lv.chunk, kCudaMlaKeyBlock), W.dkva.get(), kAct);
  }
  RETURN_IF_ERROR(RingBackward(*B.lv.layout, *cx.cp.comm, ops, C.ag_lat.get(), W.ring_own.get()));
  KC(kc::CastRows(W.dkva.get(), kAct, w, W.ring_own.get(), KDType::kFloat32, w, T, w, cx.stream));
  return absl::OkStatus();
}

// ---- Hybrid

absl::Status CudaMla::HybridForward(const LayerIdx& L, LayerActs& A, MlaCache& C,
                                    bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, u = B.ulysses.members, Hl = H / u, Tg = B.group_lv.T;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim, kv = m.kv_lora_rank;
  const int64_t w = kv + m.qk_rope_dim, h0 = CpGroups{B.cp, u}.Member(B.rank) * Hl;
  // The group's queries for this member's heads (C.cp_full) and the group's latent rows, gathered
  // from its members (C.ag_lat, the group's block, kept for the backward).
  RETURN_IF_ERROR(cx.Act(A.cp_full, Tg, Hl * qk));
  RETURN_IF_ERROR(cx.PackByHeads(B.ulysses, {{C.Q.get(), H * qk, qk, qk}}));
  RETURN_IF_ERROR(cx.ExchangeToGroup(B.ulysses, cx.W.cp_block.get(), A.cp_full.get(), Hl * qk,
                                     CommLayer::kMla));
  void* send = W.ag_send.get();
  RETURN_IF_ERROR(cx.Copy2D(send, w, C.c_n.get(), kv, kv, T));
  RETURN_IF_ERROR(cx.Copy2D(At(send, kv), w, At(C.kva.get(), kv), w, m.qk_rope_dim, T));
  CUDA(cudaStreamSynchronize(cx.stream));  // the communicator reads `send` on a stream of its own
  RETURN_IF_ERROR(cx.cp.ulysses->AllGather(send, T * w * kAb, CommType::kByte, W.ag_recv.get(),
                                           CommLayer::kMla));
  RETURN_IF_ERROR(cx.Act(C.ag_lat, Tg, w));
  RETURN_IF_ERROR(cx.CopyRuns(B.ulysses, W.ag_recv.get(), false, C.ag_lat.get(), true, w));
  // Under the kv payload the group's keys and values for this member's heads are the block.
  if (cx.MlaRingKv()) {
    RETURN_IF_ERROR(cx.Act(C.ring_kv, Tg, MlaRingPayloadWidth(m, MlaRingPayload::kKv, Hl)));
    RETURN_IF_ERROR(
        KvBlock(L, C.ag_lat.get(), w, At(C.ag_lat.get(), kv), w, Tg, h0, Hl, C.ring_kv.get()));
  }
  RETURN_IF_ERROR(cx.Act(C.cp_out, Tg, Hl * vd));
  RETURN_IF_ERROR(cx.F32(C.stats, 2 * StatsSlot(Hl, B.group_lv.chunk)));
  if (attention_kept) return absl::OkStatus();
  RingOps ops(*this, L, {&B.group_lv, h0, Hl, A.cp_full.get(), C.cp_out.get(), C.stats.f32()});
  RETURN_IF_ERROR(RingForward(*B.group_lv.layout, *cx.cp.ring, ops,
                              cx.MlaRingKv() ? C.ring_kv.get() : C.ag_lat.get()));
  RETURN_IF_ERROR(ops.FinishForward());
  RETURN_IF_ERROR(
      cx.ExchangeFromGroup(B.ulysses, C.cp_out.get(), cx.W.cp_tmp.get(), Hl * vd, CommLayer::kMla));
  return cx.UnpackToTokens(B.ulysses, cx.W.cp_tmp.get(), {{C.O.get(), H * vd, vd, vd}});
}

// dO to the group's tokens (W.cp_tmp), the ring's backward (dQ of the group into W.cp_block, free
// once the exchange sent it; the group block's latent gradient into W.ring_own), dQ back (received
// into C.cp_full, whose last reader the ring was) into W.dQ, and the latent gradient's rows to
// their members, summed over the group's heads (reduce-scatter) into W.dkva.
absl::Status CudaMla::HybridBackward(const LayerIdx& L, LayerActs& A, MlaCache& C) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, u = B.ulysses.members, Hl = H / u;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t w = m.kv_lora_rank + m.qk_rope_dim, h0 = CpGroups{B.cp, u}.Member(B.rank) * Hl;
  RETURN_IF_ERROR(cx.PackByHeads(B.ulysses, {{W.dO.get(), H * vd, vd, vd}}));
  RETURN_IF_ERROR(cx.ExchangeToGroup(B.ulysses, cx.W.cp_block.get(), cx.W.cp_tmp.get(), Hl * vd,
                                     CommLayer::kMla));
  RingOps ops(*this, L,
              {&B.group_lv, h0, Hl, A.cp_full.get(), C.cp_out.get(), C.stats.f32(),
               cx.W.cp_tmp.get(), cx.W.cp_block.get()});
  const bool kv_payload = cx.MlaRingKv();
  RETURN_IF_ERROR(RingBackward(*B.group_lv.layout, *cx.cp.ring, ops,
                               kv_payload ? C.ring_kv.get() : C.ag_lat.get(), W.ring_own.get()));
  RETURN_IF_ERROR(cx.ExchangeFromGroup(B.ulysses, cx.W.cp_block.get(), A.cp_full.get(), Hl * qk,
                                       CommLayer::kMla));
  RETURN_IF_ERROR(cx.UnpackToTokens(B.ulysses, A.cp_full.get(), {{W.dQ.get(), H * qk, qk, qk}}));
  // The group's latent gradient (fp32 [Tg, w]): the ring's own, or under the kv payload its keys'
  // and values' taken back through kv_b (into W.ag_recv, free until the reduce-scatter).
  const float* group_dlat = W.ring_own.f32();
  if (kv_payload) {
    const int64_t Tg = B.group_lv.T;
    RETURN_IF_ERROR(KvGradsToLatent(L, W.ring_own.f32(), C.ag_lat.get(), w, Tg, h0, Hl,
                                    std::max(B.group_lv.chunk, kCudaMlaKeyBlock), W.ag_recv.get(),
                                    KDType::kFloat32));
    group_dlat = W.ag_recv.f32();
  }
  float* blocks = W.ag_send.f32();
  RETURN_IF_ERROR(cx.CopyRuns(B.ulysses, group_dlat, true, blocks, false, w, 4));
  CUDA(cudaStreamSynchronize(cx.stream));
  RETURN_IF_ERROR(cx.cp.ulysses->ReduceScatterSum(blocks, T * w, W.ag_recv.f32(), CommLayer::kMla));
  KC(kc::CastRows(W.dkva.get(), kAct, w, W.ag_recv.get(), KDType::kFloat32, w, T, w, cx.stream));
  return absl::OkStatus();
}

}  // namespace cuda_model_detail
}  // namespace spindle
