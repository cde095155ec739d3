// Linear layers and plain SGEMM on OpenBLAS (row-major cblas_sgemm), parallelised with OpenMP
// slices so that one thread pool serves every CPU kernel.
#include <omp.h>

#include <algorithm>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_local_gemm.h"

namespace spindle::kernels::cpu {

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    // Nothing to multiply: C = beta * C (beta == 0 clears C even if it held NaN).
    for (int64_t i = 0; i < M; ++i) {
      float* row = C + i * ldc;
      for (int64_t j = 0; j < N; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  // One thread pool: OpenMP threads each take a slice of the larger output dimension and run it
  // on the calling thread (OpenBLAS's own pool would otherwise compete with OpenMP's for the
  // same cores between kernels).
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads == 1 || M * N * K <= 4 * internal::kMaxSingleThreadGemm) {
    internal::ThreadLocalGemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const bool split_m = M >= N;
  const int64_t extent = split_m ? M : N;
  const int64_t slice = ((extent + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < extent; b0 += slice) {
    const int64_t len = std::min(slice, extent - b0);
    if (split_m) {
      const float* a = trans_a ? A + b0 : A + b0 * lda;
      internal::ThreadLocalGemm(trans_a, trans_b, len, N, K, alpha, a, lda, B, ldb, beta,
                                C + b0 * ldc, ldc);
    } else {
      const float* b = trans_b ? B + b0 * ldb : B + b0;
      internal::ThreadLocalGemm(trans_a, trans_b, M, len, K, alpha, A, lda, b, ldb, beta, C + b0,
                                ldc);
    }
  }
}

void LinearForward(const float* x, const float* W, float* y, int64_t T, int64_t in, int64_t out) {
  Gemm(false, true, T, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
}

void LinearBackward(const float* x, const float* W, const float* dy, float* dx, float* dW,
                    int64_t T, int64_t in, int64_t out) {
  if (dx != nullptr) Gemm(false, false, T, in, out, 1.0f, dy, out, W, in, 0.0f, dx, in);
  Gemm(true, false, out, in, T, 1.0f, dy, out, x, in, 1.0f, dW, in);
}

}  // namespace spindle::kernels::cpu
