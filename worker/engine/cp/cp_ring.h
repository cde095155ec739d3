// The Ring level of MLA's "ring" and "hybrid" modes (DESIGN.md section 3) on the CPU: the ring
// loop, written once for both. R ranks hold a zigzag of 2R chunks (rank j: chunks j and 2R-1-j);
// each rank's block of keys travels the ring while every rank attends its queries to the block it
// holds, so at step s rank j holds rank (j - s)'s block. Its own block (the diagonal) is causal,
// the others are visible whole or in part; document masks apply throughout (documents cross
// chunks and ranks), and a block no query may see is skipped (still passed on). Partial outputs
// merge by log-sum-exp in fp32. The backward sends the blocks around again with their gradient
// accumulators: each rank adds its queries' share to the accumulator of the block it holds and
// passes it on, and the accumulator reaches the block's owner after R - 1 steps, where the
// owner's own share joins it. Every send and receive runs on the communicator's thread while the
// current block computes.
//
// Pure Ring: the level is the CP group itself. Hybrid: the level is the ring of this rank's
// Ulysses member index across the groups, each group's tokens one rank's share (cp_groups.h),
// for the H / u heads the Ulysses exchange gave this rank.
//
// Layouts (n = the level's local tokens, two chunks): Q [n, H, qk], O [n, H, vd], lse [n, H],
// blocks [n, width] (RingPayload). Bytes sent per call, each SendRecv of a block n * width * 4:
// forward R - 1 of them, backward 2 (R - 1). Not thread-safe: the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/batch.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"

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
