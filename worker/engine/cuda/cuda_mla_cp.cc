// The CUDA model's MLA attention under context parallelism (cuda_mla.h): All2All, the attention
// core over the whole sequence for H/cp heads, and AllGather, the latent gathered with the cross
// pieces, as DESIGN.md section 3 describes them.
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/cuda/cuda_mla.h"

namespace spindle {
namespace cuda_model_detail {

// ---- Collectives -------------------------------------------------------------------------------

absl::Status CudaMla::GatherDevice(const void* send, int64_t n, CommType type, void* recv,
                                   CommLayer layer) {
  CUDA(cudaStreamSynchronize(cx.stream));  // the communicator reads `send` on a stream of its own
  return cx.cp.comm->AllGather(send, n, type, recv, layer);
}

absl::Status CudaMla::ReduceScatterDevice(const float* send, int64_t n, float* recv,
                                          CommLayer layer) {
  CUDA(cudaStreamSynchronize(cx.stream));
  return cx.cp.comm->ReduceScatterSum(send, n, recv, layer);
}

namespace {
// The head-split whole sequence of MLA's core: rows [Q | K | V] of H/cp heads, output [O].
kc::SdpaDims MlaCpDims(const ModelConfig& c, int64_t Tf, int64_t Hl) {
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim, w = Hl * (2 * qk + vd);
  kc::SdpaDims s;
  s.T = Tf, s.H = Hl, s.Dqk = qk, s.Dv = vd;
  s.q = {w, qk};
  s.k = {w, qk};
  s.v = {w, vd};
  s.out = {Hl * vd, vd};
  return s;
}
}  // namespace

// Q, K (C.Q, C.K) and V (a view into C.kvb) of this rank's tokens -> the whole sequence for H/cp
// heads -> causal document attention -> O back into C.O.
absl::Status CudaMla::CoreForward(LayerActs& A, MlaCache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, Hl = H / B.cp, Tf = B.T_full;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t w = Hl * (2 * qk + vd), ow = Hl * vd;
  RETURN_IF_ERROR(cx.Act(A.cp_full, Tf, w));
  RETURN_IF_ERROR(cx.Act(C.cp_out, Tf, ow));
  RETURN_IF_ERROR(cx.F32(C.stats, Hl * Tf));
  RETURN_IF_ERROR(
      cx.PackByHeads(B.whole, {{C.Q.get(), H * qk, qk, qk},
                               {C.K.get(), H * qk, qk, qk},
                               {At(C.kvb.get(), nope), H * (nope + vd), nope + vd, vd}}));
  RETURN_IF_ERROR(
      cx.ExchangeToGroup(B.whole, cx.W.cp_block.get(), A.cp_full.get(), w, CommLayer::kMla));
  if (attention_kept) return absl::OkStatus();
  const void* f = A.cp_full.get();
  KC(sdpa->Forward(f, At(f, Hl * qk), At(f, 2 * Hl * qk), C.cp_out.get(), C.stats.f32(),
                   B.cu_host.data(), static_cast<int64_t>(B.cu_host.size()) - 1,
                   1.0f / std::sqrt(static_cast<float>(qk)), MlaCpDims(c, Tf, Hl), kAct,
                   cx.stream));
  RETURN_IF_ERROR(
      cx.ExchangeFromGroup(B.whole, C.cp_out.get(), cx.W.cp_tmp.get(), ow, CommLayer::kMla));
  return cx.UnpackToTokens(B.whole, cx.W.cp_tmp.get(), {{C.O.get(), H * vd, vd, vd}});
}

// dO of this rank's tokens (W.dO) -> the whole sequence for H/cp heads -> attention backward (its
// gradients into W.cp_block, as in LightningCoreBackward) -> dQ, dK and dV of this rank's tokens,
// every rank's heads in a block of their own, received into C.cp_full (UnpackGrads takes them
// out).
absl::Status CudaMla::CoreBackward(LayerActs& A, MlaCache& C) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, Hl = H / B.cp, Tf = B.T_full;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t w = Hl * (2 * qk + vd), ow = Hl * vd;
  RETURN_IF_ERROR(cx.PackByHeads(B.whole, {{W.dO.get(), H * vd, vd, vd}}));
  RETURN_IF_ERROR(
      cx.ExchangeToGroup(B.whole, cx.W.cp_block.get(), cx.W.cp_tmp.get(), ow, CommLayer::kMla));
  void* f = A.cp_full.get();
  void* df = cx.W.cp_block.get();
  RETURN_IF_ERROR(
      AttentionBackward(f, At(f, Hl * qk), At(f, 2 * Hl * qk), C.cp_out.get(), C.stats.f32(),
                        cx.W.cp_tmp.get(), df, At(df, Hl * qk), At(df, 2 * Hl * qk), B.cu_host,
                        1.0f / std::sqrt(static_cast<float>(qk)), MlaCpDims(c, Tf, Hl)));
  return cx.ExchangeFromGroup(B.whole, df, f, w, CommLayer::kMla);
}

absl::Status CudaMla::UnpackGrads(const void* recv, int64_t Hg, int64_t j0, int64_t j1) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  return cx.UnpackToTokens(B.whole, recv,
                           {{W.dQ.get(), Hg * qk, qk, qk},
                            {W.dK.get(), Hg * qk, qk, qk},
                            {At(W.dkvb.get(), nope), Hg * (nope + vd), nope + vd, vd}},
                           j0, j1);
}

// ---- Context parallelism: MLA AllGather (DESIGN.md section 3) -----------------------------------
//
// Every rank gathers the latent [c_n | rotated k_r] of all tokens (kv + rd values a token, not
// the H * (qk + vd) of K and V). Each local chunk then attends in two pieces: its own tokens
// causally with its documents (Sdpa::Forward on the chunk), and, when its first token continues
// a document begun earlier, the tokens of that document inside the chunk (the first segment)
// attend the document's earlier tokens without a mask (Sdpa::ForwardFull), walked in key blocks
// of kCudaMlaKeyBlock rows so that memory does not grow with the whole sequence, and in query
// blocks of as many rows so that cuDNN's staging does not grow with the chunk: each key block's
// keys and values are rebuilt from the gathered latent with kv_b, and each (query block, key
// block) piece merges into an fp32 running output by the log-sum-exp statistics (AttentionMerge).
// The backward walks the same pieces with the merged output and statistics (which makes each
// piece's gradients its share), rebuilding each key block's keys and values, adds the pieces' dq,
// takes each piece's key gradients back through kv_b (dW_kv_b accumulated) to the latent, and
// reduce-scatters the latent gradients (fp32, summed over the pieces) to their owners.

namespace {
// The cross piece's query rows [q0, q0 + n) in blocks of kCudaMlaKeyBlock: cuDNN's full-attention
// plans pad to powers of two and stage zero-padded copies of the queries, their output and
// gradients, so whole chunks would cost ~8.7 GiB at 1M tokens (cp = 2) and double past each
// power of two; blocks keep that at one block's.
std::vector<std::pair<int64_t, int64_t>> MlaQueryBlocks(int64_t nq) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t q0 = 0; q0 < nq; q0 += kCudaMlaKeyBlock)
    out.emplace_back(q0, std::min(kCudaMlaKeyBlock, nq - q0));
  return out;
}
}  // namespace

absl::Status CudaMla::BuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n) {
  return BuildKeysFrom(L, lat, n, 0, c.n_heads);
}

absl::Status CudaMla::BuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n, int64_t h0,
                                    int64_t Hh) {
  const int64_t kv = c.mla.kv_lora_rank, w = kv + c.mla.qk_rope_dim;
  return BuildKeysFrom(L, lat, w, At(lat, kv), w, n, h0, Hh);
}

absl::Status CudaMla::BuildKeysFrom(const LayerIdx& L, const void* c_n, int64_t ldc,
                                    const void* k_r, int64_t ldk, int64_t n, int64_t h0,
                                    int64_t Hh) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, kvw = nope + m.v_head_dim;
  RETURN_IF_ERROR(
      cx.Fwd(c_n, ldc, At(cx.Wb(L.kv_b), h0 * kvw * kv), W.ag_kvb.get(), n, kv, Hh * kvw, false));
  RETURN_IF_ERROR(cx.Copy2D(W.ag_K.get(), qk, W.ag_kvb.get(), kvw, nope, n * Hh));
  KC(kc::CopyRows(At(W.ag_K.get(), nope), Hh * qk, qk, k_r, ldk, 0, n, Hh, rd, kAct, cx.stream));
  return absl::OkStatus();
}

absl::Status CudaMla::KvBlock(const LayerIdx& L, const void* c_n, int64_t ldc, const void* k_r,
                              int64_t ldk, int64_t n, int64_t h0, int64_t Hh, void* block) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t kvw = nope + vd;
  void* V = At(block, n * Hh * qk);
  for (int64_t r0 = 0; r0 < n; r0 += kCudaMlaKeyBlock) {
    const int64_t rows = std::min(kCudaMlaKeyBlock, n - r0);
    RETURN_IF_ERROR(BuildKeysFrom(L, At(c_n, r0 * ldc), ldc, At(k_r, r0 * ldk), ldk, rows, h0, Hh));
    RETURN_IF_ERROR(cx.Copy2D(At(block, r0 * Hh * qk), qk, W.ag_K.get(), qk, qk, rows * Hh));
    RETURN_IF_ERROR(
        cx.Copy2D(At(V, r0 * Hh * vd), vd, At(W.ag_kvb.get(), nope), kvw, vd, rows * Hh));
  }
  return absl::OkStatus();
}

absl::Status CudaMla::KvGradsToLatent(const LayerIdx& L, const float* d_block, const void* c_n,
                                      int64_t ldc, int64_t n, int64_t h0, int64_t Hh, int64_t rows,
                                      void* lat, KDType lat_type) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t kvw = nope + vd, w = m.kv_lora_rank + m.qk_rope_dim;
  const int64_t lat_bytes = lat_type == KDType::kFloat32 ? 4 : kAb;
  const float* dV = d_block + n * Hh * qk;
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t k = std::min(rows, n - r0);
    // dK rows as the key gradients' buffer holds them; dV into kv_b's output gradient's V columns.
    KC(kc::CastRows(W.ag_dK.get(), kAct, Hh * qk, d_block + r0 * Hh * qk, KDType::kFloat32, Hh * qk,
                    k, Hh * qk, cx.stream));
    KC(kc::CastRows(At(W.ag_dkvb.get(), nope), kAct, kvw, dV + r0 * Hh * vd, KDType::kFloat32, vd,
                    k * Hh, vd, cx.stream));
    RETURN_IF_ERROR(KeyGradsToLatentRows(L, At(c_n, r0 * ldc), ldc, W.ag_dK.get(), W.ag_dkvb.get(),
                                         k, h0, Hh, {W.ag_dlat.get(), w}));
    KC(kc::CastRows(static_cast<char*>(lat) + r0 * w * lat_bytes, lat_type, w, W.ag_dlat.get(),
                    kAct, w, k, w, cx.stream));
  }
  return absl::OkStatus();
}

absl::Status CudaMla::BuildKeys(const LayerIdx& L, MlaCache& C, int64_t a, int64_t b) {
  const int64_t w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  return BuildKeysFrom(L, At(C.ag_lat.get(), a * w), b - a);
}

absl::Status CudaMla::KeyGradsToLatentRows(const LayerIdx& L, const void* c_n, int64_t ldc,
                                           void* dK, void* dkvb, int64_t n, int64_t h0, int64_t Hg,
                                           Rows lat) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd, kv = m.kv_lora_rank;
  const int64_t kvw = nope + m.v_head_dim, rows = h0 * kvw * kv;  // kv_b's rows of these heads
  RETURN_IF_ERROR(cx.Copy2D(dkvb, kvw, dK, qk, nope, n * Hg));
  const bool f32 = lat.type == KDType::kFloat32;
  void* lat_kr = static_cast<char*>(lat.p) + kv * (f32 ? 4 : kAb);
  if (lat.add && !f32)
    return absl::InternalError("cuda model: latent gradients add up in fp32 only");
  KC(kc::SumHeads(At(dK, nope), n, Hg, rd, Hg * qk, qk, lat_kr, lat.ld, kAct, cx.stream, lat.add));
  RETURN_IF_ERROR(cx.Bwd(c_n, ldc, At(cx.Wb(L.kv_b), rows), dkvb, nullptr, cx.G(L.kv_b) + rows, n,
                         kv, Hg * kvw, false));
  // d c_n rows = d kvb W_kv_b, into the latent's first kv columns.
  return cx.InputGrad(dkvb, At(cx.Wb(L.kv_b), rows), lat, n, kv, Hg * kvw);
}

// The key gradients of stream rows [a, b) (W.ag_dK, and dV inside W.ag_dkvb's V columns) ->
// dW_kv_b (accumulated) and the latent gradients, added (fp32) into the reduce-scatter blocks
// (W.ag_send: block i holds rank i's tokens in its local order).
absl::Status CudaMla::KeyGradsToLatent(const LayerIdx& L, MlaCache& C, int64_t a, int64_t b) {
  const int64_t T = B.T, ch = B.chunk, w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  RETURN_IF_ERROR(KeyGradsToLatentRows(L, At(C.ag_lat.get(), a * w), w, W.ag_dK.get(),
                                       W.ag_dkvb.get(), b - a, 0, c.n_heads, {W.ag_dlat.get(), w}));
  // Into the owners' blocks, chunk by chunk.
  float* send = static_cast<float*>(W.ag_send.get());
  for (int64_t j = a / ch; j * ch < b; ++j) {
    const int64_t r0 = std::max(a, j * ch), r1 = std::min(b, (j + 1) * ch);
    const int64_t owner = ZigzagRank(B.cp, j), slot = ZigzagSlot(B.cp, j);
    KC(kc::CastRows(send + (owner * T + slot * ch + (r0 - j * ch)) * w, KDType::kFloat32, w,
                    At(W.ag_dlat.get(), (r0 - a) * w), kAct, w, r1 - r0, w, cx.stream,
                    /*accumulate=*/true));
  }
  return absl::OkStatus();
}

absl::Status CudaMla::AllGatherForward(const LayerIdx& L, MlaCache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, ch = B.chunk, Tf = B.T_full, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  // This rank's latent rows -> every rank's, then into stream order.
  void* send = W.ag_send.get();
  RETURN_IF_ERROR(cx.Copy2D(send, w, C.c_n.get(), kv, kv, T));
  RETURN_IF_ERROR(cx.Copy2D(At(send, kv), w, At(C.kva.get(), kv), w, rd, T));
  RETURN_IF_ERROR(
      GatherDevice(send, T * w * kAb, CommType::kByte, W.ag_recv.get(), CommLayer::kMla));
  RETURN_IF_ERROR(cx.Act(C.ag_lat, Tf, w));
  RETURN_IF_ERROR(cx.CopyRuns(B.whole, W.ag_recv.get(), false, C.ag_lat.get(), true, w));
  const int64_t SS = StatsSlot(H, ch);
  RETURN_IF_ERROR(cx.F32(C.stats, 2 * SS));
  if (attention_kept) return absl::OkStatus();
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t first = B.lv.slot_chunk[slot] * ch;
    void* q = At(C.Q.get(), slot * ch * H * qk);
    void* o = At(C.O.get(), slot * ch * H * vd);
    float* stats = C.stats.f32() + slot * SS;
    RETURN_IF_ERROR(BuildKeys(L, C, first, first + ch));
    KC(sdpa->Forward(q, W.ag_K.get(), At(W.ag_kvb.get(), nope), o, stats,
                     B.lv.piece_cu_host[slot].data(),
                     static_cast<int64_t>(B.lv.piece_cu_host[slot].size()) - 1, scale,
                     MlaDims(c, ch), kAct, cx.stream));
    if (!B.lv.continues[slot]) continue;
    // The first segment's output accumulates in fp32 over the key blocks; its queries go in
    // blocks of as many rows, so that cuDNN stages one block's (MlaQueryBlocks).
    const int64_t nq = B.lv.first_segment[slot];
    float* acc = W.ag_acc.f32();
    KC(kc::CastRows(acc, KDType::kFloat32, H * vd, o, kAct, H * vd, nq, H * vd, cx.stream));
    for (int64_t a = B.lv.key_begin[slot]; a < first; a += kCudaMlaKeyBlock) {
      const int64_t b = std::min(first, a + kCudaMlaKeyBlock);
      RETURN_IF_ERROR(BuildKeys(L, C, a, b));
      for (const auto& [q0, n] : MlaQueryBlocks(nq)) {
        kc::SdpaDims full = MlaDims(c, n);
        full.Tkv = b - a;
        KC(sdpa->ForwardFull(At(q, q0 * H * qk), W.ag_K.get(), At(W.ag_kvb.get(), nope),
                             W.ag_o.get(), W.ag_stats.f32(), scale, full, kAct, cx.stream));
        KC(kc::AttentionMerge(acc + q0 * H * vd, KDType::kFloat32, H * vd, stats + q0, ch,
                              W.ag_o.get(), kAct, H * vd, W.ag_stats.f32(), n, n, H, vd,
                              cx.stream));
      }
    }
    KC(kc::CastRows(o, kAct, H * vd, acc, KDType::kFloat32, H * vd, nq, H * vd, cx.stream));
  }
  return absl::OkStatus();
}

// Reads W.dO; writes W.dQ and the latent gradients of this rank's tokens into W.dkva.
absl::Status CudaMla::AllGatherBackward(const LayerIdx& L, MlaCache& C) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, ch = B.chunk, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t w = m.kv_lora_rank + rd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  const int64_t SS = StatsSlot(H, ch);
  CUDA(cudaMemsetAsync(W.ag_send.get(), 0, B.cp * T * w * 4, cx.stream));
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t first = B.lv.slot_chunk[slot] * ch;
    const void* q = At(C.Q.get(), slot * ch * H * qk);
    const void* o = At(C.O.get(), slot * ch * H * vd);
    const void* dout = At(W.dO.get(), slot * ch * H * vd);
    void* dq = At(W.dQ.get(), slot * ch * H * qk);
    // The causal piece writes this chunk's dq; the cross blocks add theirs.
    RETURN_IF_ERROR(BuildKeys(L, C, first, first + ch));
    RETURN_IF_ERROR(AttentionBackward(
        q, W.ag_K.get(), At(W.ag_kvb.get(), nope), o, C.stats.f32() + slot * SS, dout, dq,
        W.ag_dK.get(), At(W.ag_dkvb.get(), nope), B.lv.piece_cu_host[slot], scale, MlaDims(c, ch)));
    RETURN_IF_ERROR(KeyGradsToLatent(L, C, first, first + ch));
    if (!B.lv.continues[slot]) continue;
    const int64_t nq = B.lv.first_segment[slot];
    for (int64_t a = B.lv.key_begin[slot]; a < first; a += kCudaMlaKeyBlock) {
      const int64_t b = std::min(first, a + kCudaMlaKeyBlock);
      RETURN_IF_ERROR(BuildKeys(L, C, a, b));
      for (const auto& [q0, n] : MlaQueryBlocks(nq)) {
        // The merged stats of these queries, dense [H, n] as the n-query graph reads them.
        CUDA(cudaMemcpy2DAsync(W.ag_stats.f32(), n * 4, C.stats.f32() + slot * SS + q0, ch * 4,
                               n * 4, H, cudaMemcpyDeviceToDevice, cx.stream));
        kc::SdpaDims full = MlaDims(c, n);
        full.Tkv = b - a;
        KC(sdpa->BackwardFull(At(q, q0 * H * qk), W.ag_K.get(), At(W.ag_kvb.get(), nope),
                              At(o, q0 * H * vd), W.ag_stats.f32(), At(dout, q0 * H * vd),
                              W.ag_dq.get(), W.ag_dK.get(), At(W.ag_dkvb.get(), nope), scale, full,
                              kAct, cx.stream));
        KC(kc::AddRows(At(dq, q0 * H * qk), H * qk, W.ag_dq.get(), H * qk, n, H * qk, kAct,
                       cx.stream));
        // This query block's share of the key block's gradients, into the latent's.
        RETURN_IF_ERROR(KeyGradsToLatent(L, C, a, b));
      }
    }
  }
  // Back to the owners, summed over ranks.
  float* rs_recv = static_cast<float*>(W.ag_recv.get());
  RETURN_IF_ERROR(
      ReduceScatterDevice(static_cast<float*>(W.ag_send.get()), T * w, rs_recv, CommLayer::kMla));
  KC(kc::CastRows(W.dkva.get(), kAct, w, rs_recv, KDType::kFloat32, w, T, w, cx.stream));
  return absl::OkStatus();
}

}  // namespace cuda_model_detail
}  // namespace spindle
