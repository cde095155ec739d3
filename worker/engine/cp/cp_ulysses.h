// The Ulysses exchange (DESIGN.md section 3): the transposition between a group's sequence split
// (each member holds its local tokens, every head) and its head split (each member holds the
// group's tokens for H/n of the heads), around one all-to-all of the group. Where each member's
// tokens go among the group's rows (UlyssesRuns) is decided here for both engines; the copies
// below are the CPU's (the CUDA engine's are CopyRows launches in cuda_model_cp.cc). All2All
// modes run it over the whole CP group; the hybrid modes over their Ulysses group of u ranks
// (cp_groups.h), whose tokens are then one rank's share of the zigzag across the groups.
//
// Layouts: a tensor of a member's local tokens is [T, H, width] dense; gathered, [n T, H/n, width]
// dense, rows in the group's stream order (UlyssesGroup::Row). Several tensors travel in one
// all-to-all: the block for member j holds them tensor after tensor, each [T][H/n][width] in the
// local order of the member whose tokens they are.
// Not thread-safe: the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"

namespace spindle {

struct UlyssesPart {
  float* p;
  int64_t width;  // values a token and head
};

struct UlyssesGroup {
  const CpLayout* layout;
  int64_t members = 1;     // n
  int64_t first_rank = 0;  // CP rank of member 0; member i is CP rank first_rank + i
  // Row of member i's local token t among the group's n T gathered tokens.
  int64_t Row(int64_t i, int64_t t) const;
};

// Where a member's local tokens go among the group's gathered rows: each of its two zigzag chunks
// is one run of L.chunk rows (the group's rows keep the stream order inside a chunk).
struct UlyssesRun {
  int64_t member, local_row, group_row, rows;
};
// The 2 n runs of the group, member by member, slot by slot. Every backend's exchange places the
// gathered rows by them.
std::vector<UlyssesRun> UlyssesRuns(const UlyssesGroup& g);

// All2All modes: every CP rank, rows = stream indices of the whole sequence.
UlyssesGroup WholeCpGroup(const CpLayout& L);
// Hybrid modes: this rank's group of L.ulysses ranks, rows = the group's zigzag share (the
// layout of CpBatch::group).
UlyssesGroup HybridUlyssesGroup(const CpLayout& L);

// Local tensors of T tokens and H heads -> gathered tensors of this member's H/n heads, through
// one all-to-all on `comm` (the group's communicator, size n). `send`, `recv`: scratch.
absl::Status UlyssesToHeads(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                            const std::vector<UlyssesPart>& local,
                            const std::vector<UlyssesPart>& gathered, std::vector<float>& send,
                            std::vector<float>& recv, CommLayer layer);
// The reverse: gathered tensors of this member's heads -> local tensors of every head.
absl::Status UlyssesToTokens(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                             const std::vector<UlyssesPart>& gathered,
                             const std::vector<UlyssesPart>& local, std::vector<float>& send,
                             std::vector<float>& recv, CommLayer layer);

// Blocks of the members' tokens, [n][T][width] (an all-gather's output) <-> the gathered rows
// [n T, width]: the group's rows of per-token data that every head shares (MLA's latent).
void MemberBlocksToRows(const float* blocks, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* rows);
void RowsToMemberBlocks(const float* rows, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* blocks);

// dst[t, :width] = src[t * stride, :width] (dense copies of strided token rows).
void CopyStrided(const float* src, int64_t stride, int64_t T, int64_t width, float* dst);

}  // namespace spindle
