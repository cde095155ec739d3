// Validity of the CP mode combinations, MLA's ring payload and the per-layer communication volume
// (see cp_modes.h).
#include "common/cp_modes.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace spindle {

bool All2AllSplits(int64_t n_heads, int64_t cp) { return cp >= 1 && n_heads % cp == 0; }

absl::Status CheckAll2All(std::string_view field, int64_t n_heads, int64_t cp) {
  if (All2AllSplits(n_heads, cp)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      std::string(field), ": all2all needs n_heads divisible by cp, but n_heads=", n_heads,
      " and cp=", cp, " (", n_heads, " % ", cp, " = ", n_heads % std::max<int64_t>(1, cp),
      "); use allgather or a cp that divides ", n_heads));
}

absl::Status CheckCpModes(const ParallelSpec& p, int64_t n_heads) {
  if (p.lightning_mode == CpMode::kRing)
    return absl::InvalidArgumentError(
        "parallel.lightning_mode: \"ring\" is MLA's only (Lightning has no ring mode); use "
        "\"allgather\", \"all2all\" or \"hybrid\"");
  const int64_t u = p.ulysses, cp = p.cp;
  if (u < 1 || u > std::max<int64_t>(1, cp))
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ulysses: must be in [1, cp = ", cp, "], got ", u));
  const bool lh = p.lightning_mode == CpMode::kHybrid, mh = p.mla_mode == CpMode::kHybrid;
  if (!lh && !mh) {
    if (u == 1) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.ulysses: ", u,
        " is only used by the \"hybrid\" modes, but neither parallel.lightning_mode nor "
        "parallel.mla_mode is \"hybrid\"; set one of them to \"hybrid\" or remove ulysses"));
  }
  const std::string field = lh ? "parallel.lightning_mode" : "parallel.mla_mode";
  if (u < 2)
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"hybrid\" needs parallel.ulysses >= 2 (the size of its Ulysses groups), got ",
        u));
  if (cp % u != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ulysses: must divide parallel.cp, got ulysses=", u, " and cp=", cp));
  if (cp / u < 2)
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.ulysses: ", u, " with cp=", cp, " leaves a ring of cp / ulysses = ", cp / u,
        " group; \"hybrid\" needs at least 2 (with one group use \"all2all\")"));
  if (n_heads % u != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.ulysses: must divide model.n_heads, got ulysses=", u, " and n_heads=", n_heads));
  return absl::OkStatus();
}

std::string_view MlaRingPayloadName(MlaRingPayload p) {
  return p == MlaRingPayload::kKv ? "kv" : "latent";
}

int64_t MlaRingPayloadWidth(const MlaConfig& m, MlaRingPayload p, int64_t heads) {
  if (p == MlaRingPayload::kKv) return heads * (m.qk_nope_dim + m.qk_rope_dim + m.v_head_dim);
  return m.kv_lora_rank + m.qk_rope_dim;
}

MlaRingPayload MlaRingPayloadFor(const MlaConfig& m, int64_t heads) {
  return MlaRingPayloadWidth(m, MlaRingPayload::kKv, heads) <
                 MlaRingPayloadWidth(m, MlaRingPayload::kLatent, heads)
             ? MlaRingPayload::kKv
             : MlaRingPayload::kLatent;
}

int64_t MlaRingHeads(int64_t n_heads, CpMode mla_mode, int64_t ulysses) {
  return mla_mode == CpMode::kHybrid ? n_heads / std::max<int64_t>(1, ulysses) : n_heads;
}

namespace {

// The Communicator's accounting of its collectives (comm/communicator.h), in bytes sent, for
// `n` ranks and fp32 elements: an all-to-all of blocks of `block` elements, an all-gather of `in`
// elements (a reduce-scatter of blocks of `in` sends as much), a ring send of `in`.
int64_t AllToAll(int64_t n, int64_t block) { return (n - 1) * block * 4; }
int64_t AllGather(int64_t n, int64_t in) { return (n - 1) * in * 4; }

}  // namespace

CpCommBytes CpLayerCommBytes(const ModelConfig& m, char kind, CpMode mode, const ParallelSpec& p,
                             int64_t seq_len) {
  CpCommBytes b;
  const int64_t cp = p.cp;
  if (cp <= 1) return b;
  const int64_t T = seq_len / cp, d = m.d_model, H = m.n_heads, Dh = m.head_dim();
  const int64_t u = mode == CpMode::kHybrid ? p.ulysses : 1;
  if (u < 1 || cp % u != 0 || H % u != 0) return b;  // refused by CheckCpModes
  const int64_t r = cp / u, Hl = H / u;
  const MlaConfig& a = m.mla;
  const int64_t qk = a.qk_nope_dim + a.qk_rope_dim, vd = a.v_head_dim;
  const int64_t w = a.kv_lora_rank + a.qk_rope_dim;
  if (kind == 'L') {
    switch (mode) {
      case CpMode::kAllGather:  // the chunk states forward, their gradients backward
        b.forward = b.backward = AllGather(cp, 2 * H * Dh * Dh);
        break;
      case CpMode::kAll2All:  // q|k|v in, o out; the reverse backward
        b.forward = b.backward = AllToAll(cp, 3 * T * d / cp) + AllToAll(cp, T * d / cp);
        break;
      case CpMode::kHybrid:  // the same inside the Ulysses group, the states across the groups
        b.forward = b.backward =
            AllToAll(u, 3 * T * d / u) + AllToAll(u, T * d / u) + AllGather(r, 2 * Hl * Dh * Dh);
        break;
      default:
        break;
    }
    return b;
  }
  switch (mode) {
    case CpMode::kAllGather:  // the latent gathered, its gradient reduce-scattered
      b.forward = b.backward = AllGather(cp, T * w);
      break;
    case CpMode::kAll2All:
      b.forward = b.backward =
          AllToAll(cp, T * H * (2 * qk + vd) / cp) + AllToAll(cp, T * H * vd / cp);
      break;
    case CpMode::kRing:
    case CpMode::kHybrid: {
      // The ring: r - 1 sends of a block forward; backward the blocks again and their gradient
      // accumulators (each rank keeps its own block's share, so r - 1 sends of each).
      const int64_t heads = u == 1 ? H : Hl;
      const MlaRingPayload pl = MlaRingPayloadFor(a, heads);
      const int64_t block = u * T * MlaRingPayloadWidth(a, pl, heads);
      b.forward = AllGather(r, block);
      b.backward = 2 * AllGather(r, block);
      if (u == 1) break;
      // The Ulysses group around it: Q (and K, V unless the latent travels) to head-split, O back;
      // the latent of the group gathered, its gradient reduce-scattered.
      const int64_t in_width = pl == MlaRingPayload::kKv ? 2 * qk + vd : qk;
      const int64_t ulysses = AllToAll(u, T * H * in_width / u) + AllToAll(u, T * H * vd / u) +
                              (pl == MlaRingPayload::kLatent ? AllGather(u, T * w) : 0);
      b.forward += ulysses;
      b.backward += ulysses;
      break;
    }
    default:
      break;
  }
  return b;
}

}  // namespace spindle
