// Rotate-half (GPT-NeoX) rotary position embedding on strided [T, H, d] views, in place.
#include <algorithm>
#include <bit>
#include <cmath>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

// Frequencies handled per pass, so the cos/sin tables live on the stack.
constexpr int64_t kChunk = 64;

// c[i] = cos(p * inv_freq[i]), s[i] = sign * sin(p * inv_freq[i]), to about 1 fp32 ulp for angles
// up to ~1e9 rad. The angle and its reduction to [-pi/4, pi/4] are fp64 (positions reach 1e5 and
// more, where a fp32 angle would be off by ~1e-2); the polynomials are fp32 (Cephes sinf/cosf).
SPINDLE_SIMD_CLONES void CosSin(double p, const double* inv_freq, float sign, float* c, float* s,
                                int64_t n) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kPio2Hi = 1.57079632673412561417e+00;  // 33 bits: k * kPio2Hi is exact
  constexpr double kPio2Lo = 6.07710050650619224932e-11;
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  const uint32_t sign_flip = sign < 0.0f ? 0x80000000u : 0u;
  for (int64_t i = 0; i < n; ++i) {
    const double a = p * inv_freq[i];
    const double shifted = a * kTwoOverPi + kRound;
    const double k = shifted - kRound;  // nearest integer to a / (pi/2)
    const uint32_t q = static_cast<uint32_t>(std::bit_cast<uint64_t>(shifted)) & 3u;
    const float r = static_cast<float>((a - k * kPio2Hi) - k * kPio2Lo);
    const float z = r * r;
    const float sin_r =
        ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
    const float cos_r =
        ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
        0.5f * z + 1.0f;
    // Quadrant q: (sin, cos) of r + q * pi/2 is (s, c), (c, -s), (-s, -c), (-c, s). Bit operations
    // rather than selects keep the loop vectorisable.
    const uint32_t swap = 0u - (q & 1u);
    const uint32_t sb = std::bit_cast<uint32_t>(sin_r);
    const uint32_t cb = std::bit_cast<uint32_t>(cos_r);
    const uint32_t sin_bits = ((sb & ~swap) | (cb & swap)) ^ ((q & 2u) << 30) ^ sign_flip;
    const uint32_t cos_bits = ((cb & ~swap) | (sb & swap)) ^ (((q + 1u) & 2u) << 30);
    s[i] = std::bit_cast<float>(sin_bits);
    c[i] = std::bit_cast<float>(cos_bits);
  }
}

// Rotates the pairs (lo[i], hi[i]) of one head by the angles whose cos/sin are c, s.
SPINDLE_SIMD_CLONES void RotatePairs(float* lo, float* hi, const float* c, const float* s,
                                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = lo[i];
    const float b = hi[i];
    lo[i] = a * c[i] - b * s[i];
    hi[i] = b * c[i] + a * s[i];
  }
}

}  // namespace

void RopeApply(float* x, const int32_t* pos, int64_t T, int64_t H, int64_t d, int64_t token_stride,
               int64_t head_stride, float theta, bool inverse) {
  const int64_t half = d / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t j0 = 0; j0 < half; j0 += kChunk) {
    const int64_t n = std::min(kChunk, half - j0);
    double inv_freq[kChunk];
    for (int64_t i = 0; i < n; ++i) {
      inv_freq[i] = std::pow(static_cast<double>(theta),
                             -2.0 * static_cast<double>(j0 + i) / static_cast<double>(d));
    }
#pragma omp parallel for schedule(static) if (T * H * n > 8192)
    for (int64_t t = 0; t < T; ++t) {
      float c[kChunk];
      float s[kChunk];
      CosSin(static_cast<double>(pos[t]), inv_freq, sign, c, s, n);
      for (int64_t h = 0; h < H; ++h) {
        float* lo = x + t * token_stride + h * head_stride + j0;
        RotatePairs(lo, lo + half, c, s, n);
      }
    }
  }
}

}  // namespace spindle::kernels::cpu
