// CudaModel's MLA Ring mode (DESIGN.md section 3): the ring loop of cp/cp_ring.h, written once for
// both engines, over block operations on the GPU.
//
// A block is one rank's latent rows [c_n | rotated k_r] (bf16 [T, kv + rd], its two zigzag chunks
// in local order); each key block's keys and values are rebuilt from it with kv_b, as under MLA
// AllGather, and its gradient travels in fp32. The ring visits, for each local query chunk, the
// chunks of the block it holds that the chunk's queries may see (RingChunkSees): a chunk with
// itself (the diagonal, on step 0) is causal attention with the chunk's documents
// (Sdpa::Forward), which writes the chunk's output and statistics; an earlier chunk is full
// attention of the first segment's queries (those of the document the chunk's first token
// continues) over that document's keys in it (Sdpa::ForwardFull), in key and query blocks of
// kCudaMlaKeyBlock rows, merged by the statistics into an fp32 running output of the first
// segment (W.ag_acc, a slot per local chunk), cast back into O after the last block. The
// backward walks the same pairs with the merged output and statistics, so each pair's gradients
// are its share: dq written by the diagonal and added to after, each pair's key gradients taken
// back through kv_b (dW_kv_b accumulated) into the block's latent gradient.
#include "worker/engine/cp/cp_ring.h"
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

struct CudaModel::Impl::MlaRingOps : RingBlockOps {
  MlaRingOps(Impl& m, const LayerIdx& L, Cache& C) : m(m), L(L), C(C) {
    const MlaConfig& a = m.c.mla;
    H = m.c.n_heads, nope = a.qk_nope_dim, qk = nope + a.qk_rope_dim, vd = a.v_head_dim;
    w = a.kv_lora_rank + a.qk_rope_dim;
    T = m.B.T, ch = m.B.chunk, SS = StatsSlot(H, ch);
    scale = 1.0f / std::sqrt(static_cast<float>(qk));
  }

  int64_t block_bytes() const override { return T * w * kAb; }
  int64_t grad_bytes() const override { return T * w * 4; }

  absl::StatusOr<RingBuffers> Buffers(bool) override {
    Work& W = m.W;
    RingBuffers b;
    for (int i = 0; i < 2; ++i) b.block[i] = W.ring_block[i].get(), b.acc[i] = W.ring_acc[i].get();
    b.share = W.ring_share.get();
    return b;
  }

  absl::Status Forward(const void* block, int64_t owner, bool) override {
    const CpLayout& lay = *m.B.layout;
    for (int qs = 0; qs < 2; ++qs) {
      const int64_t qc = lay.ChunkOf(lay.rank, qs);
      void* q = At(C.Q.get(), qs * ch * H * qk);
      void* o = At(C.O.get(), qs * ch * H * vd);
      float* stats = C.stats.f32() + qs * SS;
      float* acc = Acc(qs);
      // The diagonal first: it starts the chunk's output, which the earlier chunks merge into.
      for (int ks : {qs, 1 - qs}) {
        const int64_t kc = lay.ChunkOf(owner, ks);
        if (!RingChunkSees(lay, qc, kc)) continue;
        const void* rows = At(block, ks * ch * w);
        if (kc == qc) {
          RETURN_IF_ERROR(m.MlaBuildKeysFrom(L, rows, ch));
          KC(m.sdpa->Forward(q, m.W.ag_K.get(), At(m.W.ag_kvb.get(), nope), o, stats,
                             m.B.piece_cu_host[qs].data(),
                             static_cast<int64_t>(m.B.piece_cu_host[qs].size()) - 1, scale,
                             MlaDims(m.c, ch), kAct, m.stream));
          if (m.B.continues[qs])
            KC(kc::CastRows(acc, KDType::kFloat32, H * vd, o, kAct, H * vd, m.B.first_segment[qs],
                            H * vd, m.stream));
          continue;
        }
        const int64_t nq = m.B.first_segment[qs];
        for (int64_t a = KeyStart(qs, kc); a < ch; a += kCudaMlaKeyBlock) {
          const int64_t b = std::min(ch, a + kCudaMlaKeyBlock);
          RETURN_IF_ERROR(m.MlaBuildKeysFrom(L, At(rows, a * w), b - a));
          for (int64_t q0 = 0; q0 < nq; q0 += kCudaMlaKeyBlock) {
            const int64_t n = std::min(kCudaMlaKeyBlock, nq - q0);
            kc::SdpaDims full = MlaDims(m.c, n);
            full.Tkv = b - a;
            KC(m.sdpa->ForwardFull(At(q, q0 * H * qk), m.W.ag_K.get(), At(m.W.ag_kvb.get(), nope),
                                   m.W.ag_o.get(), m.W.ag_stats.f32(), scale, full, kAct,
                                   m.stream));
            KC(kc::AttentionMerge(acc + q0 * H * vd, KDType::kFloat32, H * vd, stats + q0, ch,
                                  m.W.ag_o.get(), kAct, H * vd, m.W.ag_stats.f32(), n, n, H, vd,
                                  m.stream));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Backward(const void* block, int64_t owner, bool, void* d_block) override {
    const CpLayout& lay = *m.B.layout;
    Work& W = m.W;
    float* dlat = static_cast<float*>(d_block);
    CUDA(cudaMemsetAsync(dlat, 0, grad_bytes(), m.stream));
    for (int qs = 0; qs < 2; ++qs) {
      const int64_t qc = lay.ChunkOf(lay.rank, qs);
      const void* q = At(C.Q.get(), qs * ch * H * qk);
      const void* o = At(C.O.get(), qs * ch * H * vd);
      const void* dout = At(W.dO.get(), qs * ch * H * vd);
      void* dq = At(W.dQ.get(), qs * ch * H * qk);
      const float* stats = C.stats.f32() + qs * SS;
      for (int ks : {qs, 1 - qs}) {
        const int64_t kc = lay.ChunkOf(owner, ks);
        if (!RingChunkSees(lay, qc, kc)) continue;
        const void* rows = At(block, ks * ch * w);
        float* drows = dlat + ks * ch * w;
        if (kc == qc) {  // the diagonal writes the chunk's dq; the other pairs add theirs
          RETURN_IF_ERROR(m.MlaBuildKeysFrom(L, rows, ch));
          RETURN_IF_ERROR(m.AttentionBackward(q, W.ag_K.get(), At(W.ag_kvb.get(), nope), o, stats,
                                              dout, dq, W.ag_dK.get(), At(W.ag_dkvb.get(), nope),
                                              m.B.piece_cu_host[qs], scale, MlaDims(m.c, ch)));
          RETURN_IF_ERROR(KeyGradsToLatent(rows, ch, drows));
          continue;
        }
        const int64_t nq = m.B.first_segment[qs];
        for (int64_t a = KeyStart(qs, kc); a < ch; a += kCudaMlaKeyBlock) {
          const int64_t b = std::min(ch, a + kCudaMlaKeyBlock);
          RETURN_IF_ERROR(m.MlaBuildKeysFrom(L, At(rows, a * w), b - a));
          for (int64_t q0 = 0; q0 < nq; q0 += kCudaMlaKeyBlock) {
            const int64_t n = std::min(kCudaMlaKeyBlock, nq - q0);
            // The merged statistics of these queries, dense [H, n] as the n-query graph reads them.
            CUDA(cudaMemcpy2DAsync(W.ag_stats.f32(), n * 4, stats + q0, ch * 4, n * 4, H,
                                   cudaMemcpyDeviceToDevice, m.stream));
            kc::SdpaDims full = MlaDims(m.c, n);
            full.Tkv = b - a;
            KC(m.sdpa->BackwardFull(At(q, q0 * H * qk), W.ag_K.get(), At(W.ag_kvb.get(), nope),
                                    At(o, q0 * H * vd), W.ag_stats.f32(), At(dout, q0 * H * vd),
                                    W.ag_dq.get(), W.ag_dK.get(), At(W.ag_dkvb.get(), nope), scale,
                                    full, kAct, m.stream));
            KC(kc::AddRows(At(dq, q0 * H * qk), H * qk, W.ag_dq.get(), H * qk, n, H * qk, kAct,
                           m.stream));
            RETURN_IF_ERROR(KeyGradsToLatent(At(rows, a * w), b - a, drows + a * w));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status ZeroGrad(void* g) override {
    CUDA(cudaMemsetAsync(g, 0, grad_bytes(), m.stream));
    return absl::OkStatus();
  }
  absl::Status AddGrad(void* dst, const void* src) override {
    KC(kc::AddRows(dst, w, src, w, T, w, KDType::kFloat32, m.stream));
    return absl::OkStatus();
  }
  absl::Status Fence() override {
    CUDA(cudaStreamSynchronize(m.stream));
    return absl::OkStatus();
  }

  // Local chunk qs's fp32 running output of its first segment.
  float* Acc(int qs) const { return m.W.ag_acc.f32() + qs * ch * H * vd; }
  // The first row of chunk kc that local chunk qs's first segment sees (its document's start).
  int64_t KeyStart(int qs, int64_t kc) const {
    return std::max<int64_t>(kc * ch, m.B.key_begin[qs]) - kc * ch;
  }
  // The key gradients of n block rows (W.ag_dK, and dV in W.ag_dkvb's V columns) -> dW_kv_b
  // (accumulated) and the rows' latent gradients, added (fp32) into drows.
  absl::Status KeyGradsToLatent(const void* rows, int64_t n, float* drows) {
    Work& W = m.W;
    RETURN_IF_ERROR(m.MlaKeyGradsToLatentRows(L, rows, w, W.ag_dK.get(), W.ag_dkvb.get(), n, 0, H,
                                              {W.ag_dlat.get(), w}));
    KC(kc::CastRows(drows, KDType::kFloat32, w, W.ag_dlat.get(), kAct, w, n, w, m.stream,
                    /*accumulate=*/true));
    return absl::OkStatus();
  }

  Impl& m;
  const LayerIdx& L;
  Cache& C;
  int64_t H = 0, nope = 0, qk = 0, vd = 0, w = 0, T = 0, ch = 0, SS = 0;
  float scale = 1.0f;
};

absl::Status CudaModel::Impl::MlaRingForward(const LayerIdx& L, Cache& C, bool attention_kept) {
  const MlaConfig& a = c.mla;
  const int64_t T = B.T, H = c.n_heads, kv = a.kv_lora_rank, w = kv + a.qk_rope_dim;
  const int64_t vd = a.v_head_dim;
  // This rank's block, kept for the backward.
  RETURN_IF_ERROR(Act(C.ag_lat, T, w));
  RETURN_IF_ERROR(Copy2D(C.ag_lat.get(), w, C.c_n.get(), kv, kv, T));
  RETURN_IF_ERROR(Copy2D(At(C.ag_lat.get(), kv), w, At(C.kva.get(), kv), w, a.qk_rope_dim, T));
  RETURN_IF_ERROR(F32(C.stats, 2 * StatsSlot(H, B.chunk)));
  if (attention_kept) return absl::OkStatus();
  MlaRingOps ops(*this, L, C);
  RETURN_IF_ERROR(RingForward(*B.layout, *cp.comm, ops, C.ag_lat.get()));
  for (int slot = 0; slot < 2; ++slot)
    if (B.continues[slot])
      KC(kc::CastRows(At(C.O.get(), slot * B.chunk * H * vd), kAct, H * vd, ops.Acc(slot),
                      KDType::kFloat32, H * vd, B.first_segment[slot], H * vd, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::MlaRingBackward(const LayerIdx& L, Cache& C) {
  const int64_t T = B.T, w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  MlaRingOps ops(*this, L, C);
  RETURN_IF_ERROR(RingBackward(*B.layout, *cp.comm, ops, C.ag_lat.get(), W.ring_own.get()));
  KC(kc::CastRows(W.dkva.get(), kAct, w, W.ring_own.get(), KDType::kFloat32, w, T, w, stream));
  return absl::OkStatus();
}

}  // namespace spindle
