// FP8 conversions on the bits of fp32 values, and tensorwise and blockwise scaled quantization
// (see fp8.h).
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

const char* Fp8ScalingName(Fp8Scaling s) {
  return s == Fp8Scaling::kBlockwise ? "blockwise" : "tensorwise";
}

Fp8Scale Pow2Scale(float amax, Fp8Format f) {
  if (std::isnan(amax)) return {amax, amax};
  int e = 126;
  if (amax > 0.0f) {
    // amax * 2^e <= max: e = floor(log2(max / amax)), found exactly with frexp (max / amax
    // rounded could cross a power of two).
    int ea = 0, em = 0;
    const float ma = std::frexp(amax, &ea), mm = std::frexp(Fp8Max(f), &em);
    e = std::clamp(em - ea - (ma > mm ? 1 : 0), -126, 126);
  }
  return {std::ldexp(1.0f, e), std::ldexp(1.0f, -e)};
}

namespace {

// out[i] for the values of one block (its amax known): the block-scaled FP8 value.
inline float BlockValue(float x, const Fp8Scale& s, Fp8Format f) {
  return RoundToFp8(x * s.scale, f) * s.inverse;
}

}  // namespace

void QuantizeRowBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
      const int64_t n = std::min(kFp8Block, cols - c0);
      const float* in = x + r * cols + c0;
      const Fp8Scale s = Pow2Scale(AbsMax(in, n), f);
      for (int64_t j = 0; j < n; ++j) out[r * cols + c0 + j] = BlockValue(in[j], s, f);
    }
  }
}

void QuantizeColumnBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r0 = 0; r0 < rows; r0 += kFp8Block) {
      const int64_t n = std::min(kFp8Block, rows - r0);
      float amax = 0.0f;
      bool nan = false;
      for (int64_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[(r0 + i) * cols + c]);
        nan |= std::isnan(a);
        amax = std::max(amax, a);
      }
      const Fp8Scale s = Pow2Scale(nan ? std::numeric_limits<float>::quiet_NaN() : amax, f);
      for (int64_t i = 0; i < n; ++i)
        out[(r0 + i) * cols + c] = BlockValue(x[(r0 + i) * cols + c], s, f);
    }
  }
}

void QuantizeSquareBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out) {
  const int64_t row_blocks = (rows + kFp8Block - 1) / kFp8Block;
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t b = 0; b < row_blocks * col_blocks; ++b) {
    const int64_t r0 = (b / col_blocks) * kFp8Block, c0 = (b % col_blocks) * kFp8Block;
    const int64_t nr = std::min(kFp8Block, rows - r0), nc = std::min(kFp8Block, cols - c0);
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < nr; ++i) {
      const float a = AbsMax(x + (r0 + i) * cols + c0, nc);
      nan |= std::isnan(a);
      amax = std::max(amax, a);
    }
    const Fp8Scale s = Pow2Scale(nan ? std::numeric_limits<float>::quiet_NaN() : amax, f);
    for (int64_t i = 0; i < nr; ++i)
      for (int64_t j = 0; j < nc; ++j)
        out[(r0 + i) * cols + c0 + j] = BlockValue(x[(r0 + i) * cols + c0 + j], s, f);
  }
}

}  // namespace spindle::kernels::cpu
