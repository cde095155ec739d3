// The Ulysses exchange (DESIGN.md section 3): the transposition between a group's sequence split
// (each member holds its local tokens, every head) and its head split (each member holds the
// group's tokens for H/n of the heads), around one all-to-all of the group. Written once for both
// engines over their copies (cp_copies.h): where each member's tokens go among the group's rows
// (UlyssesRuns), the packing by heads, the exchange by pieces and the unpacking. All2All modes run
// it over the whole CP group; the hybrid modes over their Ulysses group of u ranks (cp_groups.h),
// whose tokens are then one rank's share of the zigzag across the groups.
//
// Layouts: a tensor is a view (UlyssesView: token and head strides, a head's width): of a member's
// local tokens over all H heads, or of the group's n T gathered rows (in the group's stream order,
// UlyssesGroup::Row) over this member's H/n heads. Several tensors travel in one all-to-all: a
// member's block is [T][row], a token's row holding each tensor's H/n heads side by side (row =
// the sum of H/n * width), tokens in the local order of the member whose tokens they are. Gathered
// views that are exactly such rows (one buffer, the tensors side by side) are received in place;
// others through the receive scratch.
// Not thread-safe: the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_copies.h"
#include "worker/engine/cp/cp_layout.h"

namespace spindle {

// A tensor of an exchange in the backend's memory; strides and width in elements.
struct UlyssesView {
  void* p;
  int64_t token_stride, head_stride, width;
};

// The CPU's dense fp32 tensors: [T, H, width] local, [n T, H/n, width] gathered.
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

// A group's exchange: its communicator (size n), n, and its runs.
struct UlyssesComm {
  Communicator* comm = nullptr;
  int64_t members = 1;
  std::vector<UlyssesRun> runs;
};
UlyssesComm MakeUlyssesComm(Communicator* comm, const UlyssesGroup& g);

// Elements of a token's row in a block: the views' H/n heads side by side.
int64_t UlyssesRowWidth(int64_t heads_per_member, const std::vector<UlyssesView>& views);

// Local views (T tokens, H heads) -> n member blocks in `send` (block j: heads j H/n ...).
absl::Status UlyssesPackByHeads(CpCopies& cc, int64_t T, int64_t H, int64_t n,
                                const std::vector<UlyssesView>& local, void* send);
// Member blocks j0 .. j1 - 1 of `recv` (this member's tokens, member j's heads) -> the local
// views, block j0's first head at the views' head 0 (j1 < 0: every member; with j0 = 0, block j's
// heads land at j H/n).
absl::Status UlyssesUnpackToTokens(CpCopies& cc, const void* recv, int64_t T, int64_t H, int64_t n,
                                   const std::vector<UlyssesView>& local, int64_t j0 = 0,
                                   int64_t j1 = -1);
// Rows of `row_bytes` run by run between member blocks (block i: member i's T local rows) and
// the group's row order (`grouped`).
absl::Status UlyssesCopyRuns(CpCopies& cc, const UlyssesComm& u, int64_t T, const void* src,
                             bool src_grouped, void* dst, bool dst_grouped, int64_t row_bytes);
// The all-to-all by pieces, one a run: member blocks <-> group rows, each piece straight to its
// place (after cc.Fence(): the communicator reads and writes on its own stream or thread).
absl::Status UlyssesExchange(CpCopies& cc, const UlyssesComm& u, int64_t T, const void* send,
                             bool send_grouped, void* recv, bool recv_grouped, int64_t row_bytes,
                             CommLayer layer);

// Local views -> gathered views of this member's heads. `send`, `recv`: scratch of n T rows each
// (UlyssesRowWidth elements a row; `recv` unused when the gathered views are one row block).
absl::Status UlyssesToHeads(CpCopies& cc, const UlyssesComm& u, int64_t T, int64_t H,
                            const std::vector<UlyssesView>& local,
                            const std::vector<UlyssesView>& gathered, void* send, void* recv,
                            CommLayer layer);
// The reverse: gathered views of this member's heads -> local views of every head (`send`
// unused when the gathered views are one row block).
absl::Status UlyssesToTokens(CpCopies& cc, const UlyssesComm& u, int64_t T, int64_t H,
                             const std::vector<UlyssesView>& gathered,
                             const std::vector<UlyssesView>& local, void* send, void* recv,
                             CommLayer layer);

// The same for the CPU's dense fp32 parts, through `comm` (the group's communicator, size n);
// `send`, `recv` grow as needed.
absl::Status UlyssesToHeads(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                            const std::vector<UlyssesPart>& local,
                            const std::vector<UlyssesPart>& gathered, std::vector<float>& send,
                            std::vector<float>& recv, CommLayer layer);
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
