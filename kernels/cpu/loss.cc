// Cross-entropy (with the optional z-loss) over rows of logits with its gradient fused in (in
// place when asked).
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using internal::FastExp;

// Loss of one valid row: returns its cross-entropy and writes its logsumexp to *lse. When dx is
// non-null (it may alias x) it receives grad_scale * (softmax(x) (1 + 2 z_loss lse) - onehot).
SPINDLE_SIMD_CLONES double CrossEntropyRow(const float* x, float* dx, int64_t V, int32_t target,
                                           float grad_scale, float z_loss, double* lse) {
  // Max first (stability). NaN logits are skipped here but reach the sum below.
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; ++j) mx = x[j] > mx ? x[j] : mx;
  // Read before dx (which may alias x) is written.
  const float x_target = x[target];
  double sum = 0.0;
  if (dx != nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < V; ++j) {
      const float e = FastExp(x[j] - mx);
      dx[j] = e;
      sum += static_cast<double>(e);
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < V; ++j) sum += static_cast<double>(FastExp(x[j] - mx));
  }
  *lse = std::log(sum) + static_cast<double>(mx);
  if (dx != nullptr) {
    // d/dx_j (lse - x_target + z lse^2) = softmax_j (1 + 2 z lse) - onehot_j.
    const double g = static_cast<double>(grad_scale);
    const float k = static_cast<float>(
        z_loss > 0.0f ? g * (1.0 + 2.0 * static_cast<double>(z_loss) * *lse) / sum : g / sum);
    for (int64_t j = 0; j < V; ++j) dx[j] *= k;
    dx[target] -= grad_scale;
  }
  return *lse - static_cast<double>(x_target);
}

}  // namespace

double CrossEntropy(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                    float grad_scale, float* dlogits, int64_t* n_valid, float z_loss,
                    double* lse_squared) {
  double loss = 0.0, z = 0.0;
  int64_t count = 0;
#pragma omp parallel for schedule(static) reduction(+ : loss, z, count) if (T * V > 16384)
  for (int64_t t = 0; t < T; ++t) {
    float* dx = dlogits != nullptr ? dlogits + t * V : nullptr;
    if (targets[t] < 0) {
      if (dx != nullptr) std::memset(dx, 0, V * sizeof(float));
      continue;
    }
    double lse = 0.0;
    loss += CrossEntropyRow(logits + t * V, dx, V, targets[t], grad_scale, z_loss, &lse);
    z += lse * lse;
    ++count;
  }
  if (n_valid != nullptr) *n_valid += count;
  if (lse_squared != nullptr) *lse_squared += z;
  return loss;
}

}  // namespace spindle::kernels::cpu
