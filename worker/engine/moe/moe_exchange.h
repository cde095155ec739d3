// The mixture-of-experts FFN's token exchange, written once for every backend: which rows go to
// which expert, on which rank, and how they come back (DESIGN.md section 2, expert parallelism).
//
// A layer's T tokens each chose K experts (the router's idx [T, K]); the T * K (token, choice)
// pairs are the rows the experts run. With expert parallelism over an EP group of `ep` ranks,
// rank q owns experts [q * El, (q + 1) * El), El = E / ep.
//  - Plan(): groups this rank's pairs by expert (they are then also grouped by owner), exchanges
//    the per-expert counts over the EP group (one all-to-all of El counts a rank), and lays the
//    rows every expert of this rank receives out back to back, expert by expert, each group
//    padded to a multiple of `align` (16 where FP8 GEMMs need it, 1 on the CPU). At ep = 1
//    nothing is exchanged and the experts read the tokens directly.
//  - MoeDispatch(): gathers the pairs' token rows in send order and exchanges them (an
//    all-to-all of blocks of their own sizes), then lays the received rows out by local expert.
//  - MoeFromExperts(): the reverse for the experts' output rows, into send order, where
//    MoeCombine(pair_row) finds them. The backward sends the output gradients with
//    MoeToExperts and brings the input gradients back with MoeFromExperts, on the same plan.
// Row maps are host arrays; a backend's MoeRows does the gathers (host memory on the CPU, device
// launches on a GPU) and fences them before a collective reads their buffers. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"

namespace spindle {

// A backend's row gather: out[r, :] = in[src[r], :] for r < rows (zero rows where src[r] < 0),
// rows of D elements of elem_bytes() each; src is a host array.
class MoeRows {
 public:
  virtual ~MoeRows() = default;
  virtual int64_t elem_bytes() const = 0;
  virtual absl::Status Gather(void* out, const void* in, const int32_t* src, int64_t rows,
                              int64_t D) = 0;
  // Returns once the gathers queued so far are done (a device backend syncs its stream).
  virtual absl::Status Fence() = 0;
  // The plan's exchange of counts (host int32, n a rank) over `comm`, whose buffers are this
  // backend's memory: a device backend stages them through device memory.
  virtual absl::Status AllToAllCounts(Communicator& comm, const int32_t* mine, int32_t* got,
                                      int64_t n) {
    return comm.AllToAll(mine, n, CommType::kI32, got, CommLayer::kMoe);
  }
};

// The CPU's: fp32 host rows.
class HostMoeRows final : public MoeRows {
 public:
  int64_t elem_bytes() const override { return sizeof(float); }
  absl::Status Gather(void* out, const void* in, const int32_t* src, int64_t rows,
                      int64_t D) override;
  absl::Status Fence() override { return absl::OkStatus(); }
};

struct MoeDispatchPlan {
  int64_t T = 0, K = 0, E = 0, ep = 1, local_experts = 0, align = 1;
  // This rank's pairs: counts[e] of them chose expert e (E entries).
  std::vector<int64_t> counts;
  // Pair t * K + k's row: in the Return()ed buffer (send order) at ep > 1, in the experts' rows
  // at ep = 1. MoeCombine's `row`.
  std::vector<int32_t> pair_row;
  // ep > 1: the token of each send row (T * K), the rows to and from each EP rank (ep each).
  std::vector<int32_t> send_token;
  std::vector<int64_t> send_rows, recv_rows;
  // The experts' rows: local expert j's are [expert_offsets[j], + expert_counts[j]), padded to
  // expert_offsets[j + 1]; expert_src names each row's received row (ep > 1) or token (ep = 1),
  // -1 for padding. recv_expert_row: each received row's expert row (ep > 1).
  std::vector<int64_t> expert_counts, expert_offsets;
  std::vector<int32_t> expert_src, recv_expert_row;

  int64_t expert_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  int64_t recv_total() const;
};

// The plan at ep = 1 from the experts' group sizes counts [E] (the grouping's): counts, the
// groups' offsets padded to multiples of `align`, and nothing exchanged; its row maps (pair_row,
// expert_src) are left to the caller's grouping (PlanMoeDispatch's on the host, a device
// backend's on the device).
void PlanMoeGroupsAtEp1(const int64_t* counts, int64_t T, int64_t K, int64_t E, int64_t align,
                        MoeDispatchPlan* plan);

// The experts' rows of `p` by (local expert, source rank) as ascending row bounds, first 0, last
// p.expert_rows(): at ep > 1 an expert's rows arrive from the EP ranks in rank order (each rank's
// in its token order), and a segment ends where the source rank changes; at ep = 1 each expert's
// rows are one segment. An expert's padding rows end its last segment; an expert without rows
// gives an empty segment. The blockwise FP8 recipe forms the weight gradients' column blocks
// within these (worker/engine/numerics.h), on the CPU and on a GPU alike.
void MoeExpertSegments(const MoeDispatchPlan& p, std::vector<int64_t>* out);

// Plans a layer's exchange from the router's choices idx [T * K] (host) over `ep_comm` (null or a
// group of one: ep = 1; its counts exchange through `rows`). Errors are the communicator's.
absl::Status PlanMoeDispatch(const int32_t* idx, int64_t T, int64_t K, int64_t E, int64_t align,
                             Communicator* ep_comm, MoeRows& rows, MoeDispatchPlan* plan);

// The tokens x [T, D] -> expert_in [plan.expert_rows(), D] (padding rows zero): at ep = 1 one
// gather; at ep > 1 the pairs' rows gathered into `send` (T * K rows) in send order, then
// MoeToExperts through `recv` (plan.recv_total() rows). `overlap` (nullable) runs while the
// exchange is in flight (the shared expert's work), or after the gather at ep = 1.
absl::Status MoeDispatch(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                         const void* x, int64_t D, void* send, void* recv, void* expert_in,
                         const std::function<void()>& overlap);

// ep > 1: rows in send order [T * K, D] -> the experts' rows [plan.expert_rows(), D] (padding
// zero) on the ranks that own them, through `recv` (plan.recv_total() rows). The forward's
// dispatch, and the backward's for the output gradients.
absl::Status MoeToExperts(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                          const void* send, int64_t D, void* recv, void* expert_in,
                          const std::function<void()>& overlap);

// ep > 1: the experts' rows [plan.expert_rows(), D] -> send order [T * K, D] on the ranks whose
// tokens they are, through `scratch` (plan.recv_total() rows): the forward's outputs back for the
// combine, and the backward's input gradients.
absl::Status MoeFromExperts(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                            const void* expert_rows, int64_t D, void* scratch, void* send_order);

}  // namespace spindle
