// Optimizer steps on one flat fp32 parameter buffer: AdamW (decoupled weight decay) and SGD.
#include <cmath>

#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 32768;

}  // namespace

void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp) {
  // Same arithmetic as torch.optim.AdamW (foreach=False): p *= 1 - lr * wd, then
  // p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
  const double step = static_cast<double>(hp.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(hp.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(hp.beta2), step);
  const float step_size = static_cast<float>(hp.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = 1.0f - hp.lr * hp.weight_decay;
  const float b1 = hp.beta1;
  const float b2 = hp.beta2;
  const float eps = hp.eps;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
    p[i] = p[i] * decay - step_size * mi / denom;
  }
}

void SgdStep(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
             float weight_decay) {
  if (momentum == 0.0f || buf == nullptr) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + weight_decay * p[i]);
    return;
  }
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float b = momentum * buf[i] + (g[i] + weight_decay * p[i]);
    buf[i] = b;
    p[i] -= lr * b;
  }
}

}  // namespace spindle::kernels::cpu
