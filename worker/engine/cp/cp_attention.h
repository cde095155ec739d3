// Context-parallel attention cores (DESIGN.md section 3) on the CPU kernels: Lightning in
// AllGather, All2All and hybrid modes, MLA in All2All, AllGather, Ring and hybrid modes. The
// Ulysses exchange is cp_ulysses.h's and the ring loop cp_ring.h's; the hybrid modes put the
// first around the Lightning AllGather core or the ring. Each function takes this rank's
// zigzag tokens (two chunks, see cp_layout.h) in the model's layouts, talks to the CP group
// through the Communicator, and produces exactly what the single-rank core produces for those
// tokens. The model (model.cc) calls them in place of its local cores when cp > 1.
//
// Layouts (T = local tokens, d = H * Dh):
//   Lightning q, k, v, out, dq, dk, dv: [T, H, Dh] with token stride d (dense [T, d]).
//   MLA Q, K: [T, H, qk]; V, O: [T, H, vd]; latent: [T, kv + rd] = [c_n, RoPE'd k_r].
// Communication amounts are recorded by the communicator under the layer type.
// Not thread-safe: a CpScratch belongs to one model.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "common/cp_modes.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/cp/cp_ring_cpu.h"

namespace spindle {

// Reused buffers (grown, never shrunk).
struct CpScratch {
  std::vector<float> send, recv, a, b, c, e;
  RingScratch ring;
};

// What the hybrid modes need besides the CP group (cp_groups.h): this rank's Ulysses group's
// tokens as a rank of the zigzag across the groups, and the two communicators.
struct CpHybridArgs {
  const CpBatch* group = nullptr;   // CpBatch::group
  Communicator* ulysses = nullptr;  // this rank's Ulysses group, size u, rank Member(rank)
  Communicator* ring = nullptr;     // its ring across the groups, size r, rank Group(rank)
};

struct LightningCpArgs {
  const float* q;
  const float* k;
  const float* v;
  const float* log_decay;  // [H]
  int64_t H, Dh;
  float scale;
  const Batch* local;
  const CpLayout* layout;
  Communicator* comm;
  CpHybridArgs hybrid = {};
};

// AllGather mode. Per local chunk: end state S_c of its last document (zero carry-in, two
// decay-weighted GEMMs per head), all-gather of the [2cp, H, Dh, Dh] states started at once and
// overlapped with the local outputs (zero carry-in) and `overlap` (the caller's independent work,
// may be empty); then the prefix scan over chunks (one parallel pass) and the carry correction of
// each continuing chunk's first segment. P (2 * H * Dh * Dh floats) receives the carry-in of each
// local chunk, for the backward.
absl::Status LightningAllGatherForward(const LightningCpArgs& a, CpScratch& s,
                                       const std::function<void()>& overlap, float* out, float* P);
// Backward: dP of each chunk from its outputs (decay-weighted GEMMs), all-gather overlapped with
// `overlap`, reverse scan for the end-state gradients G, then the local backward with carry-in P
// and end-state gradient G. dq, dk, dv overwritten.
absl::Status LightningAllGatherBackward(const LightningCpArgs& a, CpScratch& s, const float* P,
                                        const float* dout,
                                        const std::function<void()>& overlap, float* dq, float* dk,
                                        float* dv);

// All2All mode (H % cp == 0): q, k, v to head-split full sequences, the full-length varlen kernel
// over this rank's H/cp heads, outputs back. `saved` keeps the head-split q, k, v
// (3 * T * d floats) for the backward.
absl::Status LightningAll2AllForward(const LightningCpArgs& a, CpScratch& s, float* out,
                                     std::vector<float>* saved);
absl::Status LightningAll2AllBackward(const LightningCpArgs& a, CpScratch& s,
                                      const std::vector<float>& saved, const float* dout,
                                      float* dq, float* dk, float* dv);

// Hybrid mode: q, k, v to the Ulysses group's tokens for this member's H/u heads (kept in `saved`,
// 3 * T * d floats), the AllGather core over the ring of groups (a.hybrid) on them, `overlap`
// during its gather; outputs back. P (2 * H/u * Dh * Dh floats) keeps the core's carry-ins.
absl::Status LightningHybridForward(const LightningCpArgs& a, CpScratch& s,
                                    const std::function<void()>& overlap, float* out, float* P,
                                    std::vector<float>* saved);
absl::Status LightningHybridBackward(const LightningCpArgs& a, CpScratch& s, const float* P,
                                     const std::vector<float>& saved, const float* dout,
                                     const std::function<void()>& overlap, float* dq, float* dk,
                                     float* dv);

struct MlaCpArgs {
  int64_t H, qk, vd, kv, rd;  // heads, q/k head size (nope + rope), v head size, latent ranks
  float scale;
  const Batch* local;
  const CpLayout* layout;
  Communicator* comm;
  CpHybridArgs hybrid = {};
  // Ring and hybrid modes: what travels the ring (MlaRingPayloadFor of the heads a rank computes).
  MlaRingPayload payload = MlaRingPayload::kLatent;
};

// MLA All2All mode: Q, K, V to head-split full sequences, causal document attention over the
// whole sequence for H/cp heads, O back. `saved` holds the head-split Q, K, V, O and lse.
absl::Status MlaAll2AllForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                               const float* V, float* O, std::vector<float>* saved);
// dQ, dK, dV overwritten.
absl::Status MlaAll2AllBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                                const float* dO, float* dQ, float* dK, float* dV);

// MLA AllGather mode: all-gather of the latent [c_n, k_r] of every token (kv + rd values, not K
// and V), K and V rebuilt locally with kv_b for the stream prefix the local queries can see, and
// document-masked attention of the local queries over it. `saved` keeps the gathered latent and
// the rebuilt K, V for the backward. lse is [T, H].
absl::Status MlaAllGatherForward(const MlaCpArgs& a, CpScratch& s, const float* Q,
                                 const float* latent, const float* W_kv_b, float* O, float* lse,
                                 std::vector<float>* saved);
// Backward: attention backward over the gathered keys, kv_b backward (dW_kv_b accumulated for
// this rank's queries), then the latent gradients reduce-scattered back to their owners.
// dQ and d_latent ([T, kv + rd]) overwritten.
absl::Status MlaAllGatherBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                                  const float* Q, const float* O, const float* lse,
                                  const float* W_kv_b, const float* dO, float* dQ,
                                  float* d_latent, float* dW_kv_b);

// MLA Ring mode (the CP group is the ring) and hybrid mode (Ulysses over a.hybrid.ulysses around
// the ring a.hybrid.ring), cp_ring.h. With a.payload kKv they read K and V, and the backward
// writes dK and dV; with kLatent they read the latent and W_kv_b, and the backward writes d_latent
// ([T, kv + rd]) and accumulates dW_kv_b (as the AllGather mode). dQ is always written. `saved`
// keeps what the backward needs (this rank's block; hybrid also the head-split Q, O and lse).
// Ring's lse is [T, H] (the model's); hybrid keeps its own and leaves `lse` alone.
absl::Status MlaRingForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                            const float* V, const float* latent, const float* W_kv_b, float* O,
                            float* lse, std::vector<float>* saved);
absl::Status MlaRingBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                             const float* Q, const float* O, const float* lse, const float* W_kv_b,
                             const float* dO, float* dQ, float* dK, float* dV, float* d_latent,
                             float* dW_kv_b);
absl::Status MlaHybridForward(const MlaCpArgs& a, CpScratch& s, const float* Q, const float* K,
                              const float* V, const float* latent, const float* W_kv_b, float* O,
                              std::vector<float>* saved);
absl::Status MlaHybridBackward(const MlaCpArgs& a, CpScratch& s, const std::vector<float>& saved,
                               const float* W_kv_b, const float* dO, float* dQ, float* dK,
                               float* dV, float* d_latent, float* dW_kv_b);

}  // namespace spindle
