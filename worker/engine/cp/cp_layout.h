// CpLayout: what every rank of a CP group knows about the whole sequence it shares (DESIGN.md
// section 3): the zigzag chunks in stream order with the flags the Lightning state scan needs,
// the document id of every stream token (for masks over gathered keys) and the full sequence's
// document starts (for the full-length varlen kernels of the All2All modes). Built locally from
// the full sequence, which every CP rank reads: no communication.
//
// With Ulysses groups (parallel.ulysses = u > 1, the hybrid modes) the batch also carries its
// group's tokens as one rank of the r-way zigzag across the groups (cp_groups.h).
//
// Also the per-layer-type mode rule shared with the coordinator's planner (coordinator/
// cp_planner.h): All2All when cp <= heads and heads % cp == 0, else AllGather; a forced All2All
// with heads % cp != 0 is refused before anything runs, as is a combination CheckCpModes
// (common/cp_modes.h) refuses.
// Plain data and pure functions; no thread-safety concerns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "worker/engine/batch.h"
#include "worker/engine/cp/cp_groups.h"

namespace spindle {

// One of the 2*cp chunks, in stream order.
struct CpChunk {
  int64_t begin = 0;          // stream index of its first token
  int64_t len = 0;
  int64_t first_segment = 0;  // tokens before the first document start after its first token
  bool continues = false;     // its first token continues a document begun in an earlier chunk
  bool has_start = false;     // b_c: a document starts at one of its tokens (first included)
};

struct CpLayout {
  int64_t cp = 1, rank = 0;
  int64_t ulysses = 1;             // ranks a Ulysses group (cp_groups.h)
  int64_t T_full = 0, chunk = 0;   // whole-sequence tokens, tokens per chunk
  std::vector<int32_t> doc;        // [T_full] document id of every stream token
  std::vector<int32_t> idx;        // [T_full] 0, 1, ..., T_full - 1
  std::vector<int32_t> cu_seqlens; // document starts of the whole sequence, then T_full
  std::vector<CpChunk> chunks;     // [2 cp]

  // Zigzag (batch.h): rank r holds chunks r (slot 0) and 2cp-1-r (slot 1).
  int64_t ChunkOf(int64_t rank, int64_t slot) const { return ZigzagChunk(cp, rank, slot); }
  int64_t RankOfChunk(int64_t c) const { return ZigzagRank(cp, c); }
  int64_t SlotOfChunk(int64_t c) const { return ZigzagSlot(cp, c); }
  CpGroups groups() const { return {cp, ulysses}; }
  // Stream index of local token t of `rank`.
  int64_t StreamIndex(int64_t rank, int64_t t) const {
    return ChunkOf(rank, t / chunk) * chunk + t % chunk;
  }
};

// This rank's tokens (ShardZigzag) and the shared layout; with Ulysses groups also `group`: the
// tokens of this rank's group, as rank Group(rank) of the zigzag over r = cp / u ranks
// (ShardForCp(full, r, Group(rank))), null when ulysses == 1.
struct CpBatch {
  Batch local;
  CpLayout layout;
  std::shared_ptr<const CpBatch> group;
};

// InvalidArgument when full.T is not divisible by 2 * cp, or ulysses does not divide cp.
absl::StatusOr<CpBatch> ShardForCp(const Batch& full, int64_t cp, int64_t rank,
                                   int64_t ulysses = 1);

struct CpModes {
  CpMode lightning = CpMode::kAllGather;
  CpMode mla = CpMode::kAllGather;
};

// The modes a planned spec runs (IsPlanned in planner/cp_planner.h): "auto" at cp = 1 is
// AllGather's path; "auto" or "fastest" at cp > 1 is FailedPrecondition (the planner decides
// them, once, before the trainer starts), as is All2All with n_heads % cp != 0, naming the field,
// cp and heads (the planner's wording); InvalidArgument with CheckCpModes' message for a
// combination it refuses.
absl::StatusOr<CpModes> PlannedCpModes(const ParallelSpec& p, int64_t n_heads);

}  // namespace spindle
