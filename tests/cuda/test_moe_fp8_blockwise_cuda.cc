// The MoE experts' blockwise FP8 (moe.h "Blockwise FP8 of the experts' rows"): the bands of
// Fp8GroupedRowBands (host logic, runs without a GPU), the grouped quantizers (GatherRowsBlockwise,
// SwiGluQuantizeGroupedBlockwise) against the CPU emulation's blocks (cpu::QuantizeRowBlocks over
// the rows, cpu::QuantizeColumnBlocks over each segment, as worker/engine/numerics.h forms them),
// and the grouped GEMMs on block-scaled operands against an fp64 product of the dequantized
// operands. Fresh random inputs every run (the seed is printed; SPINDLE_TEST_SEED=N replays it).
//
// The quantization is exact (the dequantized values bit for bit the emulation's). The GEMMs differ
// from the fp64 reference only by the order of their fp32 additions and their output's rounding:
// each output within 2^-10 of sum_k |a_k b_k| plus 2^-8 of itself for bf16 outputs (2^-22 for the
// fp32 weight gradient), test_fp8_blockwise_cuda.cc's allowance; a scale read from another group's
// or segment's block moves an output by about a block's whole partial sum, far beyond.
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
#include "kernels/cuda/moe.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/fp8_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::CpuFormat;
using testing::DeviceBuffer;
using testing::Download;
using testing::DownloadBytes;
using testing::Upload;

constexpr int64_t kBlk = kFp8BlockSize;

// ---- The bands (host logic) ---------------------------------------------------------------------

// Groups of 48, 0, 272 and 16 rows; segments splitting the third group at rows 100 and 237 (as
// source ranks do at ep > 1) and an empty segment where the empty group is. Each segment's bands
// start at its first row, 128 rows each but the last; the row-scale group and the column blocks
// follow.
TEST(MoeFp8RowBands, FollowSegmentsWithinGroups) {
  const std::vector<int64_t> offsets = {0, 48, 48, 320, 336};
  const std::vector<int64_t> segments = {0, 48, 48, 100, 237, 320, 336};
  Fp8RowBands b;
  ASSERT_OK(Fp8GroupedRowBands(offsets.data(), 4, segments.data(), 6, &b));
  struct Want {
    int64_t row0, rows, group_row0, group_rows;
  };
  const std::vector<Want> want = {{0, 48, 0, 48},    {48, 52, 48, 272},  {100, 128, 48, 272},
                                  {228, 9, 48, 272}, {237, 83, 48, 272}, {320, 16, 320, 16}};
  ASSERT_EQ(b.bands.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(b.bands[i].row0, want[i].row0);
    EXPECT_EQ(b.bands[i].rows, want[i].rows);
    EXPECT_EQ(b.bands[i].group_row0, want[i].group_row0);
    EXPECT_EQ(b.bands[i].group_rows, want[i].group_rows);
    EXPECT_EQ(b.bands[i].col_block, static_cast<int64_t>(i));
  }
  EXPECT_EQ(b.col_blocks, 6);
  // Segments that cross a group, do not end at the groups' end, or go backwards are refused.
  const std::vector<int64_t> crossing = {0, 60, 336};
  EXPECT_EQ(Fp8GroupedRowBands(offsets.data(), 4, crossing.data(), 2, &b).code(),
            StatusCode::kInvalidArgument);
  const std::vector<int64_t> short_end = {0, 48, 320};
  EXPECT_EQ(Fp8GroupedRowBands(offsets.data(), 4, short_end.data(), 2, &b).code(),
            StatusCode::kInvalidArgument);
  const std::vector<int64_t> backwards = {0, 48, 40, 336};
  EXPECT_EQ(Fp8GroupedRowBands(offsets.data(), 4, backwards.data(), 3, &b).code(),
            StatusCode::kInvalidArgument);
}

// ---- On the GPU ---------------------------------------------------------------------------------

void ExpectSameFloats(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = (std::isnan(got[i]) && std::isnan(want[i])) ||
                      std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
    if (same) continue;
    if (++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " values differ";
}

// One grouped layout: groups (multiples of 16 rows, the last empty), segments (ep > 1's source
// ranks: starts off the 16-row grid, one segment over 128 rows), and the bands on the device.
struct Layout {
  std::vector<int64_t> offsets = {0, 32, 208, 384, 400, 400};
  std::vector<int64_t> segments = {0, 32, 75, 208, 213, 384, 400, 400};
  int64_t G() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t S() const { return static_cast<int64_t>(segments.size()) - 1; }
  int64_t rows() const { return offsets.back(); }
  Fp8RowBands bands;
  std::unique_ptr<DeviceBuffer> d_bands;
  void Build() {
    ASSERT_OK(Fp8GroupedRowBands(offsets.data(), G(), segments.data(), S(), &bands));
    const size_t bytes = bands.bands.size() * sizeof(Fp8RowBand);
    d_bands = std::make_unique<DeviceBuffer>(bytes);
    cudaMemcpy(d_bands->get(), bands.bands.data(), bytes, cudaMemcpyHostToDevice);
  }
  const Fp8RowBand* dev() const { return d_bands->as<Fp8RowBand>(); }
  int64_t n_bands() const { return static_cast<int64_t>(bands.bands.size()); }
  // Segment s's first column block.
  int64_t FirstBlock(int64_t s) const {
    int64_t b = 0;
    for (int64_t i = 0; i < s; ++i) b += Fp8Blocks(segments[i + 1] - segments[i]);
    return b;
  }
  int64_t GroupOf(int64_t r) const {
    int64_t g = 0;
    while (offsets[g + 1] <= r) ++g;
    return g;
  }
};

// The device side of one grouped Fp8BlockOutput of [rows, cols].
struct GroupedBuffers {
  GroupedBuffers(const Layout& L, int64_t cols, DType format, bool want_t)
      : L(L),
        cols(cols),
        codes(L.rows() * cols + 16),
        codes_t(L.rows() * cols + 16),
        scales(Fp8Blocks(cols) * L.rows() * 4 + 16),
        scales_t(L.bands.col_blocks * cols * 4 + 16) {
    cudaMemset(codes.get(), 0x5A, codes.bytes());
    cudaMemset(codes_t.get(), 0x5A, codes_t.bytes());
    cudaMemset(scales.get(), 0xFF, scales.bytes());
    cudaMemset(scales_t.get(), 0xFF, scales_t.bytes());
    out.format = format;
    out.codes = codes.get(), out.scales = scales.as<float>();
    if (want_t) out.codes_t = codes_t.get(), out.scales_t = scales_t.as<float>();
  }
  // Row r's block kb scale in its group's kRow128 tensor.
  float RowScale(const std::vector<float>& s, int64_t r, int64_t kb) const {
    const int64_t g = L.GroupOf(r), o = L.offsets[g], m = L.offsets[g + 1] - o;
    return s[o * Fp8Blocks(cols) + kb * m + (r - o)];
  }
  std::vector<float> Values() const {
    const int64_t R = L.rows();
    const auto q = DownloadBytes(codes.get(), R * cols);
    const auto s = Download(scales.get(), Fp8Blocks(cols) * R, DType::kFloat32);
    std::vector<float> v(R * cols);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c)
        v[r * cols + c] =
            cpu::Fp8ToFloat(q[r * cols + c], CpuFormat(out.format)) * RowScale(s, r, c / kBlk);
    return v;
  }
  // The transposed codes' values back in [rows, cols], each segment's blocks from its first row.
  std::vector<float> ValuesT() const {
    const int64_t R = L.rows();
    const auto q = DownloadBytes(codes_t.get(), R * cols);
    const auto s = Download(scales_t.get(), L.bands.col_blocks * cols, DType::kFloat32);
    std::vector<float> v(R * cols);
    for (int64_t seg = 0; seg < L.S(); ++seg) {
      const int64_t s0 = L.segments[seg], first = L.FirstBlock(seg);
      for (int64_t r = s0; r < L.segments[seg + 1]; ++r)
        for (int64_t c = 0; c < cols; ++c)
          v[r * cols + c] = cpu::Fp8ToFloat(q[c * R + r], CpuFormat(out.format)) *
                            s[(first + (r - s0) / kBlk) * cols + c];
    }
    return v;
  }
  const Layout& L;
  int64_t cols;
  DeviceBuffer codes, codes_t, scales, scales_t;
  Fp8BlockOutput out;
};

// The emulation of x [rows, cols]: row blocks over all rows, column blocks within each segment.
void Emulate(const Layout& L, const std::vector<float>& x, int64_t cols, DType f,
             std::vector<float>* rows_q, std::vector<float>* cols_q) {
  rows_q->assign(x.size(), 0.0f);
  cols_q->assign(x.size(), 0.0f);
  cpu::QuantizeRowBlocks(x.data(), L.rows(), cols, CpuFormat(f), rows_q->data());
  for (int64_t s = 0; s < L.S(); ++s) {
    const int64_t s0 = L.segments[s], n = L.segments[s + 1] - s0;
    if (n > 0)
      cpu::QuantizeColumnBlocks(x.data() + s0 * cols, n, cols, CpuFormat(f),
                                cols_q->data() + s0 * cols);
  }
}

class MoeFp8BlockwiseCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    SPINDLE_REQUIRE_GPU();
    seed_ = testing::FreshSeed();
    rng_.seed(seed_);
    std::printf("seed %u (SPINDLE_TEST_SEED=%u replays it)\n", seed_, seed_);
    L_.Build();
  }
  // N(0, 1) scaled per row by 2^[-6, 6], one outlier 2^14 times its neighbours.
  std::vector<float> Input(int64_t rows, int64_t cols, DType dtype) {
    std::uniform_int_distribution<int> e(-6, 6);
    auto x = testing::Normal(rng_, rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      const int er = e(rng_);
      for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = std::ldexp(x[r * cols + c], er);
    }
    if (rows > 0 && cols > 0) x[(rows / 2) * cols + cols - 1] *= 16384.0f;
    testing::RoundTo(dtype, x);
    return x;
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
  Layout L_;
};

// The gather from T token rows through a row map (padding rows -1, tokens repeated as top-k makes
// them) and the stored rows themselves (src null, as the received rows and output gradients), in
// bf16 and fp32, E4M3 and E5M2, with and without the transposed codes; widths with partial blocks
// (200) and a whole one (128).
TEST_F(MoeFp8BlockwiseCuda, GatherMatchesTheEmulationPerSegment) {
  const int64_t R = L_.rows(), T = 150;
  std::vector<int32_t> src(R);
  std::uniform_int_distribution<int32_t> tok(0, T - 1);
  for (int64_t g = 0; g < L_.G(); ++g)
    for (int64_t r = L_.offsets[g]; r < L_.offsets[g + 1]; ++r)
      src[r] = r + 5 >= L_.offsets[g + 1] && r % 3 == 0 ? -1 : tok(rng_);  // some padding
  DeviceBuffer d_src(R * 4);
  cudaMemcpy(d_src.get(), src.data(), R * 4, cudaMemcpyHostToDevice);
  for (const int64_t D : {int64_t{200}, int64_t{128}})
    for (const DType dtype : {DType::kBFloat16, DType::kFloat32})
      for (const DType f : {DType::kFp8E4M3, DType::kFp8E5M2})
        for (const bool gather : {true, false}) {
          SCOPED_TRACE(std::string(DTypeName(dtype)) + " -> " + DTypeName(f) + " D " +
                       std::to_string(D) + (gather ? " gathered" : " stored"));
          const auto in = Input(gather ? T : R, D, dtype);
          const auto d_in = Upload(in, dtype);
          std::vector<float> x(R * D, 0.0f);  // the rows the experts see
          for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < D; ++c)
              x[r * D + c] = !gather ? in[r * D + c] : src[r] < 0 ? 0.0f : in[src[r] * D + c];
          std::vector<float> want, want_t;
          Emulate(L_, x, D, f, &want, &want_t);
          for (const bool transposes : {true, false}) {
            GroupedBuffers q(L_, D, f, transposes);
            ASSERT_OK(GatherRowsBlockwise(d_in.get(), gather ? d_src.as<int32_t>() : nullptr,
                                          L_.dev(), L_.n_bands(), R, D, dtype, q.out, 0));
            ExpectSameFloats(q.Values(), want, "codes x group row scales");
            if (transposes) ExpectSameFloats(q.ValuesT(), want_t, "codes_t x segment scales");
          }
        }
}

// SwiGLU's fp32 result quantized in the grouped layout from g and u: the same blocks as the stored
// fp32 result of SwiGluForwardFp8 quantized by the grouped gather (src null).
TEST_F(MoeFp8BlockwiseCuda, SwiGluQuantizesItsFp32Result) {
  const int64_t R = L_.rows(), F = 176;
  const DType bf16 = DType::kBFloat16, f32 = DType::kFloat32;
  const auto g = Input(R, F, bf16), u = Input(R, F, bf16);
  const auto d_g = Upload(g, bf16), d_u = Upload(u, bf16);
  DeviceBuffer y(R * F * 4), scalars(64), tw_codes(R * F + 16);
  Fp8Output tw;  // the tensorwise producer, for its fp32 output y
  tw.codes = tw_codes.get(), tw.amax = scalars.as<float>(),
  tw.inverse_scale = scalars.as<float>() + 4;
  // The producer's fp32 y needs fp32 inputs: the same (bf16-rounded) values widened.
  const auto d_g32 = Upload(g, f32), d_u32 = Upload(u, f32);
  ASSERT_OK(SwiGluForwardFp8(d_g32.get(), d_u32.get(), y.get(), R, F, f32, tw, 0));
  GroupedBuffers want(L_, F, DType::kFp8E4M3, true), got(L_, F, DType::kFp8E4M3, true);
  ASSERT_OK(GatherRowsBlockwise(y.get(), nullptr, L_.dev(), L_.n_bands(), R, F, f32, want.out, 0));
  ASSERT_OK(SwiGluQuantizeGroupedBlockwise(d_g.get(), d_u.get(), L_.dev(), L_.n_bands(), R, F, bf16,
                                           got.out, 0));
  ExpectSameFloats(got.Values(), want.Values(), "codes x group row scales");
  ExpectSameFloats(got.ValuesT(), want.ValuesT(), "codes_t x segment scales");
}

// The grouped GEMMs on block-scaled operands (the experts' three roles, forward x W^T per group,
// input gradient dy W per group from W's transposed codes, weight gradient dy^T x per segment
// onto an existing gradient) against fp64 products of the dequantized operands, with each
// GroupedGemm method; the weight gradient's segments off the 16-row grid run on our own kernel.
TEST_F(MoeFp8BlockwiseCuda, GroupedGemmsTakeBlockScales) {
  const int64_t R = L_.rows(), G = L_.G(), N = 144, K = 208;  // weights [G, N, K]
  const DType bf16 = DType::kBFloat16, e4 = DType::kFp8E4M3, e5 = DType::kFp8E5M2;
  // x [R, K] (E4M3) and dy [R, N] (E5M2) in the grouped layout, from stored rows.
  const auto x = Input(R, K, bf16), dy = Input(R, N, bf16);
  const auto d_x = Upload(x, bf16), d_dy = Upload(dy, bf16);
  GroupedBuffers qx(L_, K, e4, true), qdy(L_, N, e5, true);
  ASSERT_OK(GatherRowsBlockwise(d_x.get(), nullptr, L_.dev(), L_.n_bands(), R, K, bf16, qx.out, 0));
  ASSERT_OK(
      GatherRowsBlockwise(d_dy.get(), nullptr, L_.dev(), L_.n_bands(), R, N, bf16, qdy.out, 0));
  const auto xv = qx.Values(), xtv = qx.ValuesT(), dyv = qdy.Values(), dytv = qdy.ValuesT();
  // The experts' weights: each [N, K] in 128 x 128 blocks, both layouts.
  const int64_t sd = Fp8Blocks(N) * Fp8SquareScalesLd(K), st = Fp8Blocks(K) * Fp8SquareScalesLd(N);
  const auto w = Input(G * N, K, DType::kFloat32);
  const auto d_w = Upload(w, DType::kFloat32);
  DeviceBuffer wc(G * N * K), wct(G * N * K), ws(G * sd * 4), wst(G * st * 4);
  std::vector<Fp8BlockWeightCast> casts;
  for (int64_t g = 0; g < G; ++g)
    casts.push_back({d_w.as<float>() + g * N * K, N, K, e4, wc.as<uint8_t>() + g * N * K,
                     ws.as<float>() + g * sd, wct.as<uint8_t>() + g * N * K,
                     wst.as<float>() + g * st});
  ASSERT_OK(Fp8CastWeightsBlockwise(casts.data(), G, 0));
  std::vector<float> wq(G * N * K);  // the emulation's dequantized weights
  for (int64_t g = 0; g < G; ++g)
    cpu::QuantizeSquareBlocks(w.data() + g * N * K, N, K, cpu::Fp8Format::kE4M3,
                              wq.data() + g * N * K);
  const Fp8Experts W{wc.get(), e4, ws.as<float>(), sd, Fp8ScaleMode::kBlock128};
  const Fp8Experts W_t{wct.get(), e4, wst.as<float>(), st, Fp8ScaleMode::kBlock128};
  const Fp8Operand xo{qx.codes.get(), e4, qx.scales.as<float>(), Fp8ScaleMode::kRow128};
  const Fp8Operand dyo{qdy.codes.get(), e5, qdy.scales.as<float>(), Fp8ScaleMode::kRow128};
  const Fp8Operand xt{qx.codes_t.get(), e4, qx.scales_t.as<float>(), Fp8ScaleMode::kRow128};
  const Fp8Operand dyt{qdy.codes_t.get(), e5, qdy.scales_t.as<float>(), Fp8ScaleMode::kRow128};
  const auto dW0 = testing::Normal(rng_, G * N * K, 1e-2f);
  // out[i] against sum_k a(i, k) b(i, k) in fp64 (plus base[i]): within 2^-10 sum |a b| + rel.
  auto check = [&](const std::vector<float>& got, const std::vector<float>& base, int64_t n,
                   int64_t kk, auto a, auto b, double rel, const std::string& what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      double sum = base.empty() ? 0.0 : base[i], mag = 0.0;
      for (int64_t k = 0; k < kk; ++k) {
        const double p = double{a(i, k)} * b(i, k);
        sum += p, mag += std::fabs(p);
      }
      const double allowed = std::ldexp(mag, -10) + rel * std::fabs(sum) + 1e-30;
      if (!(std::fabs(got[i] - sum) <= allowed) && ++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << sum;
    }
    EXPECT_EQ(bad, 0) << what;
  };
  for (const GroupedGemmMethod method : {GroupedGemmMethod::kLoop, GroupedGemmMethod::kStreams,
                                         GroupedGemmMethod::kGroupedBatched}) {
    SCOPED_TRACE(GroupedGemmMethodName(method));
    std::unique_ptr<GroupedGemm> gg;
    GroupedGemmOptions o;
    o.method = method;
    o.streams = 3;
    ASSERT_OK(GroupedGemm::Create(o, &gg));
    const int64_t* off = L_.offsets.data();
    DeviceBuffer y(R * N * 2), dx(R * K * 2);
    auto dW = Upload(dW0, DType::kFloat32);
    ASSERT_OK(gg->ForwardFp8(xo, W, y.get(), bf16, off, G, N, K, 0));
    ASSERT_OK(gg->BackwardDataFp8(dyo, W_t, dx.get(), bf16, off, G, N, K, 0));
    ASSERT_OK(gg->BackwardWeightFp8(dyt, xt, dW.as<float>(), off, G, N, K, 0, L_.segments.data(),
                                    L_.S()));
    const double b16 = std::ldexp(1.0, -8);
    // y [R, N]: row r of group g times expert g's W.
    check(
        Download(y.get(), R * N, bf16), {}, R * N, K,
        [&](int64_t i, int64_t k) { return xv[(i / N) * K + k]; },
        [&](int64_t i, int64_t k) { return wq[L_.GroupOf(i / N) * N * K + (i % N) * K + k]; }, b16,
        "y");
    // dx [R, K] = dy [R, N] W_g [N, K].
    check(
        Download(dx.get(), R * K, bf16), {}, R * K, N,
        [&](int64_t i, int64_t n) { return dyv[(i / K) * N + n]; },
        [&](int64_t i, int64_t n) { return wq[L_.GroupOf(i / K) * N * K + n * K + i % K]; }, b16,
        "dx");
    // dW_g [N, K] += sum over the group's rows of dy^T x, each segment's values its own blocks'.
    const auto got_dw = Download(dW.get(), G * N * K, DType::kFloat32);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t o0 = L_.offsets[g], m = L_.offsets[g + 1] - o0;
      const std::vector<float> got_g(got_dw.begin() + g * N * K, got_dw.begin() + (g + 1) * N * K);
      const std::vector<float> base(dW0.begin() + g * N * K, dW0.begin() + (g + 1) * N * K);
      check(
          got_g, base, N * K, m, [&](int64_t i, int64_t t) { return dytv[(o0 + t) * N + i / K]; },
          [&](int64_t i, int64_t t) { return xtv[(o0 + t) * K + i % K]; }, std::ldexp(1.0, -22),
          "dW expert " + std::to_string(g));
    }
  }
}

}  // namespace
}  // namespace spindle::kernels::cuda
