// Elementwise kernels: SwiGLU forward/backward, sum of squares (gradient norm) and scaling.
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using internal::FastSigmoid;

// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 32768;

}  // namespace

void SwiGluForward(const float* g, const float* u, float* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    y[i] = gi * FastSigmoid(gi) * u[i];
  }
}

void SwiGluBackward(const float* g, const float* u, const float* dy, float* dg, float* du,
                    int64_t n) {
  // silu'(g) = sig * (1 + g * (1 - sig)).
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float ui = u[i];
    const float dyi = dy[i];
    const float sig = FastSigmoid(gi);
    dg[i] = dyi * ui * sig * (1.0f + gi * (1.0f - sig));
    du[i] = dyi * gi * sig;
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
