// The FP8 kernels (kernels/cuda/fp8.h) against the CPU emulation (kernels/cpu/fp8.h), and the FP8
// GEMMs (GemmArgs with FP8 operands) against fp32 products, on odd shapes and fresh random inputs
// with a wide dynamic range (FP8 subnormals and underflow to zero among them).
//
// What is exact and what is not:
//  - Quantizing a stored tensor (Fp8Quantize, Fp8QuantizeFromAmax, Fp8CastWeights): amax, scale,
//    inverse scale and every code bit for bit equal to cpu::AbsMax / TensorwiseScale / FloatToFp8,
//    the transposed codes the exact transpose; ties to even, saturation and NaN included.
//  - The fused producers recompute their fp32 results in the same order as the CPU but with the
//    GPU's rsqrtf and __expf (a few ulps from the CPU's 1 / sqrt and exp): their codes are within
//    one FP8 step of the emulation's (cpu::RmsNormForward etc. then QuantizeTensorwise), nearly
//    all of them equal, and their amax within 1e-5 relative. Given the GPU's own rstd, the RMSNorm
//    results are plain fp32 products and its codes and amax are bit-exact.
//  - FP8 GEMMs: within bf16 rounding (and fp32 accumulation order) of the fp32 product of the
//    dequantized codes and of a bf16 GEMM on the dequantized inputs, and within the recipe's
//    quantization error of the fp32 product of the unquantized inputs (relative L2 error 0.06
//    for E4M3 x E4M3, 0.10 with E5M2 gradients; about 0.04 and 0.065 are expected).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/fp8_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::CpuFormat;
using testing::DeviceBuffer;
using testing::Download;
using testing::DownloadBytes;
using testing::ExpectClose;
using testing::Normal;
using testing::RoundTo;
using testing::Upload;
using testing::UploadRaw;

float DownloadScalar(const float* p) {
  float v = 0.0f;
  cudaDeviceSynchronize();
  cudaMemcpy(&v, p, sizeof(v), cudaMemcpyDeviceToHost);
  return v;
}

// The device side of one FP8 output: codes, transposed codes and the three scalars.
class Fp8Buffers {
 public:
  Fp8Buffers(int64_t n, DType format, bool codes = true, bool codes_t = true)
      : n_(n), codes_(n + 16), codes_t_(n + 16), scalars_(12 * sizeof(float)) {
    // Fill with a byte no test expects, so that an unwritten code shows.
    cudaMemset(codes_.get(), 0x5A, n + 16);
    cudaMemset(codes_t_.get(), 0x5A, n + 16);
    cudaMemset(scalars_.get(), 0xFF, 12 * sizeof(float));
    out_.format = format;
    out_.codes = codes ? codes_.get() : nullptr;
    out_.codes_t = codes_t ? codes_t_.get() : nullptr;
    out_.amax = scalars_.as<float>();
    out_.scale = scalars_.as<float>() + 4;
    out_.inverse_scale = scalars_.as<float>() + 8;
  }
  const Fp8Output& out() const { return out_; }
  std::vector<uint8_t> codes() const { return DownloadBytes(codes_.get(), n_); }
  std::vector<uint8_t> codes_t() const { return DownloadBytes(codes_t_.get(), n_); }
  float amax() const { return DownloadScalar(out_.amax); }
  float scale() const { return DownloadScalar(out_.scale); }
  float inverse() const { return DownloadScalar(out_.inverse_scale); }
  void SetAmax(float a) const { cudaMemcpy(out_.amax, &a, sizeof(a), cudaMemcpyHostToDevice); }
  Fp8Operand operand(bool transposed) const {
    return {transposed ? codes_t_.get() : codes_.get(), out_.format, out_.inverse_scale};
  }

 private:
  int64_t n_;
  DeviceBuffer codes_, codes_t_, scalars_;
  Fp8Output out_;
};

// The CPU emulation's tensorwise quantization of v, codes as bytes; `amax` overrides the tensor's.
struct HostQuant {
  float amax;
  cpu::Fp8Scale scale;
  std::vector<uint8_t> codes;
};
HostQuant QuantizeOnHost(const std::vector<float>& v, DType format, const float* amax = nullptr) {
  HostQuant q;
  q.amax = amax != nullptr ? *amax : cpu::AbsMax(v.data(), static_cast<int64_t>(v.size()));
  q.scale = cpu::TensorwiseScale(q.amax, CpuFormat(format));
  q.codes.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    q.codes[i] = cpu::FloatToFp8(v[i] * q.scale.scale, CpuFormat(format));
  }
  return q;
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(a)) == 0;
}

void ExpectSameFloat(float got, float want, const std::string& what) {
  EXPECT_TRUE(SameFloat(got, want)) << what << ": got " << got << ", want " << want;
}

// Codes equal bit for bit (NaN codes equal as NaN, whatever their sign).
void ExpectSameCodes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                     DType format, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = cpu::Fp8ToFloat(got[i], CpuFormat(format));
    const float w = cpu::Fp8ToFloat(want[i], CpuFormat(format));
    if (got[i] == want[i] || (std::isnan(g) && std::isnan(w))) continue;
    if (++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: code 0x" << std::hex << int{got[i]} << " (" << g
                    << "), want 0x" << int{want[i]} << std::dec << " (" << w << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " codes differ";
}

// The code's position on the number line: codes one FP8 step apart differ by 1.
int Ordinal(uint8_t c) { return (c & 0x80) ? -(c & 0x7F) : (c & 0x7F); }

// Every code within one FP8 step of the reference, and at least `min_equal` of them equal.
void ExpectWithinOneStep(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                         double min_equal, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t far = 0, differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = std::abs(Ordinal(got[i]) - Ordinal(want[i]));
    differ += d != 0;
    if (d > 1 && ++far <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: code 0x" << std::hex << int{got[i]} << ", want 0x"
                    << int{want[i]} << std::dec;
    }
  }
  EXPECT_EQ(far, 0) << what << ": " << far << " codes more than one step off";
  EXPECT_LE(static_cast<double>(differ), (1.0 - min_equal) * static_cast<double>(got.size()))
      << what << ": " << differ << " of " << got.size() << " codes one step off";
}

void ExpectTransposed(const std::vector<uint8_t>& codes_t, const std::vector<uint8_t>& codes,
                      int64_t rows, int64_t cols, const std::string& what) {
  std::vector<uint8_t> want(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) want[c * rows + r] = codes[r * cols + c];
  }
  EXPECT_TRUE(codes_t == want) << what << ": the transposed codes are not the codes' transpose";
}

std::vector<float> Decode(const std::vector<uint8_t>& codes, DType format) {
  std::vector<float> v(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) v[i] = cpu::Fp8ToFloat(codes[i], CpuFormat(format));
  return v;
}

// ||got - want|| / ||want|| over the tensor.
double RelativeL2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

constexpr DType kE4M3 = DType::kFp8E4M3;
constexpr DType kE5M2 = DType::kFp8E5M2;

struct Shape {
  int64_t rows, cols;
};

class Fp8Cuda : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { SPINDLE_REQUIRE_GPU(); }
  DType dt() const { return GetParam(); }
  // Values over 20 binades (sign random, a few exact zeros), stored as dt(): the codes cover the
  // normals, the subnormals and underflow to zero.
  std::vector<float> Wide(int64_t n) {
    std::uniform_real_distribution<float> e(-18.0f, 2.0f), m(1.0f, 2.0f);
    std::vector<float> x(n);
    for (float& v : x) {
      const uint32_t r = rng_();
      v = r % 97 == 0 ? 0.0f : std::ldexp(m(rng_), static_cast<int>(e(rng_))) * (r & 1 ? -1 : 1);
    }
    RoundTo(dt(), x);
    return x;
  }
  std::vector<float> Rand(int64_t n, float sd = 1.0f, float mean = 0.0f) {
    auto x = Normal(rng_, n, sd, mean);
    RoundTo(dt(), x);
    return x;
  }
  std::mt19937 rng_{testing::FreshSeed()};
};

TEST_P(Fp8Cuda, QuantizeMatchesCpuBitForBit) {
  for (DType f : {kE4M3, kE5M2}) {
    // Both vector paths (rows and cols multiples of 8), the row-major one alone (rows not), and
    // the scalar one (cols not).
    for (const Shape s : {Shape{37, 72}, Shape{1000, 200}, Shape{5, 1376}, Shape{1, 1},
                          Shape{64, 64}, Shape{130, 33}, Shape{136, 264}, Shape{24, 1376}}) {
      SCOPED_TRACE(std::string(DTypeName(f)) + " " + std::to_string(s.rows) + " x " +
                   std::to_string(s.cols));
      const int64_t n = s.rows * s.cols;
      const auto x = Wide(n);
      const auto d_x = Upload(x, dt());
      const HostQuant want = QuantizeOnHost(x, f);
      Fp8Buffers q(n, f);
      ASSERT_OK(Fp8Quantize(d_x.get(), s.rows, s.cols, dt(), q.out(), 0));
      ExpectSameFloat(q.amax(), want.amax, "amax");
      ExpectSameFloat(q.scale(), want.scale.scale, "scale");
      ExpectSameFloat(q.inverse(), want.scale.inverse, "inverse scale");
      const auto codes = q.codes();
      ExpectSameCodes(codes, want.codes, f, "codes");
      ExpectTransposed(q.codes_t(), codes, s.rows, s.cols, "codes_t");
      // Each layout alone.
      Fp8Buffers only_t(n, f, false, true), only_codes(n, f, true, false);
      ASSERT_OK(Fp8Quantize(d_x.get(), s.rows, s.cols, dt(), only_t.out(), 0));
      ASSERT_OK(Fp8Quantize(d_x.get(), s.rows, s.cols, dt(), only_codes.out(), 0));
      ExpectTransposed(only_t.codes_t(), codes, s.rows, s.cols, "codes_t alone");
      ExpectSameCodes(only_codes.codes(), codes, f, "codes alone");
    }
    // An input that is not 16-byte aligned takes the scalar path: the same codes.
    const int64_t rows = 16, cols = 64, n = rows * cols;
    const auto x = Wide(n + 1);
    const auto d_x = Upload(x, dt());
    const HostQuant want = QuantizeOnHost(std::vector<float>(x.begin() + 1, x.end()), f);
    Fp8Buffers q(n, f);
    const size_t elem = dt() == DType::kFloat32 ? sizeof(float) : sizeof(uint16_t);
    ASSERT_OK(
        Fp8Quantize(static_cast<const char*>(d_x.get()) + elem, rows, cols, dt(), q.out(), 0));
    ExpectSameCodes(q.codes(), want.codes, f, "codes of a misaligned input");
    ExpectTransposed(q.codes_t(), want.codes, rows, cols, "codes_t of a misaligned input");
  }
}

// With the scale 1 (amax = the format's largest value), every midpoint between two neighbouring
// codes rounds to the even one, subnormals included; an amax below the tensor's saturates the
// values beyond it (and an infinity) to the largest code; NaN makes NaN codes and scales; an
// all-zero tensor takes the scale of amax 1e-12 and zero codes.
TEST_P(Fp8Cuda, QuantizeTiesSaturationAndSpecials) {
  for (DType f : {kE4M3, kE5M2}) {
    SCOPED_TRACE(DTypeName(f));
    const cpu::Fp8Format cf = CpuFormat(f);
    std::vector<float> x = {Fp8MaxOf(f)};
    const uint8_t max_code = cpu::FloatToFp8(Fp8MaxOf(f), cf);
    for (uint8_t c = 0; c < max_code; ++c) {
      const float mid = 0.5f * (cpu::Fp8ToFloat(c, cf) + cpu::Fp8ToFloat(c + 1, cf));
      x.push_back(mid);
      x.push_back(-mid);
    }
    RoundTo(dt(), x);  // the midpoints hold at most 5 significant bits: exact in bf16
    const int64_t n = static_cast<int64_t>(x.size());
    auto d_x = Upload(x, dt());
    const HostQuant want = QuantizeOnHost(x, f);
    EXPECT_EQ(want.scale.scale, 1.0f);
    Fp8Buffers q(n, f);
    ASSERT_OK(Fp8Quantize(d_x.get(), 1, n, dt(), q.out(), 0));
    ExpectSameCodes(q.codes(), want.codes, f, "midpoints");
    for (size_t i = 1; i < x.size(); ++i) {  // each midpoint went to the even neighbour
      EXPECT_EQ(want.codes[i] & 1, 0) << "midpoint " << x[i];
    }

    // Saturation: an amax of a quarter of the tensor's, and infinities.
    auto y = Wide(37 * 72);
    y[5] = std::numeric_limits<float>::infinity();
    y[6] = -std::numeric_limits<float>::infinity();
    const float amax = 0.25f * cpu::AbsMax(y.data() + 7, static_cast<int64_t>(y.size()) - 7);
    auto d_y = Upload(y, dt());
    Fp8Buffers s(y.size(), f);
    s.SetAmax(amax);
    ASSERT_OK(Fp8QuantizeFromAmax(d_y.get(), 37, 72, dt(), s.out(), 0));
    const HostQuant sat = QuantizeOnHost(y, f, &amax);
    const auto sat_codes = s.codes();
    ExpectSameCodes(sat_codes, sat.codes, f, "saturated");
    ExpectSameFloat(s.inverse(), sat.scale.inverse, "inverse scale from the given amax");
    EXPECT_EQ(sat_codes[5], max_code);
    EXPECT_EQ(sat_codes[6], max_code | 0x80);
    int saturated = 0;
    for (uint8_t c : sat_codes) saturated += (c & 0x7F) == max_code;
    EXPECT_GT(saturated, 2);

    // NaN.
    auto z = Wide(130);
    z[17] = std::numeric_limits<float>::quiet_NaN();
    auto d_z = Upload(z, dt());
    Fp8Buffers nq(z.size(), f);
    ASSERT_OK(Fp8Quantize(d_z.get(), 10, 13, dt(), nq.out(), 0));
    EXPECT_TRUE(std::isnan(nq.amax()));
    EXPECT_TRUE(std::isnan(nq.scale()));
    EXPECT_TRUE(std::isnan(nq.inverse()));
    for (float v : Decode(nq.codes(), f)) EXPECT_TRUE(std::isnan(v));

    // All zeros, and an empty tensor.
    std::vector<float> zeros(200, 0.0f);
    auto d_zeros = Upload(zeros, dt());
    Fp8Buffers zq(zeros.size(), f);
    ASSERT_OK(Fp8Quantize(d_zeros.get(), 2, 100, dt(), zq.out(), 0));
    const cpu::Fp8Scale zs = cpu::TensorwiseScale(0.0f, cf);
    ExpectSameFloat(zq.amax(), 0.0f, "amax of zeros");
    ExpectSameFloat(zq.scale(), zs.scale, "scale of zeros");
    ExpectSameFloat(zq.inverse(), zs.inverse, "inverse scale of zeros");
    ExpectSameCodes(zq.codes(), std::vector<uint8_t>(200, 0), f, "zeros");
    Fp8Buffers eq(0, f);
    ASSERT_OK(Fp8Quantize(d_zeros.get(), 0, 100, dt(), eq.out(), 0));
    ExpectSameFloat(eq.amax(), 0.0f, "amax of nothing");
    ExpectSameFloat(eq.inverse(), zs.inverse, "inverse scale of nothing");
  }
}

TEST_P(Fp8Cuda, AbsMaxMatchesCpu) {
  for (int64_t n : {int64_t{1}, int64_t{4095}, int64_t{4097}, int64_t{1000 * 1376}}) {
    auto x = Wide(n);
    auto d_x = Upload(x, dt());
    DeviceBuffer amax(sizeof(float));
    ASSERT_OK(Fp8AbsMax(d_x.get(), n, dt(), amax.as<float>(), 0));
    ExpectSameFloat(DownloadScalar(amax.as<float>()), cpu::AbsMax(x.data(), n),
                    "amax of " + std::to_string(n));
  }
}

// The weights' cast: 40 fp32 masters (two launches of up to 32), odd shapes, one empty.
TEST_P(Fp8Cuda, CastWeightsMatchesCpuPerTensor) {
  if (dt() != DType::kFloat32) GTEST_SKIP() << "masters are fp32";
  std::vector<Shape> shapes;
  for (int i = 0; i < 40; ++i) shapes.push_back({1 + (i * 37) % 211, 1 + (i * 53) % 300});
  shapes[3] = {0, 72};
  shapes[7] = {1376, 200};
  std::vector<std::vector<float>> masters;
  std::vector<DeviceBuffer> d_masters;
  std::vector<std::unique_ptr<Fp8Buffers>> outs;
  std::vector<Fp8WeightCast> table;
  for (const Shape& s : shapes) {
    masters.push_back(Wide(s.rows * s.cols));
    for (float& v : masters.back()) v *= 1e-2f;
    d_masters.push_back(Upload(masters.back(), DType::kFloat32));
    outs.push_back(std::make_unique<Fp8Buffers>(s.rows * s.cols, kE4M3));
    table.push_back({d_masters.back().as<float>(), s.rows, s.cols, outs.back()->out()});
  }
  ASSERT_OK(Fp8CastWeights(table.data(), static_cast<int64_t>(table.size()), 0));
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    const HostQuant want = QuantizeOnHost(masters[i], kE4M3);
    ExpectSameFloat(outs[i]->amax(), want.amax, "amax");
    ExpectSameFloat(outs[i]->scale(), want.scale.scale, "scale");
    ExpectSameFloat(outs[i]->inverse(), want.scale.inverse, "inverse scale");
    const auto codes = outs[i]->codes();
    ExpectSameCodes(codes, want.codes, kE4M3, "codes");
    ExpectTransposed(outs[i]->codes_t(), codes, shapes[i].rows, shapes[i].cols, "codes_t");
  }
}

TEST_P(Fp8Cuda, RmsNormFp8MatchesEmulation) {
  for (bool residual : {false, true}) {
    for (bool with_y : {false, true}) {
      // Rows of 256 k values (k <= 8) take the vector path in bf16.
      for (const Shape s :
           {Shape{37, 72}, Shape{1000, 200}, Shape{5, 1376}, Shape{37, 2048}, Shape{9, 768}}) {
        SCOPED_TRACE(std::string(residual ? "residual " : "") + (with_y ? "y " : "") +
                     std::to_string(s.rows) + " x " + std::to_string(s.cols));
        const int64_t R = s.rows, D = s.cols, n = R * D;
        const float eps = 1e-6f;
        auto x = Rand(n), res = Rand(n), w = Rand(D, 0.3f, 1.0f);
        w[D / 2] = 1e-3f;  // a column of tiny values: subnormal codes
        RoundTo(dt(), w);
        auto d_x = Upload(x, dt()), d_res = Upload(res, dt()), d_w = Upload(w, dt());
        DeviceBuffer d_h(n * 4 + 16), d_y(n * 4 + 16), d_rstd(R * 4 + 16);
        Fp8Buffers q(n, kE4M3);
        std::vector<uint8_t> first_codes;
        float first_amax = 0.0f;
        for (int run = 0; run < 2; ++run) {  // twice: the same bits
          if (residual) {
            ASSERT_OK(RmsNormResidualForwardFp8(d_x.get(), d_res.get(), d_h.get(), d_w.get(),
                                                with_y ? d_y.get() : nullptr, d_rstd.as<float>(), R,
                                                D, eps, dt(), q.out(), 0));
          } else {
            ASSERT_OK(RmsNormForwardFp8(d_x.get(), d_w.get(), with_y ? d_y.get() : nullptr,
                                        d_rstd.as<float>(), R, D, eps, dt(), q.out(), 0));
          }
          if (run == 0) {
            first_codes = q.codes();
            first_amax = q.amax();
          }
        }
        EXPECT_TRUE(first_codes == q.codes()) << "codes moved between two identical runs";
        ExpectSameFloat(q.amax(), first_amax, "amax of the second run");
        // The emulation: h = x + res stored, then RMSNorm and quantization of its fp32 result.
        std::vector<float> h = x;
        if (residual) {
          for (int64_t i = 0; i < n; ++i) h[i] = x[i] + res[i];
          RoundTo(dt(), h);
          ExpectClose(Download(d_h.get(), n, dt()), h, dt(), "h", 0.0);
        }
        std::vector<float> y(n), rstd(R);
        cpu::RmsNormForward(h.data(), w.data(), y.data(), rstd.data(), R, D, eps);
        const HostQuant emu = QuantizeOnHost(y, kE4M3);
        const auto gpu_rstd = Download(d_rstd.get(), R, DType::kFloat32);
        ExpectClose(gpu_rstd, rstd, DType::kFloat32, "rstd");
        if (with_y) ExpectClose(Download(d_y.get(), n, dt()), y, dt(), "y");
        const auto codes = q.codes();
        EXPECT_NEAR(q.amax(), emu.amax, 1e-5 * emu.amax);
        ExpectWithinOneStep(codes, emu.codes, 0.99, "codes against the emulation");
        ExpectTransposed(q.codes_t(), codes, R, D, "codes_t");
        // With the GPU's rstd the results are fp32 products: amax and codes bit-exact.
        std::vector<float> y_gpu(n);
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t j = 0; j < D; ++j) y_gpu[r * D + j] = h[r * D + j] * gpu_rstd[r] * w[j];
        }
        const HostQuant exact = QuantizeOnHost(y_gpu, kE4M3);
        ExpectSameFloat(q.amax(), exact.amax, "amax from the GPU's rstd");
        ExpectSameFloat(q.inverse(), exact.scale.inverse, "inverse scale");
        ExpectSameCodes(codes, exact.codes, kE4M3, "codes from the GPU's rstd");
      }
    }
  }
}

TEST_P(Fp8Cuda, SwiGluFp8MatchesEmulation) {
  for (bool with_y : {false, true}) {
    for (const Shape s : {Shape{37, 200}, Shape{1000, 72}, Shape{3, 1376}}) {
      SCOPED_TRACE(std::string(with_y ? "y " : "") + std::to_string(s.rows) + " x " +
                   std::to_string(s.cols));
      const int64_t n = s.rows * s.cols;
      auto g = Rand(n, 2.0f), u = Rand(n);
      g[3] = -30.0f;  // silu underflows: a subnormal or zero code
      RoundTo(dt(), g);
      auto d_g = Upload(g, dt()), d_u = Upload(u, dt());
      DeviceBuffer d_y(n * 4 + 16);
      Fp8Buffers q(n, kE4M3);
      ASSERT_OK(SwiGluForwardFp8(d_g.get(), d_u.get(), with_y ? d_y.get() : nullptr, s.rows, s.cols,
                                 dt(), q.out(), 0));
      std::vector<float> y(n);
      cpu::SwiGluForward(g.data(), u.data(), y.data(), n);
      const HostQuant emu = QuantizeOnHost(y, kE4M3);
      if (with_y) ExpectClose(Download(d_y.get(), n, dt()), y, dt(), "y");
      EXPECT_NEAR(q.amax(), emu.amax, 1e-5 * emu.amax);
      const auto codes = q.codes();
      ExpectWithinOneStep(codes, emu.codes, 0.99, "codes against the emulation");
      ExpectTransposed(q.codes_t(), codes, s.rows, s.cols, "codes_t");
      // The codes are those of the GPU's own amax (the scale follows the amax exactly).
      ExpectSameFloat(q.inverse(), cpu::TensorwiseScale(q.amax(), cpu::Fp8Format::kE4M3).inverse,
                      "inverse scale from the amax");
    }
  }
}

TEST_P(Fp8Cuda, GroupNormGateFp8MatchesEmulation) {
  struct GShape {
    int64_t T, H, Dh;
  };
  for (bool with_y : {false, true}) {
    // Rows of 8, 16 and 32 vectors of 8 (the vector path), and widths it does not take.
    for (const GShape s : {GShape{37, 3, 24}, GShape{100, 2, 100}, GShape{5, 8, 172},
                           GShape{37, 4, 64}, GShape{50, 2, 128}, GShape{3, 2, 256}}) {
      SCOPED_TRACE(std::string(with_y ? "y " : "") + std::to_string(s.T) + " x " +
                   std::to_string(s.H) + " x " + std::to_string(s.Dh));
      const int64_t C = s.H * s.Dh, n = s.T * C;
      const float eps = 1e-6f;
      auto o = Rand(n), gate = Rand(n, 2.0f), w = Rand(C, 0.3f, 1.0f);
      auto d_o = Upload(o, dt()), d_gate = Upload(gate, dt()), d_w = Upload(w, dt());
      DeviceBuffer d_y(n * 4 + 16), d_rstd(s.T * s.H * 4 + 16);
      Fp8Buffers q(n, kE4M3);
      ASSERT_OK(GroupNormGateForwardFp8(d_o.get(), d_w.get(), d_gate.get(),
                                        with_y ? d_y.get() : nullptr, d_rstd.as<float>(), s.T, s.H,
                                        s.Dh, eps, dt(), q.out(), 0));
      std::vector<float> y(n), rstd(s.T * s.H);
      cpu::GroupNormGateForward(o.data(), w.data(), gate.data(), y.data(), rstd.data(), s.T, s.H,
                                s.Dh, eps);
      const HostQuant emu = QuantizeOnHost(y, kE4M3);
      ExpectClose(Download(d_rstd.get(), s.T * s.H, DType::kFloat32), rstd, DType::kFloat32,
                  "rstd");
      if (with_y) ExpectClose(Download(d_y.get(), n, dt()), y, dt(), "y");
      EXPECT_NEAR(q.amax(), emu.amax, 1e-5 * emu.amax);
      const auto codes = q.codes();
      ExpectWithinOneStep(codes, emu.codes, 0.99, "codes against the emulation");
      ExpectTransposed(q.codes_t(), codes, s.T, C, "codes_t");
    }
  }
}

// A recomputed forward's quantization: the second pass alone, from the statistics and amax the
// full producer wrote, gives the full producer's codes, transposed codes, scale and inverse scale,
// bit for bit (odd shapes, the vector paths and the scalar ones).
TEST_P(Fp8Cuda, SecondPassAloneMatchesTheFullProducer) {
  auto expect_same = [](const Fp8Buffers& full, const Fp8Buffers& alone) {
    ExpectSameFloat(alone.scale(), full.scale(), "scale");
    ExpectSameFloat(alone.inverse(), full.inverse(), "inverse scale");
    EXPECT_TRUE(alone.codes() == full.codes()) << "codes";
    EXPECT_TRUE(alone.codes_t() == full.codes_t()) << "codes_t";
  };
  const float eps = 1e-6f;
  for (const Shape s :
       {Shape{37, 72}, Shape{1000, 200}, Shape{5, 1376}, Shape{13, 35}, Shape{37, 2048}}) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols));
    const int64_t R = s.rows, D = s.cols, n = R * D;
    auto x = Rand(n), w = Rand(D, 0.3f, 1.0f), g = Rand(n, 2.0f), u = Rand(n);
    auto d_x = Upload(x, dt()), d_w = Upload(w, dt()), d_g = Upload(g, dt()), d_u = Upload(u, dt());
    DeviceBuffer d_rstd(R * 4 + 16);
    {
      SCOPED_TRACE("RMSNorm");
      Fp8Buffers full(n, kE4M3), alone(n, kE4M3);
      ASSERT_OK(RmsNormForwardFp8(d_x.get(), d_w.get(), nullptr, d_rstd.as<float>(), R, D, eps,
                                  dt(), full.out(), 0));
      alone.SetAmax(full.amax());
      ASSERT_OK(
          RmsNormQuantizeFp8(d_x.get(), d_w.get(), d_rstd.as<float>(), R, D, dt(), alone.out(), 0));
      expect_same(full, alone);
    }
    {
      SCOPED_TRACE("SwiGLU");
      Fp8Buffers full(n, kE4M3), alone(n, kE4M3);
      ASSERT_OK(SwiGluForwardFp8(d_g.get(), d_u.get(), nullptr, R, D, dt(), full.out(), 0));
      alone.SetAmax(full.amax());
      ASSERT_OK(SwiGluQuantizeFp8(d_g.get(), d_u.get(), R, D, dt(), alone.out(), 0));
      expect_same(full, alone);
    }
  }
  struct GShape {
    int64_t T, H, Dh;
  };
  for (const GShape s : {GShape{37, 3, 24}, GShape{37, 4, 64}, GShape{50, 2, 128}}) {
    SCOPED_TRACE("group norm + gate " + std::to_string(s.T) + " x " + std::to_string(s.H) + " x " +
                 std::to_string(s.Dh));
    const int64_t C = s.H * s.Dh, n = s.T * C;
    auto o = Rand(n), gate = Rand(n, 2.0f), w = Rand(C, 0.3f, 1.0f);
    auto d_o = Upload(o, dt()), d_gate = Upload(gate, dt()), d_w = Upload(w, dt());
    DeviceBuffer d_rstd(s.T * s.H * 4 + 16);
    Fp8Buffers full(n, kE4M3), alone(n, kE4M3);
    ASSERT_OK(GroupNormGateForwardFp8(d_o.get(), d_w.get(), d_gate.get(), nullptr,
                                      d_rstd.as<float>(), s.T, s.H, s.Dh, eps, dt(), full.out(),
                                      0));
    alone.SetAmax(full.amax());
    ASSERT_OK(GroupNormGateQuantizeFp8(d_o.get(), d_w.get(), d_gate.get(), d_rstd.as<float>(), s.T,
                                       s.H, s.Dh, dt(), alone.out(), 0));
    expect_same(full, alone);
  }
}

TEST_P(Fp8Cuda, FusedProducersRefuseBadArguments) {
  DeviceBuffer buf(1024);
  Fp8Buffers q(64, kE4M3);
  Fp8Output bad = q.out();
  bad.format = DType::kBFloat16;
  Status s = Fp8Quantize(buf.get(), 8, 8, dt(), bad, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.message();
  bad = q.out();
  bad.inverse_scale = nullptr;
  s = RmsNormForwardFp8(buf.get(), buf.get(), nullptr, buf.as<float>(), 8, 8, 1e-6f, dt(), bad, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  s = RmsNormForwardFp8(buf.get(), buf.get(), buf.get(), buf.as<float>(), 8, 8, 1e-6f, dt(),
                        q.out(), 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("alias"), std::string::npos) << s.message();
  s = SwiGluForwardFp8(buf.get(), buf.get(), buf.get(), 8, 8, dt(), q.out(), 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
}

// ---- FP8 GEMMs ----------------------------------------------------------------------------------

// The three GEMMs of a linear layer y = x W^T on FP8 codes: x and W E4M3, dy E5M2, each quantized
// by the kernels above (W by the weights' cast), against (1) the fp32 product of the dequantized
// codes, (2) the bf16 GEMMs on the dequantized inputs and (3) the fp32 product of the
// unquantized inputs.
TEST_P(Fp8Cuda, GemmFp8ThreeRolesOfALinearLayer) {
  if (dt() != DType::kBFloat16) GTEST_SKIP() << "activations and gradients are stored in bf16";
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  struct LShape {
    int64_t T, in, out;
  };
  for (const LShape s : {LShape{48, 80, 208}, LShape{256, 1376, 96}, LShape{1008, 208, 1376}}) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " in " + std::to_string(s.in) + " out " +
                 std::to_string(s.out));
    const int64_t T = s.T, in = s.in, out = s.out;
    auto x = Rand(T * in), dy = Rand(T * out, 1e-3f);
    auto W = Normal(rng_, out * in, 0.05f);  // an fp32 master
    auto dW0 = Normal(rng_, out * in, 1e-3f);
    auto d_x = Upload(x, dt()), d_dy = Upload(dy, dt()), d_W = Upload(W, DType::kFloat32);
    Fp8Buffers qx(T * in, kE4M3), qdy(T * out, kE5M2), qW(out * in, kE4M3);
    ASSERT_OK(Fp8Quantize(d_x.get(), T, in, dt(), qx.out(), 0));
    ASSERT_OK(Fp8Quantize(d_dy.get(), T, out, dt(), qdy.out(), 0));
    const Fp8WeightCast cast{d_W.as<float>(), out, in, qW.out()};
    ASSERT_OK(Fp8CastWeights(&cast, 1, 0));

    DeviceBuffer d_y(T * out * 2), d_dx(T * in * 2);
    auto d_dW = Upload(dW0, DType::kFloat32);
    ASSERT_OK(blas->LinearForwardFp8(qx.operand(false), qW.operand(false), d_y.get(),
                                     DType::kBFloat16, T, in, out, 0));
    ASSERT_OK(blas->LinearBackwardFp8(qdy.operand(false), qdy.operand(true), qW.operand(true),
                                      qx.operand(true), d_dx.get(), DType::kBFloat16,
                                      d_dW.as<float>(), T, in, out, 0));
    const auto y = Download(d_y.get(), T * out, DType::kBFloat16);
    const auto dx = Download(d_dx.get(), T * in, DType::kBFloat16);
    const auto dW = Download(d_dW.get(), out * in, DType::kFloat32);

    // (1) The dequantized codes multiplied in fp32, the inverse scales applied to the sums.
    const float ix = qx.inverse(), idy = qdy.inverse(), iW = qW.inverse();
    const auto cx = Decode(qx.codes(), kE4M3), cdy = Decode(qdy.codes(), kE5M2),
               cW = Decode(qW.codes(), kE4M3);
    std::vector<float> y1(T * out), dx1(T * in), dW1(out * in, 0.0f);
    cpu::LinearForward(cx.data(), cW.data(), y1.data(), T, in, out);
    cpu::LinearBackward(cx.data(), cW.data(), cdy.data(), dx1.data(), dW1.data(), T, in, out);
    for (float& v : y1) v *= ix * iW;
    for (float& v : dx1) v *= idy * iW;
    for (int64_t i = 0; i < out * in; ++i) dW1[i] = dW0[i] + dW1[i] * (idy * ix);
    ExpectClose(y, y1, DType::kBFloat16, "y against the dequantized product");
    ExpectClose(dx, dx1, DType::kBFloat16, "dx against the dequantized product");
    // The fp32 output carries only accumulation differences (cuBLASLt promotes the tensor
    // cores' partial sums to fp32 at intervals).
    {
      std::vector<float> got(out * in), want(out * in);
      for (int64_t i = 0; i < out * in; ++i) got[i] = dW[i] - dW0[i], want[i] = dW1[i] - dW0[i];
      std::printf("dW against the dequantized product: relative L2 %.2e\n", RelativeL2(got, want));
      EXPECT_LT(RelativeL2(got, want), 1e-3) << "dW against the dequantized product";
    }

    // (2) The bf16 GEMMs on the dequantized inputs (rounded to bf16 once more).
    std::vector<float> dqx(T * in), dqdy(T * out), dqW(out * in);
    for (int64_t i = 0; i < T * in; ++i) dqx[i] = cx[i] * ix;
    for (int64_t i = 0; i < T * out; ++i) dqdy[i] = cdy[i] * idy;
    for (int64_t i = 0; i < out * in; ++i) dqW[i] = cW[i] * iW;
    auto b_x = Upload(dqx, DType::kBFloat16), b_dy = Upload(dqdy, DType::kBFloat16),
         b_W = Upload(dqW, DType::kBFloat16);
    auto b_dW = Upload(dW0, DType::kFloat32);
    DeviceBuffer b_y(T * out * 2), b_dx(T * in * 2);
    ASSERT_OK(
        blas->LinearForward(b_x.get(), b_W.get(), b_y.get(), T, in, out, DType::kBFloat16, 0));
    ASSERT_OK(blas->LinearBackward(b_x.get(), b_W.get(), b_dy.get(), b_dx.get(), b_dW.as<float>(),
                                   T, in, out, DType::kBFloat16, 0));
    ExpectClose(y, Download(b_y.get(), T * out, DType::kBFloat16), DType::kBFloat16,
                "y against the bf16 GEMM", 2.0);
    ExpectClose(dx, Download(b_dx.get(), T * in, DType::kBFloat16), DType::kBFloat16,
                "dx against the bf16 GEMM", 2.0);
    ExpectClose(dW, Download(b_dW.get(), out * in, DType::kFloat32), DType::kBFloat16,
                "dW against the bf16 GEMM", 2.0);

    // (3) The unquantized fp32 product: the recipe's quantization error only.
    std::vector<float> y3(T * out), dx3(T * in), dW3(out * in, 0.0f);
    cpu::LinearForward(x.data(), W.data(), y3.data(), T, in, out);
    cpu::LinearBackward(x.data(), W.data(), dy.data(), dx3.data(), dW3.data(), T, in, out);
    std::vector<float> dW_add(out * in);
    for (int64_t i = 0; i < out * in; ++i) dW_add[i] = dW[i] - dW0[i];
    std::printf(
        "T %lld in %lld out %lld: relative L2 against the unquantized product: y %.4f, "
        "dx %.4f, dW %.4f\n",
        static_cast<long long>(T), static_cast<long long>(in), static_cast<long long>(out),
        RelativeL2(y, y3), RelativeL2(dx, dx3), RelativeL2(dW_add, dW3));
    EXPECT_LT(RelativeL2(y, y3), 0.06) << "y (E4M3 x E4M3)";
    EXPECT_LT(RelativeL2(dx, dx3), 0.10) << "dx (E5M2 x E4M3)";
    EXPECT_LT(RelativeL2(dW_add, dW3), 0.10) << "dW (E5M2 x E4M3)";
  }
}

// Any M (cuBLASLt's N): the forward of 37 tokens, bf16 and fp32 outputs.
TEST_P(Fp8Cuda, GemmFp8OddRows) {
  if (dt() != DType::kBFloat16) GTEST_SKIP() << "activations are stored in bf16";
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  const int64_t T = 37, in = 208, out = 80;
  auto x = Rand(T * in), W = Normal(rng_, out * in, 0.05f);
  auto d_x = Upload(x, dt()), d_W = Upload(W, DType::kFloat32);
  Fp8Buffers qx(T * in, kE4M3), qW(out * in, kE4M3);
  ASSERT_OK(Fp8Quantize(d_x.get(), T, in, dt(), qx.out(), 0));
  const Fp8WeightCast cast{d_W.as<float>(), out, in, qW.out()};
  ASSERT_OK(Fp8CastWeights(&cast, 1, 0));
  const auto cx = Decode(qx.codes(), kE4M3), cW = Decode(qW.codes(), kE4M3);
  std::vector<float> want(T * out);
  cpu::LinearForward(cx.data(), cW.data(), want.data(), T, in, out);
  for (float& v : want) v *= qx.inverse() * qW.inverse();
  for (DType y_type : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(y_type));
    DeviceBuffer d_y(T * out * 4);
    ASSERT_OK(blas->LinearForwardFp8(qx.operand(false), qW.operand(false), d_y.get(), y_type, T, in,
                                     out, 0));
    ExpectClose(Download(d_y.get(), T * out, y_type), want,
                y_type == DType::kFloat32 ? DType::kBFloat16 : y_type, "y");
  }
  // Fast accumulation: the same product, within the same tolerance.
  GemmArgs g;
  g.trans_b = true, g.M = T, g.N = out, g.K = in;
  g.A = qx.operand(false).codes, g.lda = in, g.a_scale = qx.out().inverse_scale;
  g.B = qW.operand(false).codes, g.ldb = in, g.b_scale = qW.out().inverse_scale;
  g.ab_type = kE4M3, g.c_type = DType::kBFloat16, g.fast_accum = true;
  DeviceBuffer d_y(T * out * 2);
  g.C = d_y.get(), g.ldc = out;
  ASSERT_OK(blas->Gemm(g, 0));
  ExpectClose(Download(d_y.get(), T * out, DType::kBFloat16), want, DType::kBFloat16,
              "y, fast accumulation");
}

TEST_P(Fp8Cuda, GemmFp8RefusesWhatCublasLtCannotRun) {
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  DeviceBuffer a(64 * 64), b(64 * 64), c(64 * 64 * 4), scales(32);
  GemmArgs g;
  g.trans_b = true, g.M = 64, g.N = 64, g.K = 64;
  g.A = a.get(), g.lda = 64, g.B = b.get(), g.ldb = 64, g.C = c.get(), g.ldc = 64;
  g.ab_type = kE4M3, g.c_type = DType::kFloat32;
  g.a_scale = scales.as<float>(), g.b_scale = scales.as<float>() + 4;
  auto expect = [&](GemmArgs args, StatusCode code, const char* words) {
    const Status s = blas->Gemm(args, 0);
    EXPECT_EQ(s.code(), code) << s.message();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  GemmArgs nn = g;
  nn.trans_b = false;
  expect(nn, StatusCode::kUnsupported, "trans_a = false, trans_b = true");
  GemmArgs tt = g;
  tt.trans_a = true;
  expect(tt, StatusCode::kUnsupported, "trans_a = false, trans_b = true");
  GemmArgs e5 = g;
  e5.ab_type = kE5M2;
  expect(e5, StatusCode::kUnsupported, "E5M2 x E5M2");
  GemmArgs k = g;
  k.K = 40, k.lda = 40, k.ldb = 40;
  expect(k, StatusCode::kInvalidArgument, "multiples of 16");
  GemmArgs n = g;
  n.N = 40;
  expect(n, StatusCode::kInvalidArgument, "multiples of 16");
  GemmArgs no_scale = g;
  no_scale.b_scale = nullptr;
  expect(no_scale, StatusCode::kInvalidArgument, "a_scale and b_scale");
  GemmArgs mixed = g;
  mixed.b_type = DType::kBFloat16;
  expect(mixed, StatusCode::kInvalidArgument, "FP8 partner");
  GemmArgs misaligned = g;
  misaligned.A = static_cast<char*>(a.get()) + 8;
  expect(misaligned, StatusCode::kInvalidArgument, "16-byte aligned");
  GemmArgs scale8 = g;
  scale8.a_scale = scales.as<float>() + 2;
  expect(scale8, StatusCode::kInvalidArgument, "scale pointers must be 16-byte aligned");
  GemmArgs fp8_out = g;
  fp8_out.c_type = kE4M3;
  expect(fp8_out, StatusCode::kInvalidArgument, "bf16 or fp32");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8Cuda, ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace spindle::kernels::cuda
