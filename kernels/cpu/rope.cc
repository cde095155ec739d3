// Rotate-half (GPT-NeoX) rotary position embedding on strided [T, H, d] views, in place.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {

void RopeApply(float* x, const int32_t* pos, int64_t T, int64_t H, int64_t d, int64_t token_stride,
               int64_t head_stride, float theta, bool inverse) {
  const int64_t half = d / 2;
  // Frequencies are handled kChunk at a time so the cos/sin tables live on the stack.
  constexpr int64_t kChunk = 64;
  const double sign = inverse ? -1.0 : 1.0;
  for (int64_t j0 = 0; j0 < half; j0 += kChunk) {
    const int64_t n = std::min(kChunk, half - j0);
    double inv_freq[kChunk];
    for (int64_t i = 0; i < n; ++i) {
      inv_freq[i] = std::pow(static_cast<double>(theta),
                             -2.0 * static_cast<double>(j0 + i) / static_cast<double>(d));
    }
#pragma omp parallel for schedule(static) if (T * H * n > 8192)
    for (int64_t t = 0; t < T; ++t) {
      // Angles in double: positions reach 1e5 and more, where a float angle is off by ~1e-2.
      float c[kChunk];
      float s[kChunk];
      const double p = static_cast<double>(pos[t]);
      for (int64_t i = 0; i < n; ++i) {
        const double angle = p * inv_freq[i];
        c[i] = static_cast<float>(std::cos(angle));
        s[i] = static_cast<float>(sign * std::sin(angle));
      }
      for (int64_t h = 0; h < H; ++h) {
        float* lo = x + t * token_stride + h * head_stride + j0;
        float* hi = lo + half;
        for (int64_t i = 0; i < n; ++i) {
          const float a = lo[i];
          const float b = hi[i];
          lo[i] = a * c[i] - b * s[i];
          hi[i] = b * c[i] + a * s[i];
        }
      }
    }
  }
}

}  // namespace spindle::kernels::cpu
