// Zigzag layout of a CP group and the mode rule (see cp_layout.h).
#include "worker/engine/cp/cp_layout.h"

#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"
#include "common/status.h"

namespace spindle {

absl::StatusOr<CpBatch> ShardForCp(const Batch& full, int64_t cp, int64_t rank, int64_t ulysses) {
  if (cp < 1 || rank < 0 || rank >= cp)
    return absl::InvalidArgumentError(absl::StrCat("cp: rank ", rank, " is not in a group of ", cp));
  if (ulysses < 1 || cp % ulysses != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("cp: ulysses groups of ", ulysses, " ranks do not divide cp = ", cp));
  if (full.T % (2 * cp) != 0)
    return absl::InvalidArgumentError(absl::StrCat("cp: seq_len ", full.T,
                                                   " is not divisible by 2*cp = ", 2 * cp));
  CpBatch out;
  out.local = cp == 1 ? full : ShardZigzag(full, cp, rank);
  CpLayout& L = out.layout;
  L.cp = cp;
  L.rank = rank;
  L.ulysses = ulysses;
  L.T_full = full.T;
  L.chunk = full.T / (2 * cp);
  L.doc = full.doc;
  L.idx.resize(full.T);
  for (int64_t i = 0; i < full.T; ++i) L.idx[i] = static_cast<int32_t>(i);
  L.cu_seqlens.push_back(0);
  for (int64_t i = 1; i < full.T; ++i)
    if (full.doc[i] != full.doc[i - 1]) L.cu_seqlens.push_back(static_cast<int32_t>(i));
  L.cu_seqlens.push_back(static_cast<int32_t>(full.T));
  for (int64_t c = 0; c < 2 * cp; ++c) {
    CpChunk ch;
    ch.begin = c * L.chunk;
    ch.len = L.chunk;
    ch.continues = ch.begin > 0 && full.doc[ch.begin] == full.doc[ch.begin - 1];
    ch.first_segment = ch.len;
    for (int64_t i = 1; i < ch.len; ++i)
      if (full.doc[ch.begin + i] != full.doc[ch.begin + i - 1]) {
        ch.first_segment = i;
        break;
      }
    ch.has_start = !ch.continues || ch.first_segment < ch.len;
    L.chunks.push_back(ch);
  }
  if (ulysses > 1) {
    const CpGroups g = L.groups();
    auto group = ShardForCp(full, g.r(), g.Group(rank));
    if (!group.ok()) return group.status();
    out.group = std::make_shared<const CpBatch>(*std::move(group));
  }
  return out;
}

namespace {

// One layer type's planned mode: "auto" at cp = 1 (nothing to split) runs AllGather's path; any
// other undecided mode is the planner's to decide, and a forced All2All needs the heads to split.
absl::StatusOr<CpMode> Planned(const char* field, int64_t cp, int64_t heads, CpMode mode) {
  if (mode == CpMode::kAuto && cp == 1) return CpMode::kAllGather;
  if (mode == CpMode::kAuto || mode == CpMode::kFastest)
    return absl::FailedPreconditionError(absl::StrCat(
        "trainer: ", field, " is \"", std::string(CpModeName(mode)),
        "\" at cp=", cp, "; the trainer runs planned specs (the coordinator's, or spindle-train's "
        "own plan when run standalone: PlannedSpec in planner/cp_planner.h)"));
  if (mode == CpMode::kAll2All) RETURN_IF_ERROR(CheckAll2All(field, heads, cp));
  return mode;
}

}  // namespace

absl::StatusOr<CpModes> PlannedCpModes(const ParallelSpec& p, int64_t n_heads) {
  if (absl::Status s = CheckCpModes(p, n_heads); !s.ok()) return s;
  CpModes m;
  ASSIGN_OR_RETURN(m.lightning, Planned("parallel.lightning_mode", p.cp, n_heads, p.lightning_mode));
  ASSIGN_OR_RETURN(m.mla, Planned("parallel.mla_mode", p.cp, n_heads, p.mla_mode));
  return m;
}

}  // namespace spindle
