// Elementwise kernels: SwiGLU forward/backward, sum of squares (gradient norm) and scaling.
#include <algorithm>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using internal::FastSigmoid;

// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 32768;
// Elements handed to one SIMD call inside a parallel loop.
constexpr int64_t kSpan = 8192;

SPINDLE_SIMD_CLONES void SwiGluForwardSpan(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    y[i] = gi * FastSigmoid(gi) * u[i];
  }
}

// silu'(g) = sig * (1 + g * (1 - sig)).
SPINDLE_SIMD_CLONES void SwiGluBackwardSpan(const float* g, const float* u, const float* dy,
                                            float* dg, float* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float ui = u[i];
    const float dyi = dy[i];
    const float sig = FastSigmoid(gi);
    dg[i] = dyi * ui * sig * (1.0f + gi * (1.0f - sig));
    du[i] = dyi * gi * sig;
  }
}

}  // namespace

void SwiGluForward(const float* g, const float* u, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kSpan) {
    SwiGluForwardSpan(g + i, u + i, y + i, std::min(kSpan, n - i));
  }
}

void SwiGluBackward(const float* g, const float* u, const float* dy, float* dg, float* du,
                    int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kSpan) {
    SwiGluBackwardSpan(g + i, u + i, dy + i, dg + i, du + i, std::min(kSpan, n - i));
  }
}

double SumSquares(const float* x, int64_t n) {
  double ss = 0.0;
#pragma omp parallel for simd schedule(static) reduction(+ : ss) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return ss;
}

void Scale(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace spindle::kernels::cpu
