// FP8 conversions on the bits of fp32 values, and tensorwise scaled quantization (see fp8.h).
#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace spindle::kernels::cpu {
namespace {

// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 32768;

struct Layout {
  int mantissa;       // mantissa bits
  int bias;           // exponent bias
  int min_exponent;   // exponent of the smallest normal: 1 - bias
  uint32_t max_code;  // code of the largest finite value (sign bit clear)
};

constexpr Layout LayoutOf(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Layout{3, 7, -6, 0x7E} : Layout{2, 15, -14, 0x7B};
}

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

}  // namespace

const char* Fp8FormatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

uint8_t FloatToFp8(float x, Fp8Format f) {
  const Layout l = LayoutOf(f);
  const uint32_t u = Bits(x);
  const uint32_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return static_cast<uint8_t>(sign | 0x7F);         // NaN
  if (a == 0x7F800000) return static_cast<uint8_t>(sign | l.max_code);  // inf saturates
  const int exponent = static_cast<int>(a >> 23) - 127;
  if (exponent >= l.min_exponent) {
    // Round the fp32 mantissa to `mantissa` bits, ties to even; a carry moves into the exponent
    // field, which is what rounding up to the next binade means.
    const int shift = 23 - l.mantissa;
    uint32_t r = a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1);
    r >>= shift;
    // r holds the fp32 biased exponent above `mantissa` bits; rebias it to the format's.
    uint32_t code = r - (static_cast<uint32_t>(127 - l.bias) << l.mantissa);
    code = std::min(code, l.max_code);  // saturate to the largest finite value
    return static_cast<uint8_t>(sign | code);
  }
  // Below the smallest normal the format's values are the multiples of 2^(min_exponent -
  // mantissa); the multiple, rounded to nearest even, is the code (2^mantissa, if it rounds up
  // that far, is the smallest normal's code). The scaling by a power of two is exact.
  const float steps = std::nearbyint(std::ldexp(FromBits(a), l.mantissa - l.min_exponent));
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(steps));
}

float Fp8ToFloat(uint8_t code, Fp8Format f) {
  const Layout l = LayoutOf(f);
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t e = (code & 0x7F) >> l.mantissa;
  const uint32_t m = code & ((1u << l.mantissa) - 1);
  const uint32_t e_max = 0x7Fu >> l.mantissa;  // all-ones exponent field
  if (f == Fp8Format::kE4M3 && e == e_max && m == ((1u << l.mantissa) - 1))
    return FromBits(sign | 0x7FC00000);  // NaN
  if (f == Fp8Format::kE5M2 && e == e_max)
    return FromBits(sign | (m == 0 ? 0x7F800000 : 0x7FC00000));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m * 2^(min_exponent - mantissa), exact in fp32
    const float v = std::ldexp(static_cast<float>(m), l.min_exponent - l.mantissa);
    return FromBits(sign | Bits(v));
  }
  const uint32_t fp32_exponent = e - static_cast<uint32_t>(l.bias) + 127;
  return FromBits(sign | (fp32_exponent << 23) | (m << (23 - l.mantissa)));
}

float RoundToFp8(float x, Fp8Format f) { return Fp8ToFloat(FloatToFp8(x, f), f); }

float AbsMax(const float* x, int64_t n) {
  float amax = 0.0f;
  int nan = 0;
#pragma omp parallel for reduction(max : amax) reduction(| : nan) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= std::isnan(a) ? 1 : 0;
    amax = std::max(amax, a);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

Fp8Scale TensorwiseScale(float amax, Fp8Format f) {
  Fp8Scale s;
  // std::max would drop a NaN amax; keep it, so that a NaN input makes a NaN scale.
  const float clamped = std::isnan(amax) ? amax : std::max(amax, 1e-12f);
  s.scale = Fp8Max(f) / clamped;
  s.inverse = 1.0f / s.scale;
  return s;
}

void QuantizeScaled(const float* x, int64_t n, float scale, Fp8Format f, float* q) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) q[i] = RoundToFp8(x[i] * scale, f);
}

Fp8Scale QuantizeTensorwise(const float* x, int64_t n, Fp8Format f, float* q) {
  const Fp8Scale s = TensorwiseScale(AbsMax(x, n), f);
  QuantizeScaled(x, n, s.scale, f, q);
  return s;
}

}  // namespace spindle::kernels::cpu
