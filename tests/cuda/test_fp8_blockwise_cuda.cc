// The blockwise FP8 kernels (fp8.h "Blockwise scaling") against the CPU emulation
// (cpu::QuantizeRowBlocks / QuantizeColumnBlocks / QuantizeSquareBlocks), and the block-scaled
// FP8 GEMM (GemmArgs::a_scale_mode / b_scale_mode) in the three roles of a linear layer against an
// fp64 product of the CPU's dequantized operands, on cuBLASLt and on our own kernel. Fresh random
// inputs every run (the seed is printed; SPINDLE_TEST_SEED=N replays it).
//
// What is exact and what is not:
//  - Quantization: every scale is cpu::Pow2Scale's inverse of its block's amax and every
//    dequantized value (code times its block's inverse scale) equals the emulation's bit for bit,
//    on shapes with partial blocks at both edges, an all-zero block and a block holding an
//    outlier 2^14 times its neighbours.
//  - GEMM: the operands are the same dequantized values; only the order of the additions differs
//    (and, within a 128-wide block on cuBLASLt, the tensor cores' accumulation). Each output is
//    within 2^-10 of sum_k |a_k b_k| (fp32 accumulation order, with room for the tensor cores'
//    partial sums inside a block) plus the output's own rounding (2^-8 relative for bf16) of the
//    fp64 reference. A scale read from the wrong block moves a result by about its block's whole
//    partial sum (of order 2^-4 to 2^-3 of sum |a b| over a block of random signs), far beyond.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
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
using testing::RoundTo;
using testing::Upload;

constexpr DType kE4M3 = DType::kFp8E4M3;
constexpr DType kE5M2 = DType::kFp8E5M2;
constexpr int64_t kBlk = kFp8BlockSize;

std::vector<float> DownloadFloats(const void* p, int64_t n) {
  return Download(p, n, DType::kFloat32);
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(a)) == 0;
}

// got[i] and want[i] the same float bit for bit (NaN as NaN), with the first differences named.
void ExpectSameFloats(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (SameFloat(got[i], want[i])) continue;
    if (++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " values differ";
}

// The amax of x's block [r0, r0 + nr) x [c0, c0 + nc) (NaN if any is NaN), as cpu::AbsMax.
float BlockAmax(const std::vector<float>& x, int64_t cols, int64_t r0, int64_t nr, int64_t c0,
                int64_t nc) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r0 + nr; ++r) {
    const float a = cpu::AbsMax(x.data() + r * cols + c0, nc);
    if (std::isnan(a)) return a;
    amax = std::max(amax, a);
  }
  return amax;
}

class Fp8BlockwiseCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    SPINDLE_REQUIRE_GPU();
    seed_ = testing::FreshSeed();
    rng_.seed(seed_);
    std::printf("seed %u (SPINDLE_TEST_SEED=%u replays it)\n", seed_, seed_);
  }
  // N(0, 1) values scaled per row by 2^[-6, 6] and per 37 columns by 2^[-6, 6] (so that the blocks'
  // scales differ in both directions), one all-zero 1 x 128 row block and 128 x 1 column block
  // where the shape has them, one outlier 2^14 times its neighbours, rounded to `dtype`.
  std::vector<float> Input(int64_t rows, int64_t cols, DType dtype) {
    std::uniform_int_distribution<int> e(-6, 6);
    std::vector<int> er(rows), ec(cols / 37 + 1);
    for (int& v : er) v = e(rng_);
    for (int& v : ec) v = e(rng_);
    auto x = testing::Normal(rng_, rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        x[r * cols + c] = std::ldexp(x[r * cols + c], er[r] + ec[c / 37]);
    if (cols > kBlk && rows > 3)  // row 3's second 1 x 128 block (partial if cols < 256)
      for (int64_t c = kBlk; c < std::min(cols, 2 * kBlk); ++c) x[3 * cols + c] = 0.0f;
    if (rows > 1 && cols > 5)  // column 5's first 128 x 1 block
      for (int64_t r = 0; r < std::min(rows, kBlk); ++r) x[r * cols + 5] = 0.0f;
    if (rows > 0 && cols > 0) {
      const int64_t r = rows / 2, c = cols - 1;
      x[r * cols + c] = std::ldexp(1.5f, 14 + er[r] + ec[c / 37]);
    }
    RoundTo(dtype, x);
    return x;
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

// ---- Quantization
// ---------------------------------------------------------------------------------

struct Shape {
  int64_t rows, cols;
};

// The device side of one Fp8BlockOutput of [rows, cols], filled with bytes no test expects.
struct RowBlockBuffers {
  RowBlockBuffers(int64_t rows, int64_t cols, DType format, bool want_codes, bool want_codes_t)
      : rows(rows),
        cols(cols),
        codes(rows * cols + 16),
        codes_t(rows * cols + 16),
        scales(Fp8Blocks(cols) * rows * 4 + 16),
        scales_t(Fp8Blocks(rows) * cols * 4 + 16) {
    cudaMemset(codes.get(), 0x5A, rows * cols + 16);
    cudaMemset(codes_t.get(), 0x5A, rows * cols + 16);
    cudaMemset(scales.get(), 0xFF, scales.bytes());
    cudaMemset(scales_t.get(), 0xFF, scales_t.bytes());
    out.format = format;
    if (want_codes) out.codes = codes.get(), out.scales = scales.as<float>();
    if (want_codes_t) out.codes_t = codes_t.get(), out.scales_t = scales_t.as<float>();
  }
  // The dequantized values in x's layout [rows, cols].
  std::vector<float> Values() const {
    const auto q = DownloadBytes(codes.get(), rows * cols);
    const auto s = DownloadFloats(scales.get(), Fp8Blocks(cols) * rows);
    std::vector<float> v(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        v[r * cols + c] =
            cpu::Fp8ToFloat(q[r * cols + c], CpuFormat(out.format)) * s[(c / kBlk) * rows + r];
    return v;
  }
  // The transposed codes' dequantized values, transposed back to [rows, cols].
  std::vector<float> ValuesT() const {
    const auto q = DownloadBytes(codes_t.get(), rows * cols);
    const auto s = DownloadFloats(scales_t.get(), Fp8Blocks(rows) * cols);
    std::vector<float> v(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        v[r * cols + c] =
            cpu::Fp8ToFloat(q[c * rows + r], CpuFormat(out.format)) * s[(r / kBlk) * cols + c];
    return v;
  }
  int64_t rows, cols;
  DeviceBuffer codes, codes_t, scales, scales_t;
  Fp8BlockOutput out;
};

TEST_F(Fp8BlockwiseCuda, RowBlocksMatchCpuBitForBit) {
  // Partial blocks at both edges (200 x 333: the scalar paths), whole blocks (256 x 384: the
  // vector paths), rows not a multiple of 16 with vector loads (37 x 1000), one value, one tile.
  for (DType dtype : {DType::kBFloat16, DType::kFloat32})
    for (DType f : {kE4M3, kE5M2})
      for (const Shape s : {Shape{200, 333}, Shape{256, 384}, Shape{37, 1000}, Shape{1, 1},
                            Shape{128, 128}, Shape{300, 64}}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " -> " + DTypeName(f) + " " +
                     std::to_string(s.rows) + " x " + std::to_string(s.cols));
        const auto x = Input(s.rows, s.cols, dtype);
        const auto d_x = Upload(x, dtype);
        std::vector<float> want(x.size()), want_t(x.size());
        cpu::QuantizeRowBlocks(x.data(), s.rows, s.cols, CpuFormat(f), want.data());
        cpu::QuantizeColumnBlocks(x.data(), s.rows, s.cols, CpuFormat(f), want_t.data());
        RowBlockBuffers q(s.rows, s.cols, f, true, true);
        ASSERT_OK(Fp8QuantizeBlockwise(d_x.get(), s.rows, s.cols, dtype, q.out, 0));
        ExpectSameFloats(q.Values(), want, "codes x scales");
        ExpectSameFloats(q.ValuesT(), want_t, "codes_t x scales_t");
        // The scales themselves: Pow2Scale's inverse of each block's amax (an all-zero block's
        // included, whose codes are all zero whatever the scale).
        const auto sc = DownloadFloats(q.scales.get(), Fp8Blocks(s.cols) * s.rows);
        const auto sc_t = DownloadFloats(q.scales_t.get(), Fp8Blocks(s.rows) * s.cols);
        std::vector<float> want_sc(sc.size()), want_sc_t(sc_t.size());
        for (int64_t r = 0; r < s.rows; ++r)
          for (int64_t cb = 0; cb < Fp8Blocks(s.cols); ++cb)
            want_sc[cb * s.rows + r] = cpu::Pow2Scale(BlockAmax(x, s.cols, r, 1, cb * kBlk,
                                                                std::min(kBlk, s.cols - cb * kBlk)),
                                                      CpuFormat(f))
                                           .inverse;
        for (int64_t rb = 0; rb < Fp8Blocks(s.rows); ++rb)
          for (int64_t c = 0; c < s.cols; ++c)
            want_sc_t[rb * s.cols + c] =
                cpu::Pow2Scale(
                    BlockAmax(x, s.cols, rb * kBlk, std::min(kBlk, s.rows - rb * kBlk), c, 1),
                    CpuFormat(f))
                    .inverse;
        ExpectSameFloats(sc, want_sc, "scales");
        ExpectSameFloats(sc_t, want_sc_t, "scales_t");
        // Each layout alone: the same values.
        RowBlockBuffers only(s.rows, s.cols, f, true, false),
            only_t(s.rows, s.cols, f, false, true);
        ASSERT_OK(Fp8QuantizeBlockwise(d_x.get(), s.rows, s.cols, dtype, only.out, 0));
        ASSERT_OK(Fp8QuantizeBlockwise(d_x.get(), s.rows, s.cols, dtype, only_t.out, 0));
        ExpectSameFloats(only.Values(), want, "codes alone");
        ExpectSameFloats(only_t.ValuesT(), want_t, "codes_t alone");
      }
}

// The producers' results quantized blockwise from their inputs and kept statistics: the values the
// tensorwise producers write as their fp32 output y (with the rstd they keep), so the same blocks
// as quantizing that y, bit for bit, in both layouts.
TEST_F(Fp8BlockwiseCuda, ProducersQuantizeTheirFp32Results) {
  const DType f32 = DType::kFloat32;
  const int64_t T = 200, D = 333, H = 3, Dh = 100;
  DeviceBuffer scalars(64), codes(T * D + 16);
  Fp8Output tw;  // the tensorwise producers' own codes (not checked here)
  tw.codes = codes.get(), tw.amax = scalars.as<float>(), tw.inverse_scale = scalars.as<float>() + 4;
  auto expect_same = [&](const void* y, int64_t cols, const RowBlockBuffers& fused,
                         const std::string& what) {
    RowBlockBuffers want(T, cols, fused.out.format, true, true);
    ASSERT_OK(Fp8QuantizeBlockwise(y, T, cols, f32, want.out, 0));
    ExpectSameFloats(fused.Values(), want.Values(), what + " codes x scales");
    ExpectSameFloats(fused.ValuesT(), want.ValuesT(), what + " codes_t x scales_t");
  };
  {  // RMSNorm
    const auto x = Input(T, D, f32), w = testing::Normal(rng_, D);
    auto d_x = Upload(x, f32), d_w = Upload(w, f32);
    DeviceBuffer y(T * D * 4), rstd(T * 4);
    ASSERT_OK(RmsNormForwardFp8(d_x.get(), d_w.get(), y.get(), rstd.as<float>(), T, D, 1e-6f, f32,
                                tw, 0));
    RowBlockBuffers q(T, D, kE4M3, true, true);
    ASSERT_OK(
        RmsNormQuantizeBlockwise(d_x.get(), d_w.get(), rstd.as<float>(), T, D, f32, q.out, 0));
    expect_same(y.get(), D, q, "RMSNorm");
  }
  {  // SwiGLU
    const auto g = Input(T, D, f32), u = Input(T, D, f32);
    auto d_g = Upload(g, f32), d_u = Upload(u, f32);
    DeviceBuffer y(T * D * 4);
    ASSERT_OK(SwiGluForwardFp8(d_g.get(), d_u.get(), y.get(), T, D, f32, tw, 0));
    RowBlockBuffers q(T, D, kE4M3, true, true);
    ASSERT_OK(SwiGluQuantizeBlockwise(d_g.get(), d_u.get(), T, D, f32, q.out, 0));
    expect_same(y.get(), D, q, "SwiGLU");
  }
  {  // the group RMSNorm + gate
    const auto o = Input(T, H * Dh, f32), gate = Input(T, H * Dh, f32);
    const auto w = testing::Normal(rng_, H * Dh);
    auto d_o = Upload(o, f32), d_gate = Upload(gate, f32), d_w = Upload(w, f32);
    DeviceBuffer y(T * H * Dh * 4), rstd(T * H * 4);
    ASSERT_OK(GroupNormGateForwardFp8(d_o.get(), d_w.get(), d_gate.get(), y.get(), rstd.as<float>(),
                                      T, H, Dh, 1e-6f, f32, tw, 0));
    RowBlockBuffers q(T, H * Dh, kE4M3, true, true);
    ASSERT_OK(GroupNormGateQuantizeBlockwise(d_o.get(), d_w.get(), d_gate.get(), rstd.as<float>(),
                                             T, H, Dh, f32, q.out, 0));
    expect_same(y.get(), H * Dh, q, "group norm + gate");
  }
}

// An input that is not 16-byte aligned takes the scalar loads: the same values.
TEST_F(Fp8BlockwiseCuda, RowBlocksOfAMisalignedInput) {
  const int64_t rows = 144, cols = 256;
  const auto x = Input(rows * cols + 1, 1, DType::kBFloat16);
  const auto d_x = Upload(x, DType::kBFloat16);
  const std::vector<float> body(x.begin() + 1, x.end());
  std::vector<float> want(body.size()), want_t(body.size());
  cpu::QuantizeRowBlocks(body.data(), rows, cols, cpu::Fp8Format::kE4M3, want.data());
  cpu::QuantizeColumnBlocks(body.data(), rows, cols, cpu::Fp8Format::kE4M3, want_t.data());
  RowBlockBuffers q(rows, cols, kE4M3, true, true);
  ASSERT_OK(Fp8QuantizeBlockwise(static_cast<const char*>(d_x.get()) + 2, rows, cols,
                                 DType::kBFloat16, q.out, 0));
  ExpectSameFloats(q.Values(), want, "codes x scales");
  ExpectSameFloats(q.ValuesT(), want_t, "codes_t x scales_t");
}

// The weights: several masters of odd shapes in one call, each block's one scale in both layouts.
TEST_F(Fp8BlockwiseCuda, SquareBlocksMatchCpuBitForBit) {
  for (DType f : {kE4M3, kE5M2}) {
    SCOPED_TRACE(DTypeName(f));
    const std::vector<Shape> shapes = {{200, 333}, {256, 384}, {1, 5}, {300, 129}, {0, 7}};
    std::vector<std::vector<float>> masters;
    std::vector<DeviceBuffer> d_masters, codes, codes_t, scales, scales_t;
    std::vector<Fp8BlockWeightCast> casts;
    for (const Shape s : shapes) {
      masters.push_back(Input(s.rows, s.cols, DType::kFloat32));
      d_masters.push_back(Upload(masters.back(), DType::kFloat32));
      const int64_t n = s.rows * s.cols;
      codes.emplace_back(n + 16), codes_t.emplace_back(n + 16);
      scales.emplace_back(Fp8Blocks(s.rows) * Fp8SquareScalesLd(s.cols) * 4 + 16);
      scales_t.emplace_back(Fp8Blocks(s.cols) * Fp8SquareScalesLd(s.rows) * 4 + 16);
      cudaMemset(codes.back().get(), 0x5A, n + 16);
      cudaMemset(codes_t.back().get(), 0x5A, n + 16);
      Fp8BlockWeightCast c;
      c.master = d_masters.back().as<float>(), c.rows = s.rows, c.cols = s.cols, c.format = f;
      c.codes = codes.back().get(), c.scales = scales.back().as<float>();
      c.codes_t = codes_t.back().get(), c.scales_t = scales_t.back().as<float>();
      casts.push_back(c);
    }
    ASSERT_OK(Fp8CastWeightsBlockwise(casts.data(), static_cast<int64_t>(casts.size()), 0));
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t rows = shapes[i].rows, cols = shapes[i].cols;
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
      const auto& x = masters[i];
      std::vector<float> want(x.size());
      cpu::QuantizeSquareBlocks(x.data(), rows, cols, CpuFormat(f), want.data());
      const int64_t ld = Fp8SquareScalesLd(cols), ld_t = Fp8SquareScalesLd(rows);
      const auto q = DownloadBytes(codes[i].get(), rows * cols);
      const auto q_t = DownloadBytes(codes_t[i].get(), rows * cols);
      const auto s = DownloadFloats(scales[i].get(), Fp8Blocks(rows) * ld);
      const auto s_t = DownloadFloats(scales_t[i].get(), Fp8Blocks(cols) * ld_t);
      std::vector<float> got(x.size()), got_t(x.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          got[r * cols + c] =
              cpu::Fp8ToFloat(q[r * cols + c], CpuFormat(f)) * s[(r / kBlk) * ld + c / kBlk];
          got_t[r * cols + c] =
              cpu::Fp8ToFloat(q_t[c * rows + r], CpuFormat(f)) * s_t[(c / kBlk) * ld_t + r / kBlk];
        }
      ExpectSameFloats(got, want, "codes x scales");
      ExpectSameFloats(got_t, want, "codes_t x scales_t");
      for (int64_t rb = 0; rb < Fp8Blocks(rows); ++rb)
        for (int64_t cb = 0; cb < Fp8Blocks(cols); ++cb) {
          const float w =
              cpu::Pow2Scale(BlockAmax(x, cols, rb * kBlk, std::min(kBlk, rows - rb * kBlk),
                                       cb * kBlk, std::min(kBlk, cols - cb * kBlk)),
                             CpuFormat(f))
                  .inverse;
          EXPECT_TRUE(SameFloat(s[rb * ld + cb], w)) << "block " << rb << ", " << cb;
          EXPECT_TRUE(SameFloat(s_t[cb * ld_t + rb], w)) << "block " << rb << ", " << cb << " (t)";
        }
    }
  }
}

TEST_F(Fp8BlockwiseCuda, QuantizersRefuseBadArguments) {
  DeviceBuffer x(64 * 4), codes(64), scales(64);
  auto expect = [](const Status& s, const char* words) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  Fp8BlockOutput none;
  expect(Fp8QuantizeBlockwise(x.get(), 8, 8, DType::kFloat32, none, 0),
         "neither codes nor codes_t");
  Fp8BlockOutput no_scales;
  no_scales.codes = codes.get();
  expect(Fp8QuantizeBlockwise(x.get(), 8, 8, DType::kFloat32, no_scales, 0),
         "codes without scales");
  Fp8BlockOutput bf16_out;
  bf16_out.format = DType::kBFloat16, bf16_out.codes = codes.get();
  bf16_out.scales = scales.as<float>();
  expect(Fp8QuantizeBlockwise(x.get(), 8, 8, DType::kFloat32, bf16_out, 0), "unsupported dtype");
  Fp8BlockOutput ok;
  ok.codes = codes.get(), ok.scales = scales.as<float>();
  expect(Fp8QuantizeBlockwise(x.get(), -1, 8, DType::kFloat32, ok, 0), "negative size");
  expect(Fp8QuantizeBlockwise(x.get(), 8, 8, DType::kFp8E4M3, ok, 0), "unsupported dtype");
  Fp8BlockWeightCast w;
  w.master = x.as<float>(), w.rows = 8, w.cols = 8, w.codes_t = codes.get();
  expect(Fp8CastWeightsBlockwise(&w, 1, 0), "codes_t without scales_t");
}

// ---- The block-scaled GEMM
// ------------------------------------------------------------------------

// A linear layer's operands quantized blockwise on the device, and the CPU emulation's
// dequantized values of each.
struct LinearOperands {
  int64_t T, in, out;
  std::unique_ptr<RowBlockBuffers> x, dy;  // codes (1 x 128 along in / out), codes_t (along T)
  DeviceBuffer w_codes, w_codes_t, w_scales, w_scales_t;
  std::vector<float> xq, xq_t, dyq, dyq_t, wq;  // [T, in], [T, in], [T, out], [T, out], [out, in]
};

class Fp8BlockwiseGemm : public Fp8BlockwiseCuda {
 protected:
  void Make(LinearOperands& L) {
    const int64_t T = L.T, in = L.in, out = L.out;
    auto x = Input(T, in, DType::kBFloat16);
    auto dy = Input(T, out, DType::kBFloat16);
    auto W = testing::Normal(rng_, out * in, 0.05f);
    d_x_ = Upload(x, DType::kBFloat16), d_dy_ = Upload(dy, DType::kBFloat16);
    d_W_ = Upload(W, DType::kFloat32);
    L.x = std::make_unique<RowBlockBuffers>(T, in, kE4M3, true, true);
    L.dy = std::make_unique<RowBlockBuffers>(T, out, kE5M2, true, true);
    ASSERT_OK(Fp8QuantizeBlockwise(d_x_.get(), T, in, DType::kBFloat16, L.x->out, 0));
    ASSERT_OK(Fp8QuantizeBlockwise(d_dy_.get(), T, out, DType::kBFloat16, L.dy->out, 0));
    L.w_codes = DeviceBuffer(out * in + 16), L.w_codes_t = DeviceBuffer(out * in + 16);
    L.w_scales = DeviceBuffer(Fp8Blocks(out) * Fp8SquareScalesLd(in) * 4 + 16);
    L.w_scales_t = DeviceBuffer(Fp8Blocks(in) * Fp8SquareScalesLd(out) * 4 + 16);
    Fp8BlockWeightCast c;
    c.master = d_W_.as<float>(), c.rows = out, c.cols = in, c.format = kE4M3;
    c.codes = L.w_codes.get(), c.scales = L.w_scales.as<float>();
    c.codes_t = L.w_codes_t.get(), c.scales_t = L.w_scales_t.as<float>();
    ASSERT_OK(Fp8CastWeightsBlockwise(&c, 1, 0));
    L.xq.resize(T * in), L.xq_t.resize(T * in), L.dyq.resize(T * out), L.dyq_t.resize(T * out);
    L.wq.resize(out * in);
    cpu::QuantizeRowBlocks(x.data(), T, in, cpu::Fp8Format::kE4M3, L.xq.data());
    cpu::QuantizeColumnBlocks(x.data(), T, in, cpu::Fp8Format::kE4M3, L.xq_t.data());
    cpu::QuantizeRowBlocks(dy.data(), T, out, cpu::Fp8Format::kE5M2, L.dyq.data());
    cpu::QuantizeColumnBlocks(dy.data(), T, out, cpu::Fp8Format::kE5M2, L.dyq_t.data());
    cpu::QuantizeSquareBlocks(W.data(), out, in, cpu::Fp8Format::kE4M3, L.wq.data());
  }

  // C [M, N] against base + sum_k a[m, k] b[n, k] in fp64 (a [M, K], b [N, K] via accessors),
  // each within 2^-10 sum_k |a b| + out_rel |reference|. Returns the worst error / allowance.
  template <class A, class B>
  double Check(const std::vector<float>& got, const std::vector<float>& base, int64_t M, int64_t N,
               int64_t K, A a, B b, double out_rel, const std::string& what) {
    int64_t bad = 0;
    double worst = 0.0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0.0, mag = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = static_cast<double>(a(m, k)) * b(n, k);
          sum += p, mag += std::abs(p);
        }
        const double want = (base.empty() ? 0.0 : base[m * N + n]) + sum;
        const double allowed = std::ldexp(mag, -10) + out_rel * std::abs(want) + 1e-30;
        const double err = std::abs(got[m * N + n] - want);
        if (!(err <= allowed)) {
          if (++bad <= 5)
            ADD_FAILURE() << what << "[" << m << ", " << n << "]: got " << got[m * N + n]
                          << ", want " << want << " (allowed " << allowed << ")";
        }
        worst = std::max(worst, std::isnan(err) ? 1e30 : err / allowed);
      }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << M * N << " outputs off";
    return worst;
  }

  DeviceBuffer d_x_, d_dy_, d_W_;
};

// The three roles, each on the path Blas::Gemm picks and on our own kernel: the forward x W^T
// (1x128 x 128x128, bf16 out), the input gradient dy W from W's transposed codes (1x128 x 128x128,
// bf16 out), the weight gradient dy^T x from both transposed codes (1x128 x 1x128 along the
// tokens, fp32 out, beta 1 onto an existing gradient). Shapes: K of every role not a multiple of
// 128 (208 x 336 x 272), whole blocks (256 x 384 x 128), and sizes cuBLASLt cannot take (T 200,
// in 333, out 90: our kernel on either path).
TEST_F(Fp8BlockwiseGemm, ThreeRolesOfALinearLayer) {
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  struct LShape {
    int64_t T, in, out;
  };
  for (const LShape s : {LShape{208, 336, 272}, LShape{256, 384, 128}, LShape{200, 333, 90}}) {
    const std::string shape = "T " + std::to_string(s.T) + " in " + std::to_string(s.in) + " out " +
                              std::to_string(s.out);
    SCOPED_TRACE(shape);
    LinearOperands L;
    L.T = s.T, L.in = s.in, L.out = s.out;
    Make(L);
    if (HasFatalFailure()) return;
    const int64_t T = s.T, in = s.in, out = s.out;
    const auto dW0 = testing::Normal(rng_, out * in, 1e-2f);
    for (bool own : {false, true}) {
      const std::string path = own ? "own kernel" : "chosen path";
      SCOPED_TRACE(path);
      GemmArgs fwd;  // y [T, out] = x [T, in] W [out, in]^T
      fwd.trans_b = true, fwd.M = T, fwd.N = out, fwd.K = in;
      fwd.A = L.x->codes.get(), fwd.lda = in, fwd.ab_type = kE4M3;
      fwd.a_scale = L.x->scales.as<float>(), fwd.a_scale_mode = Fp8ScaleMode::kRow128;
      fwd.B = L.w_codes.get(), fwd.ldb = in, fwd.b_type = kE4M3;
      fwd.b_scale = L.w_scales.as<float>(), fwd.b_scale_mode = Fp8ScaleMode::kBlock128;
      DeviceBuffer d_y(T * out * 2);
      fwd.C = d_y.get(), fwd.ldc = out, fwd.c_type = DType::kBFloat16, fwd.own_kernel = own;

      GemmArgs dgrad;  // dx [T, in] = dy [T, out] (W^T [in, out])^T
      dgrad.trans_b = true, dgrad.M = T, dgrad.N = in, dgrad.K = out;
      dgrad.A = L.dy->codes.get(), dgrad.lda = out, dgrad.ab_type = kE5M2;
      dgrad.a_scale = L.dy->scales.as<float>(), dgrad.a_scale_mode = Fp8ScaleMode::kRow128;
      dgrad.B = L.w_codes_t.get(), dgrad.ldb = out, dgrad.b_type = kE4M3;
      dgrad.b_scale = L.w_scales_t.as<float>(), dgrad.b_scale_mode = Fp8ScaleMode::kBlock128;
      DeviceBuffer d_dx(T * in * 2);
      dgrad.C = d_dx.get(), dgrad.ldc = in, dgrad.c_type = DType::kBFloat16, dgrad.own_kernel = own;

      GemmArgs wgrad;  // dW [out, in] += dy^T [out, T] (x^T [in, T])^T
      wgrad.trans_b = true, wgrad.M = out, wgrad.N = in, wgrad.K = T, wgrad.beta = 1.0f;
      wgrad.A = L.dy->codes_t.get(), wgrad.lda = T, wgrad.ab_type = kE5M2;
      wgrad.a_scale = L.dy->scales_t.as<float>(), wgrad.a_scale_mode = Fp8ScaleMode::kRow128;
      wgrad.B = L.x->codes_t.get(), wgrad.ldb = T, wgrad.b_type = kE4M3;
      wgrad.b_scale = L.x->scales_t.as<float>(), wgrad.b_scale_mode = Fp8ScaleMode::kRow128;
      auto d_dW = Upload(dW0, DType::kFloat32);
      wgrad.C = d_dW.get(), wgrad.ldc = in, wgrad.c_type = DType::kFloat32, wgrad.own_kernel = own;

      ASSERT_OK(blas->Gemm(fwd, 0));
      ASSERT_OK(blas->Gemm(dgrad, 0));
      ASSERT_OK(blas->Gemm(wgrad, 0));
      const auto y = Download(d_y.get(), T * out, DType::kBFloat16);
      const auto dx = Download(d_dx.get(), T * in, DType::kBFloat16);
      const auto dW = Download(d_dW.get(), out * in, DType::kFloat32);
      const double bf16 = std::ldexp(1.0, -8), fp32 = std::ldexp(1.0, -22);
      const double wy = Check(
          y, {}, T, out, in, [&](int64_t t, int64_t k) { return L.xq[t * in + k]; },
          [&](int64_t o, int64_t k) { return L.wq[o * in + k]; }, bf16, "y");
      const double wdx = Check(
          dx, {}, T, in, out, [&](int64_t t, int64_t k) { return L.dyq[t * out + k]; },
          [&](int64_t i, int64_t k) { return L.wq[k * in + i]; }, bf16, "dx");
      const double wdw = Check(
          dW, dW0, out, in, T, [&](int64_t o, int64_t t) { return L.dyq_t[t * out + o]; },
          [&](int64_t i, int64_t t) { return L.xq_t[t * in + i]; }, fp32, "dW");
      std::printf("%s, %s: worst error / allowance y %.3f (%s), dx %.3f (%s), dW %.3f (%s)\n",
                  shape.c_str(), path.c_str(), wy, blas->AlgorithmName(fwd).c_str(), wdx,
                  blas->AlgorithmName(dgrad).c_str(), wdw, blas->AlgorithmName(wgrad).c_str());
      if (own) {
        EXPECT_EQ(blas->AlgorithmName(fwd), "own block-scaled kernel");
      }
    }
    // The Linear wrappers with blockwise operands: the chosen path's results again.
    const Fp8Operand x_op{L.x->codes.get(), kE4M3, L.x->scales.as<float>(), Fp8ScaleMode::kRow128};
    const Fp8Operand w_op{L.w_codes.get(), kE4M3, L.w_scales.as<float>(), Fp8ScaleMode::kBlock128};
    DeviceBuffer d_y(T * out * 2);
    ASSERT_OK(blas->LinearForwardFp8(x_op, w_op, d_y.get(), DType::kBFloat16, T, in, out, 0));
    Check(
        Download(d_y.get(), T * out, DType::kBFloat16), {}, T, out, in,
        [&](int64_t t, int64_t k) { return L.xq[t * in + k]; },
        [&](int64_t o, int64_t k) { return L.wq[o * in + k]; }, std::ldexp(1.0, -8),
        "LinearForwardFp8 y");
    const Fp8Operand dy_op{L.dy->codes.get(), kE5M2, L.dy->scales.as<float>(),
                           Fp8ScaleMode::kRow128};
    const Fp8Operand dy_t_op{L.dy->codes_t.get(), kE5M2, L.dy->scales_t.as<float>(),
                             Fp8ScaleMode::kRow128};
    const Fp8Operand w_t_op{L.w_codes_t.get(), kE4M3, L.w_scales_t.as<float>(),
                            Fp8ScaleMode::kBlock128};
    const Fp8Operand x_t_op{L.x->codes_t.get(), kE4M3, L.x->scales_t.as<float>(),
                            Fp8ScaleMode::kRow128};
    DeviceBuffer d_dx(T * in * 2);
    auto d_dW = Upload(dW0, DType::kFloat32);
    ASSERT_OK(blas->LinearBackwardFp8(dy_op, dy_t_op, w_t_op, x_t_op, d_dx.get(), DType::kBFloat16,
                                      d_dW.as<float>(), T, in, out, 0));
    Check(
        Download(d_dx.get(), T * in, DType::kBFloat16), {}, T, in, out,
        [&](int64_t t, int64_t k) { return L.dyq[t * out + k]; },
        [&](int64_t i, int64_t k) { return L.wq[k * in + i]; }, std::ldexp(1.0, -8),
        "LinearBackwardFp8 dx");
    Check(
        Download(d_dW.get(), out * in, DType::kFloat32), dW0, out, in, T,
        [&](int64_t o, int64_t t) { return L.dyq_t[t * out + o]; },
        [&](int64_t i, int64_t t) { return L.xq_t[t * in + i]; }, std::ldexp(1.0, -22),
        "LinearBackwardFp8 dW");
  }
}

TEST_F(Fp8BlockwiseGemm, RefusesWhatNoPathRuns) {
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  DeviceBuffer a(64 * 64), b(64 * 64), c(64 * 64 * 4), scales(64 * 4);
  GemmArgs g;
  g.trans_b = true, g.M = 64, g.N = 64, g.K = 64;
  g.A = a.get(), g.lda = 64, g.B = b.get(), g.ldb = 64, g.C = c.get(), g.ldc = 64;
  g.ab_type = kE4M3, g.c_type = DType::kFloat32;
  g.a_scale = scales.as<float>(), g.b_scale = scales.as<float>() + 32;
  g.a_scale_mode = Fp8ScaleMode::kRow128, g.b_scale_mode = Fp8ScaleMode::kBlock128;
  auto expect = [&](GemmArgs args, StatusCode code, const char* words) {
    const Status s = blas->Gemm(args, 0);
    EXPECT_EQ(s.code(), code) << s.message();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  GemmArgs nn = g;
  nn.trans_b = false;
  expect(nn, StatusCode::kUnsupported, "trans_a = false, trans_b = true");
  GemmArgs fast = g;
  fast.fast_accum = true;
  expect(fast, StatusCode::kInvalidArgument, "no fast accumulation");
  GemmArgs no_scale = g;
  no_scale.a_scale = nullptr;
  expect(no_scale, StatusCode::kInvalidArgument, "a_scale and b_scale");
  GemmArgs bf16 = g;
  bf16.b_type = DType::kBFloat16;
  expect(bf16, StatusCode::kInvalidArgument, "FP8 operands");
  GemmArgs short_ld = g;
  short_ld.lda = 32;
  expect(short_ld, StatusCode::kInvalidArgument, "leading dimensions");
  GemmArgs fp8_out = g;
  fp8_out.c_type = kE4M3;
  expect(fp8_out, StatusCode::kInvalidArgument, "bf16 or fp32");
  GemmArgs bad_mode = g;
  bad_mode.a_scale_mode = static_cast<Fp8ScaleMode>(7);
  expect(bad_mode, StatusCode::kInvalidArgument, "unknown scale mode");
}

}  // namespace
}  // namespace spindle::kernels::cuda
