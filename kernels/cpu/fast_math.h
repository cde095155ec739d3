// SIMD helpers private to the CPU kernels (elementwise, norm, rope and loss files): a vectorisable
// single-precision exp and sigmoid, and the attribute that compiles a hot loop for several ISAs.
#pragma once

#include <bit>
#include <cstdint>

// The library is built for the x86-64-v2 baseline (SSE4.2). Functions marked with this are also
// compiled for AVX2 (v3) and AVX-512 (v4) and the best one is picked when the program loads: the
// exp-heavy loops run 2-6x faster. Results may differ in the last bits between ISAs (FMA
// contraction), never between runs or thread counts on one machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPINDLE_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPINDLE_SIMD_CLONES
#endif

namespace spindle::kernels::cpu::internal {

// Plain arithmetic on purpose: a loop that calls FastExp auto-vectorises, which std::exp does not
// without -ffast-math.

// exp(x) to about 2 ulp. Inputs are clamped to [-87.3, 88.3], so exp(-inf) gives ~1e-38 (not 0)
// and exp(+inf) ~2e38 (not inf); NaN propagates.
inline float FastExp(float x) {
  // The clamp compares the bit patterns as integers: a float compare-and-select would keep GCC
  // (with the default -ftrapping-math) from vectorising the calling loop. NaNs, whose patterns
  // lie beyond those of the infinities, pass through unchanged.
  constexpr uint32_t kLo = std::bit_cast<uint32_t>(-87.3f);
  constexpr uint32_t kNegInf = 0xff800000u;
  constexpr uint32_t kHi = std::bit_cast<uint32_t>(88.3f);
  constexpr uint32_t kPosInf = 0x7f800000u;
  uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t below = 0u - static_cast<uint32_t>((u > kLo) & (u <= kNegInf));
  const uint32_t above = 0u - static_cast<uint32_t>((u > kHi) & (u <= kPosInf));
  u = (u & ~(below | above)) | (kLo & below) | (kHi & above);
  x = std::bit_cast<float>(u);
  // x = n * ln2 + r with |r| <= ln2 / 2; ln2 split in two (Cody-Waite) so r is exact enough.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n built in the exponent field; n is in [-126, 127] after the clamp.
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return p * scale;
}

// 1 / (1 + exp(-x)); saturates to 0 and 1 without NaN for any finite x.
inline float FastSigmoid(float x) { return 1.0f / (1.0f + FastExp(-x)); }

}  // namespace spindle::kernels::cpu::internal
