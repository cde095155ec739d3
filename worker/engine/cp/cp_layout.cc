// Zigzag layout of a CP group and the mode rule (see cp_layout.h).
#include "worker/engine/cp/cp_layout.h"

#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"

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

absl::StatusOr<CpMode> Resolve(const char* field, int64_t cp, int64_t heads, CpMode requested,
                               std::string* reason) {
  if (requested == CpMode::kAll2All) {
    if (heads % cp != 0)
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": all2all needs n_heads divisible by cp, but n_heads=", heads, " and cp=", cp,
          " (", heads, " % ", cp, " = ", heads % cp, "); use allgather or a cp that divides ",
          heads));
    *reason = "forced by the spec";
    return CpMode::kAll2All;
  }
  if (requested == CpMode::kAllGather || requested == CpMode::kRing ||
      requested == CpMode::kHybrid) {
    *reason = "forced by the spec";
    return requested;
  }
  if (cp == 1) {
    *reason = "cp=1: no sequence split";
    return CpMode::kAllGather;
  }
  if (cp <= heads && heads % cp == 0) {
    *reason = absl::StrCat("default: cp=", cp, " <= n_heads=", heads, " and ", heads, " % ", cp,
                           " == 0");
    return CpMode::kAll2All;
  }
  *reason = absl::StrCat("default: n_heads=", heads, ", cp=", cp, ": all2all impossible");
  return CpMode::kAllGather;
}

}  // namespace

absl::StatusOr<CpModes> ResolveCpModes(int64_t cp, int64_t n_heads, CpMode lightning, CpMode mla,
                                       int64_t ulysses) {
  ParallelSpec p;
  p.cp = cp;
  p.ulysses = ulysses;
  p.lightning_mode = lightning;
  p.mla_mode = mla;
  if (absl::Status s = CheckCpModes(p, n_heads); !s.ok()) return s;
  CpModes m;
  auto l = Resolve("parallel.lightning_mode", cp, n_heads, lightning, &m.lightning_reason);
  if (!l.ok()) return l.status();
  auto a = Resolve("parallel.mla_mode", cp, n_heads, mla, &m.mla_reason);
  if (!a.ok()) return a.status();
  m.lightning = *l;
  m.mla = *a;
  return m;
}

}  // namespace spindle
