// Token embedding lookup and its gradient (scatter-add into the table).
#include <algorithm>
#include <cstring>

#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {

void EmbeddingForward(const int32_t* ids, const float* table, float* out, int64_t T, int64_t D) {
#pragma omp parallel for schedule(static) if (T * D > 16384)
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(out + t * D, table + static_cast<int64_t>(ids[t]) * D, D * sizeof(float));
  }
}

void EmbeddingBackward(const int32_t* ids, const float* dout, float* dtable, int64_t T, int64_t D,
                       int64_t vocab) {
  (void)vocab;
  // Threads own disjoint column blocks of the table, so repeated ids never race, and every
  // element adds its tokens in order t = 0..T-1: the result is bitwise independent of the
  // thread count.
  constexpr int64_t kBlock = 64;
  const int64_t n_blocks = (D + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (T * D > 16384)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t j0 = b * kBlock;
    const int64_t n = std::min(kBlock, D - j0);
    for (int64_t t = 0; t < T; ++t) {
      float* dst = dtable + static_cast<int64_t>(ids[t]) * D + j0;
      const float* src = dout + t * D + j0;
      for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace spindle::kernels::cpu
