// Linear layers and plain SGEMM on OpenBLAS (row-major cblas_sgemm).
#include <cblas.h>

#include "kernels/cpu/ops.h"

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
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
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
