// The Ring level of MLA's "ring" and "hybrid" modes (DESIGN.md section 3): the ring loop, written
// once for every backend over a small interface of block operations (RingBlockOps) that the CPU
// (cp_ring_cpu.h) and CUDA (worker/engine/cuda/cuda_mla_ring.cc) engines implement.
//
// R ranks hold a zigzag of 2R chunks (rank j: chunks j and 2R-1-j); each rank's block (what its
// tokens' keys and values are rebuilt from) travels the ring while every rank attends its queries
// to the block it holds, so at step s rank j holds rank (j - s)'s block. Its own block (the
// diagonal) is causal, the others are visible whole or in part; document masks apply throughout
// (documents cross chunks and ranks), and a block no query may see is skipped (still passed on).
// Partial outputs merge by log-sum-exp in fp32. The backward sends the blocks around again with
// their gradient accumulators: each rank adds its queries' share to the accumulator of the block it
// holds and passes it on, and the accumulator reaches the block's owner after R - 1 steps, where
// the owner's own share joins it. Every send and receive runs on the communicator's thread while
// the current block computes.
//
// Pure Ring: the level is the CP group itself. Hybrid: the level is the ring of this rank's
// Ulysses member index across the groups, each group's tokens one rank's share (cp_groups.h).
//
// Bytes sent per call: forward R - 1 blocks, backward R - 1 blocks and R - 1 accumulators.
// Buffers are the backend's (host or device memory); the communicator takes them as they are.
// Not thread-safe: the ops and their buffers belong to the caller.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"

namespace spindle {

// Whether a query of chunk qc may see a key of chunk kc: never a later chunk; its own chunk always
// (a token sees itself); an earlier chunk when the document of its last token continues to the
// first token of qc (documents are contiguous runs of the stream).
bool RingChunkSees(const CpLayout& L, int64_t qc, int64_t kc);
// Whether any query of rank q_rank may see any key of rank k_rank.
bool RingBlockVisible(const CpLayout& L, int64_t q_rank, int64_t k_rank);

// The loop's scratch, in the backend's memory: two blocks in flight and the accumulators (the one
// sent, the one received, and a step's share before it joins the received one).
struct RingBuffers {
  void* block[2] = {nullptr, nullptr};
  void* acc[2] = {nullptr, nullptr};
  void* share = nullptr;
};

// One rank's work on the ring. `owner` is the rank whose block is given; `diagonal` marks step 0
// (this rank's own block), which every query sees, so it starts the output (forward) and writes
// the queries' gradient (backward); later blocks merge into the output and add to the gradient.
class RingBlockOps {
 public:
  virtual ~RingBlockOps() = default;
  virtual int64_t block_bytes() const = 0;  // a block as it travels
  virtual int64_t grad_bytes() const = 0;   // a block's gradient as it travels
  // Scratch for one call of the loop (the accumulators only for the backward).
  virtual absl::StatusOr<RingBuffers> Buffers(bool backward) = 0;
  // The local queries over `block`.
  virtual absl::Status Forward(const void* block, int64_t owner, bool diagonal) = 0;
  // The local queries' share of `block`'s gradient into d_block (overwritten), from the forward's
  // merged output and statistics.
  virtual absl::Status Backward(const void* block, int64_t owner, bool diagonal, void* d_block) = 0;
  virtual absl::Status ZeroGrad(void* g) = 0;
  virtual absl::Status AddGrad(void* dst, const void* src) = 0;
  // Returns once the work queued so far has finished with the loop's buffers, so that the
  // communicator may read or overwrite them (a device backend synchronises its stream).
  virtual absl::Status Fence() = 0;
};

// comm: the level's ring, size L.cp, this rank at L.rank. own: this rank's block.
absl::Status RingForward(const CpLayout& L, Communicator& comm, RingBlockOps& ops, const void* own);
// d_own: the gradient of this rank's block, summed over every rank's queries (overwritten).
absl::Status RingBackward(const CpLayout& L, Communicator& comm, RingBlockOps& ops, const void* own,
                          void* d_own);

}  // namespace spindle
