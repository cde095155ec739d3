// The Ring level on the CPU (see cp_ring.h for the loop): attention of the local queries over
// each block with document masks (the CPU attention kernel takes the stream indices and document
// ids of both sides), log-sum-exp merges in fp32, and what travels (RingPayload): K and V, or the
// latent they are rebuilt from.
//
// Layouts (n = the level's local tokens, two chunks): Q [n, H, qk], O [n, H, vd], lse [n, H],
// blocks and their gradients [n, width] fp32. Not thread-safe: the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/batch.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/cp/cp_ring.h"

namespace spindle {

// What travels: `width` floats a token (and as many for its gradient), from which a block's
// keys and values are rebuilt.
class RingPayload {
 public:
  virtual ~RingPayload() = default;
  virtual int64_t width() const = 0;
  // K [n, H, qk] and V [n, H, vd] of a block of n tokens; valid until the next Expand.
  virtual void Expand(const float* block, int64_t n, const float** K, const float** V) = 0;
  // The block's gradient from its keys' and values' (d_block [n, width] overwritten) after the
  // Expand of the same block; parameter gradients (kv_b's) accumulated.
  virtual void Contract(const float* block, int64_t n, const float* dK, const float* dV,
                        float* d_block) = 0;
};

struct RingLevel {
  const Batch* local;      // this rank's tokens on the level (doc and idx in stream order)
  const CpLayout* layout;  // the level's zigzag (cp = R, rank = this rank's place)
  Communicator* comm;      // the ring: size R, this rank at layout->rank
};

struct RingDims {
  int64_t H, qk, vd;  // heads computed here, head sizes
  float scale;
};

struct RingScratch {
  std::vector<float> block[2], acc[2], tmp, O, lse, dQ, dK, dV;
  std::vector<int32_t> kdoc, kidx;
};

// O, lse of the local queries Q over every rank's keys; `own` is this rank's block.
absl::Status RingAttentionForward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                  const float* Q, const float* own, float* O, float* lse,
                                  RingScratch& s);
// dQ and d_own (the gradient of this rank's block, summed over every rank's queries)
// overwritten, from the forward's Q, own, O, lse and the output gradient dO.
absl::Status RingAttentionBackward(const RingLevel& lv, const RingDims& d, RingPayload& payload,
                                   const float* Q, const float* own, const float* O,
                                   const float* lse, const float* dO, float* dQ, float* d_own,
                                   RingScratch& s);

}  // namespace spindle
