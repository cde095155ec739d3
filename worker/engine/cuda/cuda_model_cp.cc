// CudaModel's context parallelism (see cuda_model.h): the checks of the CP context and of a
// CpBatch, and the device's copies for the Ulysses exchanges (written once in cp/cp_ulysses.h; over
// the CP group for All2All, inside the Ulysses groups for the hybrid modes). The attention
// families run their cores under CP: cuda_lightning.cc, cuda_mla_cp.cc and cuda_mla_ring.cc.
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

// ---- Context parallelism: the all-to-all data movement -------------------------------------------

absl::Status CudaModel::Impl::CheckCpContext() const {
  if (cp.comm == nullptr || cp.comm->size() <= 1) return absl::OkStatus();
  const int64_t n = cp.comm->size();
  struct Kind {
    char kind;
    const char* field;
    CpMode mode;
  };
  bool all2all = false, hybrid = false;
  for (const Kind& k : {Kind{'L', "lightning_mode", cp.lightning_mode},
                        Kind{'M', "mla_mode", cp.mla_mode}}) {
    if (c.NumLayersOfKind(k.kind) == 0) continue;
    const bool runs = k.mode == CpMode::kAll2All || k.mode == CpMode::kAllGather ||
                      k.mode == CpMode::kHybrid || (k.kind == 'M' && k.mode == CpMode::kRing);
    if (!runs)
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: ", k.field, " ", std::string(CpModeName(k.mode)),
          " must be a planned mode (PlannedCpModes) before SetCp"));
    all2all |= k.mode == CpMode::kAll2All;
    hybrid |= k.mode == CpMode::kHybrid;
  }
  if (all2all) RETURN_IF_ERROR(CheckAll2All("cuda model", c.n_heads, n));
  if (hybrid) {
    // The Ulysses group and the ring across the groups (cp_groups.h).
    if (cp.ulysses == nullptr || cp.ring == nullptr || cp.ulysses->size() * cp.ring->size() != n ||
        cp.ring->size() < 2)
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda model: the hybrid modes need a Ulysses group of u ranks and a ring of cp / u >= 2 "
          "groups with u x (cp / u) = cp = ",
          n));
    const CpGroups g{n, cp.ulysses->size()};
    if (c.n_heads % g.u != 0 || cp.ulysses->rank() != g.Member(cp.comm->rank()) ||
        cp.ring->rank() != g.Group(cp.comm->rank()))
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda model: CP rank ", cp.comm->rank(), " must be member ", g.Member(cp.comm->rank()),
          " of its Ulysses group of ", g.u, " (n_heads=", c.n_heads, " divisible by it) and rank ",
          g.Group(cp.comm->rank()), " of its ring"));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::CheckCpBatch(const CpBatch& b) const {
  if (b.layout.cp <= 1) return absl::OkStatus();
  if (cp.comm == nullptr || cp.comm->size() != b.layout.cp)
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda model: a cp=", b.layout.cp, " batch needs SetCp with a group of that size"));
  if (cp.comm->rank() != b.layout.rank)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: the batch is rank ", b.layout.rank,
                     "'s share but this model's CP group rank is ", cp.comm->rank()));
  RETURN_IF_ERROR(CheckCpContext());
  const bool hybrid = cp.lightning_mode == CpMode::kHybrid || cp.mla_mode == CpMode::kHybrid;
  if (hybrid && (b.group == nullptr || b.layout.ulysses != cp.ulysses->size()))
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda model: the hybrid modes need the batch's Ulysses groups of ", cp.ulysses->size(),
        " (ShardForCp with ulysses), but the batch has groups of ", b.layout.ulysses));
  return absl::OkStatus();
}

absl::Status DeviceCopies::CopyRows(void* dst, int64_t dst_token, int64_t dst_head, const void* src,
                                    int64_t src_token, int64_t src_head, int64_t T, int64_t heads,
                                    int64_t width) {
  return FromKernel(kc::CopyRows(dst, dst_token, dst_head, src, src_token, src_head, T, heads,
                                 width, kAct, *stream_));
}

absl::Status DeviceCopies::Copy(void* dst, const void* src, int64_t bytes) {
  CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, *stream_));
  return absl::OkStatus();
}

absl::Status DeviceCopies::Fence() {
  CUDA(cudaStreamSynchronize(*stream_));
  return absl::OkStatus();
}

}  // namespace spindle
