// The persistent grouped GEMM of the experts on Hopper (moe_gemm_sm90.cu): GroupedGemm's
// GroupedGemmMethod::kPersistent for bf16 operands. One launch covers every group: its CTAs (one
// per SM) walk the output tiles of all groups in (group, m-tile, n-tile) order from a device table
// of tile prefix sums, so no host call is made per group and a group's last tiles overlap the
// next group's first. Private to kernels/cuda (moe_gemm.cu is its one caller).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda::internal {

// The three roles of GroupedGemm (moe.h), with its layouts: rows stacked by group (host
// `offsets`, G + 1 entries), experts' weights [G, N, K], all bf16 but dB.
enum class PersistentRole {
  kForward,         // C [rows, N] = A [rows, K] W_g^T per group        (a = A, b = W, c = C)
  kBackwardData,    // dA [rows, K] (+)= dC [rows, N] W_g per group     (a = dC, b = W, c = dA)
  kBackwardWeight,  // dB [G, N, K] (fp32) += dC_g^T A_g per group      (a = dC, b = A, c = dB)
};

struct PersistentGemmArgs {
  PersistentRole role = PersistentRole::kForward;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const int64_t* offsets = nullptr;  // host, G + 1 non-decreasing entries
  int64_t G = 0, N = 0, K = 0;
  bool accumulate = false;  // kBackwardData: dA += ...
};

// Owns the device tile table and the driver's tensor-map encoder. Not thread-safe; calls on one
// stream (GroupedGemm's contract).
class PersistentGroupedGemm {
 public:
  // kUnsupported where this build has no sm_90a code or the current device is not compute
  // capability 9.0; CUDA errors otherwise.
  static Status Create(std::unique_ptr<PersistentGroupedGemm>* out);
  ~PersistentGroupedGemm();
  PersistentGroupedGemm(const PersistentGroupedGemm&) = delete;
  PersistentGroupedGemm& operator=(const PersistentGroupedGemm&) = delete;

  // Ok when Run would take `a`; otherwise kUnsupported naming the reason (then the caller runs
  // the groups another way): N and K multiples of 8, rows (offsets[G]) and every size below
  // 2^31, G <= 1024, the pointers 16-byte aligned, and for kBackwardWeight every offset a
  // multiple of 64 (a 64-row K-block never crosses a group). Empty groups are skipped.
  Status Supports(const PersistentGemmArgs& a) const;
  // Enqueues the tile-table kernel and the GEMM on `stream`. Checks Supports first.
  Status Run(const PersistentGemmArgs& a, cudaStream_t stream);

 private:
  PersistentGroupedGemm() = default;
  int sms_ = 0;
  void* encode_ = nullptr;    // cuTensorMapEncodeTiled, from the runtime's driver entry point
  int32_t* table_ = nullptr;  // device: offsets [kMaxGroups + 1], tile starts [kMaxGroups + 1]
};

}  // namespace spindle::kernels::cuda::internal
