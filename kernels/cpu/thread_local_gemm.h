// ThreadLocalGemm: row-major SGEMM that always runs on the calling thread, for use inside
// OpenMP regions of the CPU kernels (private to kernels/cpu). OpenBLAS hands a GEMM to its own
// thread pool above m*n*k = 64^3; called from inside an OpenMP region that oversubscribes the
// cores and runs several times slower, so larger products are cut into pieces of at most that
// size. Stateless; thread-safe.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>

namespace spindle::kernels::cpu::internal {

inline constexpr int64_t kMaxSingleThreadGemm = 64 * 64 * 64;

// C = alpha * op(A) op(B) + beta * C, row-major, op = transpose when the flag is set.
inline void ThreadLocalGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                            float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                            float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    }
    return;
  }
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if (m * n * k <= kMaxSingleThreadGemm) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int64_t mb = std::min<int64_t>(m, 64);
  const int64_t nb = std::min<int64_t>(n, 64);
  const int64_t kb = std::max<int64_t>(1, kMaxSingleThreadGemm / (mb * nb));
  for (int64_t i0 = 0; i0 < m; i0 += mb) {
    for (int64_t j0 = 0; j0 < n; j0 += nb) {
      for (int64_t p0 = 0; p0 < k; p0 += kb) {
        const float* ap = trans_a ? a + p0 * lda + i0 : a + i0 * lda + p0;
        const float* bp = trans_b ? b + j0 * ldb + p0 : b + p0 * ldb + j0;
        cblas_sgemm(CblasRowMajor, ta, tb, std::min(mb, m - i0), std::min(nb, n - j0),
                    std::min(kb, k - p0), alpha, ap, lda, bp, ldb, p0 == 0 ? beta : 1.0f,
                    c + i0 * ldc + j0, ldc);
      }
    }
  }
}

}  // namespace spindle::kernels::cpu::internal
