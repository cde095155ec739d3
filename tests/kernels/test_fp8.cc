// Tests of the software FP8 and bf16 formats (kernels/cpu/fp8.h, kernels/cpu/bf16.h): every code
// decodes to the value its format's definition gives and round-trips; rounding, ties, saturation,
// subnormals and NaN against a brute-force nearest-value reference written here (no bit tricks);
// the tensorwise quantization of fresh random tensors against the same reference (the seed is
// printed on failure; SPINDLE_TEST_SEED replays it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/fp8.h"

namespace spindle::kernels::cpu {
namespace {

uint64_t PickSeed() {
  if (const char* env = std::getenv("SPINDLE_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

struct FormatDef {
  Fp8Format format;
  int exponent_bits, mantissa_bits, bias;
  bool has_inf;  // E5M2: exponent all ones is inf/NaN; E4M3: only S.1111.111 is NaN
};
const FormatDef kFormats[] = {{Fp8Format::kE4M3, 4, 3, 7, false},
                              {Fp8Format::kE5M2, 5, 2, 15, true}};

// The value of `code` by the format's definition, in double; NaN for NaN codes, +-inf for E5M2's.
double DefinedValue(const FormatDef& d, int code) {
  const int sign = code >> 7, e = (code >> d.mantissa_bits) & ((1 << d.exponent_bits) - 1);
  const int m = code & ((1 << d.mantissa_bits) - 1);
  const int e_all = (1 << d.exponent_bits) - 1;
  double v;
  if (d.has_inf && e == e_all) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (!d.has_inf && e == e_all && m == (1 << d.mantissa_bits) - 1) {
    v = std::nan("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - d.bias - d.mantissa_bits);
  } else {
    v = (1.0 + m / std::ldexp(1.0, d.mantissa_bits)) * std::ldexp(1.0, e - d.bias);
  }
  return sign ? -v : v;
}

// The non-negative finite values with their codes, ascending.
struct Grid {
  std::vector<double> value;
  std::vector<int> code;
};
Grid FiniteGrid(const FormatDef& d) {
  Grid g;
  for (int c = 0; c < 128; ++c) {
    const double v = DefinedValue(d, c);
    if (std::isfinite(v)) g.value.push_back(v), g.code.push_back(c);
  }
  return g;
}

// Brute-force reference: the nearest finite value, ties to the even code, beyond the largest
// saturating to it; NaN -> NaN.
double ReferenceRound(const Grid& g, double x) {
  if (std::isnan(x)) return x;
  const double a = std::fabs(x);
  double r;
  if (a >= g.value.back()) {
    r = g.value.back();
  } else {
    const size_t hi = std::upper_bound(g.value.begin(), g.value.end(), a) - g.value.begin();
    const size_t lo = hi - 1;
    const double dlo = a - g.value[lo], dhi = g.value[hi] - a;
    if (dlo < dhi)
      r = g.value[lo];
    else if (dhi < dlo)
      r = g.value[hi];
    else
      r = (g.code[lo] % 2 == 0) ? g.value[lo] : g.value[hi];
  }
  return std::signbit(x) ? -r : r;
}

// Random floats spread over every binade an FP8 format reaches, and beyond.
float WideRandom(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-24, 20);
  std::bernoulli_distribution neg(0.5);
  const double v = mant(rng) * std::ldexp(1.0, expo(rng));
  return static_cast<float>(neg(rng) ? -v : v);
}

class Fp8Test : public ::testing::TestWithParam<FormatDef> {
 protected:
  Fp8Test() : seed_(PickSeed()), rng_(seed_) {}
  std::string Trace() const { return "SPINDLE_TEST_SEED=" + std::to_string(seed_); }
  uint64_t seed_;
  std::mt19937_64 rng_;
};

TEST_P(Fp8Test, EveryCodeDecodesToItsDefinedValueAndRoundTrips) {
  const FormatDef& d = GetParam();
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = DefinedValue(d, c);
    const float got = Fp8ToFloat(static_cast<uint8_t>(c), d.format);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE(std::isnan(RoundToFp8(got, d.format))) << "code " << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    if (std::isinf(want)) {  // E5M2's infinities: the conversion saturates them
      EXPECT_EQ(FloatToFp8(got, d.format), c < 128 ? 0x7B : 0xFB);
      continue;
    }
    EXPECT_EQ(FloatToFp8(got, d.format), c) << "code " << c;
  }
  EXPECT_EQ(nans, d.has_inf ? 6 : 2);
  EXPECT_EQ(Fp8ToFloat(FloatToFp8(Fp8Max(d.format), d.format), d.format), Fp8Max(d.format));
}

TEST_P(Fp8Test, TiesGoToTheEvenCode) {
  const FormatDef& d = GetParam();
  const Grid g = FiniteGrid(d);
  for (size_t i = 0; i + 1 < g.value.size(); ++i) {
    const float mid = static_cast<float>((g.value[i] + g.value[i + 1]) / 2);  // exact in fp32
    ASSERT_EQ(static_cast<double>(mid), (g.value[i] + g.value[i + 1]) / 2);
    const int even = g.code[i] % 2 == 0 ? g.code[i] : g.code[i + 1];
    EXPECT_EQ(FloatToFp8(mid, d.format), even)
        << "between codes " << g.code[i] << ", " << g.code[i + 1];
    EXPECT_EQ(FloatToFp8(-mid, d.format), 0x80 | even);
    // Just off the tie, the nearer value wins.
    EXPECT_EQ(FloatToFp8(std::nextafter(mid, 0.0f), d.format), g.code[i]);
    EXPECT_EQ(FloatToFp8(std::nextafter(mid, 1e30f), d.format), g.code[i + 1]);
  }
}

TEST_P(Fp8Test, SaturatesToTheLargestFiniteValue) {
  const FormatDef& d = GetParam();
  const uint8_t max_code = d.has_inf ? 0x7B : 0x7E;
  const float max = Fp8Max(d.format);
  ASSERT_EQ(Fp8ToFloat(max_code, d.format), max);
  for (float x : {std::nextafter(max, 1e30f), max * 1.03125f, max * 1.5f, max * 4.0f, 1e30f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToFp8(x, d.format), max_code) << x;
    EXPECT_EQ(FloatToFp8(-x, d.format), 0x80 | max_code) << x;
  }
}

TEST_P(Fp8Test, SubnormalsAndZeros) {
  const FormatDef& d = GetParam();
  const float tiny = std::ldexp(1.0f, 1 - d.bias - d.mantissa_bits);  // smallest subnormal
  EXPECT_EQ(FloatToFp8(tiny, d.format), 0x01);
  EXPECT_EQ(FloatToFp8(tiny / 2, d.format), 0x00);  // the tie between 0 and it: 0 is even
  EXPECT_EQ(FloatToFp8(std::nextafter(tiny / 2, 1.0f), d.format), 0x01);
  EXPECT_EQ(FloatToFp8(tiny * 1.5f, d.format), 0x02);  // tie between codes 1 and 2
  EXPECT_EQ(FloatToFp8(-tiny / 4, d.format), 0x80);    // -0
  EXPECT_EQ(FloatToFp8(0.0f, d.format), 0x00);
  EXPECT_EQ(FloatToFp8(-0.0f, d.format), 0x80);
  EXPECT_EQ(FloatToFp8(std::numeric_limits<float>::denorm_min(), d.format), 0x00);
  EXPECT_TRUE(std::signbit(Fp8ToFloat(0x80, d.format)));
  // The largest subnormal rounds up into the smallest normal when it should.
  const float min_normal = std::ldexp(1.0f, 1 - d.bias);
  EXPECT_EQ(FloatToFp8(min_normal, d.format), 1 << d.mantissa_bits);
  EXPECT_EQ(FloatToFp8(std::nextafter(min_normal, 0.0f), d.format), 1 << d.mantissa_bits);
}

TEST_P(Fp8Test, NanStaysNan) {
  const FormatDef& d = GetParam();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToFp8(nan, d.format), 0x7F);
  EXPECT_EQ(FloatToFp8(-nan, d.format), 0xFF);
  EXPECT_TRUE(std::isnan(RoundToFp8(nan, d.format)));
  EXPECT_TRUE(std::isnan(Fp8ToFloat(0x7F, d.format)));
  EXPECT_TRUE(std::isnan(Fp8ToFloat(0xFF, d.format)));
}

TEST_P(Fp8Test, RandomValuesMatchTheNearestValueReference) {
  const FormatDef& d = GetParam();
  const Grid g = FiniteGrid(d);
  int64_t bad = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = WideRandom(rng_);
    const double want = ReferenceRound(g, x);
    const float got = RoundToFp8(x, d.format);
    if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      if (++bad <= 5) ADD_FAILURE() << x << ": got " << got << ", want " << want << "; " << Trace();
    }
  }
  EXPECT_EQ(bad, 0) << Trace();
}

TEST_P(Fp8Test, TensorwiseQuantizeMatchesReference) {
  const FormatDef& d = GetParam();
  const Grid g = FiniteGrid(d);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> spread(-12.0, 12.0);
  for (const int64_t n : {1, 17, 37, 127, 4099, 70001}) {  // the last one runs in parallel
    const float magnitude = static_cast<float>(std::exp2(spread(rng_)));
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng_) * magnitude;
    if (n > 4) x[n / 3] = 0.0f;
    double amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
    const float want_scale = Fp8Max(d.format) / static_cast<float>(amax);
    std::vector<float> q(n);
    const Fp8Scale s = QuantizeTensorwise(x.data(), n, d.format, q.data());
    ASSERT_EQ(s.scale, want_scale) << n << "; " << Trace();
    ASSERT_EQ(s.inverse, 1.0f / want_scale);
    bool amax_on_max = false;
    for (int64_t i = 0; i < n; ++i) {
      const float scaled = x[i] * want_scale;  // fp32, as the GPU kernel computes it
      ASSERT_EQ(static_cast<double>(q[i]), ReferenceRound(g, scaled))
          << "n " << n << " i " << i << " x " << x[i] << "; " << Trace();
      amax_on_max |= std::fabs(q[i]) == Fp8Max(d.format);
    }
    EXPECT_TRUE(amax_on_max) << "the largest |x| lands on the format's largest value";
    // In place gives the same values.
    std::vector<float> y = x;
    QuantizeTensorwise(y.data(), n, d.format, y.data());
    EXPECT_EQ(y, q);
  }
}

TEST_P(Fp8Test, TensorwiseScaleOfZerosAndNans) {
  const FormatDef& d = GetParam();
  std::vector<float> zeros(40, 0.0f), q(40, 1.0f);
  const Fp8Scale s = QuantizeTensorwise(zeros.data(), 40, d.format, q.data());
  EXPECT_EQ(s.scale, Fp8Max(d.format) / 1e-12f);  // amax clamped at 1e-12
  for (float v : q) EXPECT_EQ(v, 0.0f);
  std::vector<float> x(40, 1.0f);
  x[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(AbsMax(x.data(), 40)));
  const Fp8Scale n = QuantizeTensorwise(x.data(), 40, d.format, q.data());
  EXPECT_TRUE(std::isnan(n.scale));
  EXPECT_TRUE(std::isnan(q[0]));  // a NaN anywhere poisons the tensor, as on the GPU
  EXPECT_EQ(AbsMax(x.data(), 0), 0.0f);
}

// Blockwise scaling's power of two, by brute force over the exponents: the largest 2^e in
// [-126, 126] with amax * 2^e <= max (in double: exact for these values).
double ReferencePow2Scale(double amax, double max) {
  int best = -126;
  for (int e = -126; e <= 126; ++e)
    if (amax * std::ldexp(1.0, e) <= max) best = e;
  return std::ldexp(1.0, best);
}

TEST_P(Fp8Test, Pow2ScaleIsTheLargestPowerOfTwoThatFits) {
  const FormatDef& d = GetParam();
  const double max = Fp8Max(d.format);
  std::uniform_real_distribution<double> spread(-40.0, 40.0);
  std::vector<float> amaxes = {1.0f, 0.5f, Fp8Max(d.format), Fp8Max(d.format) * 0.5f,
                               std::nextafter(Fp8Max(d.format), 0.0f),
                               std::nextafter(Fp8Max(d.format), 1e30f), 3.0f, 1e-30f, 1e30f};
  for (int i = 0; i < 200; ++i) amaxes.push_back(static_cast<float>(std::exp2(spread(rng_))));
  for (const float a : amaxes) {
    const Fp8Scale s = Pow2Scale(a, d.format);
    ASSERT_EQ(static_cast<double>(s.scale), ReferencePow2Scale(a, max)) << a << "; " << Trace();
    ASSERT_EQ(static_cast<double>(s.inverse), 1.0 / ReferencePow2Scale(a, max)) << a;
  }
  EXPECT_EQ(Pow2Scale(0.0f, d.format).scale, std::ldexp(1.0f, 126));
  EXPECT_TRUE(std::isnan(Pow2Scale(std::numeric_limits<float>::quiet_NaN(), d.format).scale));
}

// The three block shapes on odd sizes (partial blocks at both edges), against a reference that
// finds each element's block by its indices: every value is RoundToFp8(x * s) / s with s the
// block's Pow2Scale, so at most max / s in magnitude and exact in fp32.
TEST_P(Fp8Test, BlockwiseQuantizeMatchesReference) {
  const FormatDef& d = GetParam();
  const Grid g = FiniteGrid(d);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> spread(-10.0, 10.0);
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 131}, {131, 3}, {259, 133}, {128, 256}}) {
    std::vector<float> x(rows * cols);
    // Each row its own magnitude, so that row blocks, column blocks and squares differ.
    for (int64_t r = 0; r < rows; ++r) {
      const float m = static_cast<float>(std::exp2(spread(rng_)));
      for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = normal(rng_) * m;
    }
    x[rows * cols / 2] = 0.0f;
    struct Shape {
      const char* name;
      int64_t block_rows, block_cols;
      void (*run)(const float*, int64_t, int64_t, Fp8Format, float*);
    };
    for (const Shape& sh : {Shape{"rows", 1, kFp8Block, QuantizeRowBlocks},
                            Shape{"columns", kFp8Block, 1, QuantizeColumnBlocks},
                            Shape{"squares", kFp8Block, kFp8Block, QuantizeSquareBlocks}}) {
      SCOPED_TRACE(std::string(sh.name) + " " + std::to_string(rows) + " x " +
                   std::to_string(cols) + "; " + Trace());
      std::vector<float> out(rows * cols, -1.0f);
      sh.run(x.data(), rows, cols, d.format, out.data());
      // Each block's amax, by the block's indices.
      const int64_t bc = (cols + sh.block_cols - 1) / sh.block_cols;
      std::vector<double> amax(((rows + sh.block_rows - 1) / sh.block_rows) * bc, 0.0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          double& a = amax[r / sh.block_rows * bc + c / sh.block_cols];
          a = std::max(a, std::fabs(static_cast<double>(x[r * cols + c])));
        }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const double scale = ReferencePow2Scale(amax[r / sh.block_rows * bc + c / sh.block_cols],
                                                  Fp8Max(d.format));
          const double want =
              ReferenceRound(g, static_cast<float>(x[r * cols + c] * scale)) / scale;
          ASSERT_EQ(static_cast<double>(out[r * cols + c]), want) << r << ", " << c;
        }
      }
    }
  }
}

// One outlier flattens its block's values only: a value past the format's range of the others
// (1e5 x for E4M3, whose range is 2^18; 1e11 x for E5M2's 2^32) in one row leaves every other
// row's 1 x 128 blocks as fine as before, where the tensorwise scale pushes their values into the
// subnormals. Relative error of the rows without the outlier, blockwise against tensorwise.
TEST_P(Fp8Test, AnOutlierCostsBlockwiseItsBlockOnly) {
  const FormatDef& d = GetParam();
  const int64_t rows = 64, cols = 256;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = normal(rng_);
  x[5 * cols + 17] = d.mantissa_bits == 3 ? 1e5f : 1e11f;
  std::vector<float> tensorwise(rows * cols), blockwise(rows * cols);
  const Fp8Scale s = QuantizeTensorwise(x.data(), rows * cols, d.format, tensorwise.data());
  for (float& v : tensorwise) v *= s.inverse;
  QuantizeRowBlocks(x.data(), rows, cols, d.format, blockwise.data());
  auto error = [&](const std::vector<float>& q) {
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (r == 5) continue;
      for (int64_t c = 0; c < cols; ++c) {
        const double e = static_cast<double>(q[r * cols + c]) - x[r * cols + c];
        num += e * e;
        den += static_cast<double>(x[r * cols + c]) * x[r * cols + c];
      }
    }
    return std::sqrt(num / den);
  };
  const double eb = error(blockwise), et = error(tensorwise);
  // FP8's own rounding: about 2^-(mantissa + 1) relative (4% E4M3, 8% E5M2 at most per value).
  EXPECT_LT(eb, d.mantissa_bits == 3 ? 0.05 : 0.1) << Trace();
  EXPECT_GT(et, 4 * eb) << "tensorwise " << et << " blockwise " << eb << "; " << Trace();
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Test, ::testing::ValuesIn(kFormats), [](const auto& info) {
  return std::string(Fp8FormatName(info.param.format));
});

// bf16: the nearest of the two bf16 neighbours (truncation and one step up), ties to even.
double ReferenceBf16(float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t lo_bits = u & 0xFFFF0000u, hi_bits = lo_bits + 0x10000u;
  float lo, hi;
  std::memcpy(&lo, &lo_bits, 4);
  std::memcpy(&hi, &hi_bits, 4);  // inf past the largest bf16
  // Past the largest bf16 the next step up would be 2^128: the distance is to that.
  const double hi_value = std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), x) : hi;
  const double dlo = std::fabs(static_cast<double>(x) - lo);
  const double dhi = std::fabs(hi_value - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo_bits & 0x10000u) == 0 ? lo : hi;
}

TEST(Bf16Test, RoundingMatchesTheNearestValueReference) {
  const uint64_t seed = PickSeed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> bits;
  int64_t bad = 0;
  std::vector<float> xs;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(rng);
    if (i % 4 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  // exact ties
    float x;
    std::memcpy(&x, &u, 4);
    xs.push_back(x);
  }
  xs.push_back(std::numeric_limits<float>::max());
  xs.push_back(std::numeric_limits<float>::infinity());
  for (float x : xs) {
    const float got = RoundToBf16(x);
    const double want = ReferenceBf16(x);
    const bool same = std::isnan(want) ? std::isnan(got) : static_cast<double>(got) == want;
    if (!same && ++bad <= 5) ADD_FAILURE() << x << ": got " << got << ", want " << want;
  }
  EXPECT_EQ(bad, 0) << "SPINDLE_TEST_SEED=" << seed;
  std::vector<float> buf(xs.begin(), xs.begin() + 50000);
  RoundToBf16(buf.data(), static_cast<int64_t>(buf.size()));
  for (size_t i = 0; i < buf.size(); ++i) {
    if (std::isnan(xs[i])) continue;
    ASSERT_EQ(buf[i], RoundToBf16(xs[i]));
  }
}

}  // namespace
}  // namespace spindle::kernels::cpu
