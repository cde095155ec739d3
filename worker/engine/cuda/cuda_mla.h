// The CUDA model's MLA attention family: one layer's multi-head latent attention block (q and its
// LoRA, the latent kv_a with its norm and the shared rotary key, kv_b, cuDNN attention and the
// output projection), following worker/engine/model.cc step for step (cuda_mla.cc), and its
// attention under context parallelism: All2All and AllGather (cuda_mla_cp.cc), Ring and hybrid
// (cuda_mla_ring.cc), as DESIGN.md section 3 describes them.
#pragma once

#include <memory>
#include <vector>

#include "kernels/cuda/sdpa.h"
#include "worker/engine/cuda/cuda_layer_context.h"

namespace spindle {
namespace cuda_model_detail {

// One layer's saved MLA activations (names as in model.cc).
struct MlaCache {
  DevBuf qa, qa_n, rstd_qa, Q, kva, c, c_n, rstd_c, kvb, K, O, stats;
  // CP (All2All and hybrid): the head-split output [T_full, H/cp * vd] (All2All; the group's
  // under hybrid), which the backward reads.
  DevBuf cp_out;
  // CP (AllGather, Ring and hybrid): latent rows [c_n | rotated k_r], [rows, kv + rd]: the whole
  // sequence's in stream order (AllGather), this rank's (Ring, the latent payload's own block) or
  // its Ulysses group's (hybrid).
  DevBuf ag_lat;
  // CP (Ring and hybrid, the kv payload): the ring's own block, the keys and values of this rank's
  // tokens (Ring) or its group's (hybrid) for the heads it computes: [rows, Hh qk], then
  // [rows, Hh v_head].
  DevBuf ring_kv;
  // FP8: the codes of the attention's output O, the output projection's input (the bf16 O is
  // still written: cuDNN's backward reads it).
  Fp8Act q_O;
};

// MLA's gradient scratch, shared by the layers.
struct MlaWork {
  // The gradients of O, Q, K, kv_b's output, the latent, its norm and q_a's output (a KindArena's
  // fields: see WorkFields).
  DevBuf dO, dQ, dK, dkvb, dc_n, dc, dkva, dqa_n, dqa;
  // The backward in head groups (CudaMlaGradHeadsPerGroup): at cp = 1 a group's copies of Q, K
  // and kv_b's output at the group's width (dQ, dK and dkvb then hold the group's gradients; under
  // All2All they are the received block of a rank's heads), and the fp32 sums over the groups of
  // the latent's gradients [d c_n | d k_r] and of q_a's output gradient (without a q LoRA: of the
  // normed input's).
  DevBuf gQ, gK, gkvb, sum_lat, sum_q;
  // CP (AllGather) scratch, sized by SizeCpScratch: the latent gather's send and receive blocks
  // (also the fp32 reduce-scatter's); one key block's keys and kv_b output (ag_K, ag_kvb) and
  // their gradients (ag_dK, ag_dkvb) and latent gradients (ag_dlat), rows for the larger of a
  // chunk and a key block; the cross piece's output, stats, fp32 running output and dq.
  DevBuf ag_send, ag_recv, ag_K, ag_kvb, ag_dK, ag_dkvb, ag_dlat, ag_o, ag_stats, ag_acc, ag_dq;
  // CP (Ring) scratch, sized by SizeCpScratch: the two latent blocks in flight (bf16
  // [T, kv + rd]), the gradient accumulators sent and received and a step's share (fp32), and the
  // gradient of this rank's own block (fp32). The key blocks' buffers are AllGather's (ag_K ...),
  // and ag_acc holds both local chunks' fp32 running outputs.
  DevBuf ring_block[2], ring_acc[2], ring_share, ring_own;
};

struct CudaMla {
  explicit CudaMla(LayerContext& cx) : cx(cx), c(cx.c), B(cx.B) {}

  // A.x_mid = x_in + the attention block of A.h (its FP8 linears from A.q_h). attention_kept: the
  // attention's output and statistics are already in C (a recomputing layer's, see
  // KeptForRecompute); only what its backward reads besides them is computed. transposes: see
  // QOut; requantize: see Requantizes.
  absl::Status Forward(const LayerIdx& L, LayerActs& A, MlaCache& C, const void* x_in,
                       bool attention_kept, bool transposes, bool requantize);
  // dout: gradient of the block output [T, d]; writes the context's W.dh (gradient of the normed
  // input). The attention's gradients, at cp = 1 and under All2All in groups of heads
  // (GradHeadsPerGroup).
  absl::Status Backward(const LayerIdx& L, LayerActs& A, MlaCache& C, const void* dout);
  // The buffers of a layer's cache and of the scratch that a Lightning layer never uses, with the
  // bytes the layer code asks for at the current batch and CP mode (KindArena). The attention's
  // output and statistics are not among them: a recomputing MLA layer keeps its own
  // (KeptForRecompute).
  KindFields CacheFields(LayerActs& A, MlaCache& C);
  KindFields WorkFields();
  // Under CP, once Upload set the levels of layout L: the gathers', the ring's and the key
  // blocks' scratch.
  absl::Status SizeCpScratch(const CpLayout& L);
  // The shared scratch back to the allocator.
  void Release();

  std::unique_ptr<kc::Sdpa> sdpa;        // cuDNN attention (CudaModel::Create)
  int64_t attention_heads_per_call = 0;  // see CudaModel::SetAttentionHeadsPerCall
  int64_t mla_grad_heads_per_group = 0;  // see CudaModel::SetMlaGradHeadsPerGroup

 private:
  struct RingOps;  // the ring's block operations (cuda_mla_ring.cc)

  // The attention of Forward, up to its output C.O.
  absl::Status Attention(const LayerIdx& L, LayerActs& A, MlaCache& C, bool attention_kept);
  // Sdpa::Backward with the documents of cu_host, its dims.H heads in groups (see
  // SetAttentionHeadsPerCall): each group's views start at its first head, its statistics at
  // row h0 of stats [H, T].
  absl::Status AttentionBackward(const void* q, const void* k, const void* v, const void* o,
                                 const float* stats, const void* dout, void* dq, void* dk, void* dv,
                                 const std::vector<int32_t>& cu_host, float scale,
                                 kc::SdpaDims dims);
  // The backward by groups of heads (see CudaMlaGradHeadsPerGroup): the heads in a group,
  // n_heads for one group (always under AllGather, Ring and hybrid); under All2All n_heads / cp or
  // n_heads.
  int64_t GradHeadsPerGroup() const;
  // The attention backward of heads [h0, h0 + Hg) (cp = 1) into W.dQ, W.dK and dkvb's V columns at
  // the group's width, from copies of the group's Q, K and kv_b output when Hg < n_heads.
  absl::Status GroupAttentionBackward(MlaCache& C, int64_t h0, int64_t Hg);
  // The key gradients of n rows for heads [h0, h0 + Hg) (dK [n, Hg, qk], dV in dkvb's V columns,
  // [n, Hg, nope + vd]) -> dW_kv_b's rows of those heads (accumulated; c_n: the normed latent rows,
  // `ldc` apart) and the rows' latent gradients [d c_n | d k_r, unrotated] into `lat`.
  absl::Status KeyGradsToLatentRows(const LayerIdx& L, const void* c_n, int64_t ldc, void* dK,
                                    void* dkvb, int64_t n, int64_t h0, int64_t Hg, Rows lat);
  // dQ of heads [h0, h0 + Hg) (W.dQ at the group's width) -> RoPE's inverse, dW of q_b's (or q's)
  // rows of those heads (accumulated) and the input gradient into `dx` (q_a's normed output, or
  // without a q LoRA the normed layer input).
  absl::Status QueryGrads(const LayerIdx& L, LayerActs& A, MlaCache& C, int64_t h0, int64_t Hg,
                          Rows dx);

  // ---- Context parallelism: All2All (cuda_mla_cp.cc) ----
  // Q, K (C.Q, C.K) and V (a view into C.kvb) of this rank's tokens -> the whole sequence for
  // H/cp heads (A.cp_full) -> causal document attention -> O back into C.O.
  absl::Status CoreForward(LayerActs& A, MlaCache& C, bool attention_kept);
  // The gradients stay in A.cp_full, rank block by rank block (UnpackGrads).
  absl::Status CoreBackward(LayerActs& A, MlaCache& C);
  // Rank blocks [j0, j1) of the received core gradients -> W.dQ, W.dK and dkvb's V columns, `Hg`
  // heads wide.
  absl::Status UnpackGrads(const void* recv, int64_t Hg, int64_t j0, int64_t j1);
  // ---- Context parallelism: AllGather (cuda_mla_cp.cc) ----
  // Collectives of the CP group on device buffers, once the stream's work is done.
  absl::Status GatherDevice(const void* send, int64_t n, CommType type, void* recv,
                            CommLayer layer);
  absl::Status ReduceScatterDevice(const float* send, int64_t n, float* recv, CommLayer layer);
  // n latent rows [c_n | rotated k_r] (`lat`, kv + rd apart) -> W.ag_K (keys [k_nope | k_r] of
  // every head) and W.ag_kvb (kv_b's output: k_nope and V of every head), from their first row.
  absl::Status BuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n);
  // The same for heads [h0, h0 + Hh) (keys and kv_b's output Hh heads wide).
  absl::Status BuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n, int64_t h0, int64_t Hh);
  // The same from c_n and the rotated k_r in rows of their own (`ldc`, `ldk` apart).
  absl::Status BuildKeysFrom(const LayerIdx& L, const void* c_n, int64_t ldc, const void* k_r,
                             int64_t ldk, int64_t n, int64_t h0, int64_t Hh);
  // The same from stream rows [a, b) of the gathered latent (C.ag_lat).
  absl::Status BuildKeys(const LayerIdx& L, MlaCache& C, int64_t a, int64_t b);
  absl::Status KeyGradsToLatent(const LayerIdx& L, MlaCache& C, int64_t a, int64_t b);
  absl::Status AllGatherForward(const LayerIdx& L, MlaCache& C, bool attention_kept);
  // Reads W.dO; writes W.dQ and the latent gradients of this rank's tokens into W.dkva.
  absl::Status AllGatherBackward(const LayerIdx& L, MlaCache& C);
  // The kv payload's block: the keys and values of n tokens for heads [h0, h0 + Hh), rebuilt from
  // their c_n and rotated k_r (rows `ldc`, `ldk` apart) key block by key block into `block`
  // ([n, Hh qk] then [n, Hh v_head]).
  absl::Status KvBlock(const LayerIdx& L, const void* c_n, int64_t ldc, const void* k_r,
                       int64_t ldk, int64_t n, int64_t h0, int64_t Hh, void* block);
  // The gradient of such a block (fp32, the same layout) back through kv_b: dW_kv_b's rows of
  // those heads (accumulated) and the tokens' latent gradients into `lat` ([n, kv + rd] of
  // `lat_type`, overwritten); `rows` tokens at a time (the key buffers' capacity).
  absl::Status KvGradsToLatent(const LayerIdx& L, const float* d_block, const void* c_n,
                               int64_t ldc, int64_t n, int64_t h0, int64_t Hh, int64_t rows,
                               void* lat, KDType lat_type);
  // ---- Context parallelism: Ring and hybrid (cuda_mla_ring.cc; the loop is cp/cp_ring.h's) ----
  // Ring: this rank's block (its latent rows in C.ag_lat, or under the kv payload its keys and
  // values in C.ring_kv, kept for the backward) around the ring; O and the statistics of both
  // local chunks merged over every visible block. Reads C.Q. Hybrid: Q to this rank's Ulysses
  // group's tokens for its H/u heads (A.cp_full) and the group's latent rows (C.ag_lat; under the
  // kv payload also their keys and values for those heads, C.ring_kv), the ring across the groups
  // into the group's output (C.cp_out), O back.
  absl::Status RingModeForward(const LayerIdx& L, MlaCache& C, bool attention_kept);
  absl::Status HybridForward(const LayerIdx& L, LayerActs& A, MlaCache& C, bool attention_kept);
  // Read W.dO; write W.dQ and the latent gradients of this rank's tokens into W.dkva.
  absl::Status RingModeBackward(const LayerIdx& L, MlaCache& C);
  absl::Status HybridBackward(const LayerIdx& L, LayerActs& A, MlaCache& C);

  LayerContext& cx;
  const ModelConfig& c;
  const BatchDev& B;
  MlaWork W;
};

}  // namespace cuda_model_detail
}  // namespace spindle
