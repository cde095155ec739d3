// The MoE FFN's CUDA kernels (kernels/cuda/moe.h) against the CPU reference (kernels/cpu/moe.h,
// cpu::Gemm for the grouped GEMMs, kernels/cpu/fp8.h for the FP8 codes) on odd shapes (T 17, 37,
// 127; E 5, 8, 64; K 1, 2, 8; D 16-48; groups left empty) with fresh random inputs.
//
// Exact: expert ids (but where the CPU's keys come within 1e-5 of a tie, which an ulp of expf can
// flip), counts, offsets, item rows, row sources, gathered rows, FP8 codes, scales and the
// transposed codes; the combine's and the grouped GEMMs' values within the per-dtype tolerance
// table; reruns bitwise equal; the grouped GEMM's methods bitwise equal where they run the same
// cuBLASLt algorithm (loop and streams).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/moe.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/fp8_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::CpuFormat;
using testing::DeviceBuffer;
using testing::Download;
using testing::ExpectClose;
using testing::ExpectSameBits;
using testing::FreshSeed;
using testing::Normal;
using testing::RoundTo;
using testing::Upload;
using testing::UploadRaw;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBf16 = DType::kBFloat16;

template <typename T>
std::vector<T> DownloadAs(const void* p, int64_t n) {
  std::vector<T> out(n);
  cudaDeviceSynchronize();
  if (n > 0) cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return out;
}

struct Shape {
  int64_t T, E, K;
};
std::vector<Shape> Shapes() {
  std::vector<Shape> s;
  for (int64_t T : {17, 37, 127}) {
    for (int64_t E : {5, 8, 64}) {
      for (int64_t K : {1, 2, 8}) {
        if (K <= E) s.push_back({T, E, K});
      }
    }
  }
  return s;
}

// Keys that route tokens unevenly: most go to the first third of the experts, so that with many
// experts some groups stay empty.
std::vector<int32_t> SkewedKeys(std::mt19937& rng, int64_t n, int64_t E) {
  std::vector<int32_t> k(n);
  const int64_t hot = std::max<int64_t>(1, E / 3);
  std::uniform_int_distribution<int32_t> all(0, static_cast<int32_t>(E - 1)),
      few(0, static_cast<int32_t>(hot - 1));
  std::bernoulli_distribution pick_hot(0.8);
  for (auto& e : k) e = pick_hot(rng) ? few(rng) : all(rng);
  return k;
}

class MoeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    SPINDLE_REQUIRE_GPU();
    seed_ = FreshSeed();
    rng_.seed(seed_);
  }
  std::string Seed() const { return " (seed " + std::to_string(seed_) + ")"; }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

// ---- Router ------------------------------------------------------------------------------------

TEST_F(MoeCuda, RouterForwardMatchesCpu) {
  int64_t skipped = 0, tokens = 0;
  for (const Shape& s : Shapes()) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " E " + std::to_string(s.E) + " K " +
                 std::to_string(s.K) + Seed());
    const auto z = Normal(rng_, s.T * s.E, 2.0f);
    const auto bias = Normal(rng_, s.E, 0.1f);
    std::vector<int32_t> idx(s.T * s.K);
    std::vector<float> w(s.T * s.K), lse(s.T);
    cpu::MoeRouterForward(z.data(), bias.data(), idx.data(), w.data(), lse.data(), s.T, s.E, s.K);
    DeviceBuffer dz = Upload(z, kF32), db = Upload(bias, kF32), didx(idx.size() * 4),
                 dw(w.size() * 4), dl(lse.size() * 4);
    ASSERT_OK(MoeRouterForward(dz.as<float>(), db.as<float>(), didx.as<int32_t>(), dw.as<float>(),
                               dl.as<float>(), s.T, s.E, s.K, 0));
    const auto gidx = DownloadAs<int32_t>(didx.get(), s.T * s.K);
    const auto gw = Download(dw.get(), s.T * s.K, kF32);
    // Tokens whose CPU keys hold a near tie among the K + 1 largest: an ulp may flip the order.
    std::vector<float> want_w, got_w;
    for (int64_t t = 0; t < s.T; ++t) {
      std::vector<float> key(s.E);
      for (int64_t e = 0; e < s.E; ++e) {
        key[e] = 1.0f / (1.0f + std::exp(-z[t * s.E + e])) + bias[e];
      }
      std::sort(key.begin(), key.end(), std::greater<float>());
      bool tie = false;
      for (int64_t k = 0; k < std::min(s.K, s.E - 1); ++k) tie |= key[k] - key[k + 1] < 1e-5f;
      ++tokens;
      if (tie) {
        ++skipped;
        continue;
      }
      for (int64_t k = 0; k < s.K; ++k) {
        ASSERT_EQ(gidx[t * s.K + k], idx[t * s.K + k]) << "token " << t << " choice " << k;
        want_w.push_back(w[t * s.K + k]);
        got_w.push_back(gw[t * s.K + k]);
      }
    }
    ExpectClose(got_w, want_w, kF32, "weights");
    ExpectClose(Download(dl.get(), s.T, kF32), lse, kF32, "lse");
  }
  EXPECT_LT(skipped * 100, tokens) << "too many near ties skipped";
}

TEST_F(MoeCuda, RouterTiesGoToTheLowerExpert) {
  const int64_t T = 3, E = 64, K = 8;
  std::vector<float> z(T * E, 0.0f), bias(E, 0.0f);
  for (int64_t e = 0; e < E; ++e) z[2 * E + e] = (e % 4 == 3) ? 1.0f : 0.0f;  // 16 equal maxima
  DeviceBuffer dz = Upload(z, kF32), db = Upload(bias, kF32), didx(T * K * 4), dw(T * K * 4);
  ASSERT_OK(MoeRouterForward(dz.as<float>(), db.as<float>(), didx.as<int32_t>(), dw.as<float>(),
                             nullptr, T, E, K, 0));
  const auto gidx = DownloadAs<int32_t>(didx.get(), T * K);
  for (int64_t k = 0; k < K; ++k) {
    EXPECT_EQ(gidx[k], k);
    EXPECT_EQ(gidx[K + k], k);
    EXPECT_EQ(gidx[2 * K + k], 4 * k + 3);
  }
  const auto gw = Download(dw.get(), T * K, kF32);
  for (float v : gw) EXPECT_FLOAT_EQ(v, 1.0f / K);
}

TEST_F(MoeCuda, RouterBackwardMatchesCpu) {
  for (const Shape& s : Shapes()) {
    for (float zloss : {0.0f, 0.01f}) {
      SCOPED_TRACE("T " + std::to_string(s.T) + " E " + std::to_string(s.E) + " K " +
                   std::to_string(s.K) + " zloss " + std::to_string(zloss) + Seed());
      const auto z = Normal(rng_, s.T * s.E, 2.0f);
      const auto bias = Normal(rng_, s.E, 0.1f);
      const auto dwt = Normal(rng_, s.T * s.K);
      std::vector<int32_t> idx(s.T * s.K);
      std::vector<float> w(s.T * s.K), lse(s.T), dz(s.T * s.E);
      cpu::MoeRouterForward(z.data(), bias.data(), idx.data(), w.data(), lse.data(), s.T, s.E, s.K);
      cpu::MoeRouterBackward(z.data(), idx.data(), dwt.data(), lse.data(), zloss, dz.data(), s.T,
                             s.E, s.K);
      DeviceBuffer gz = Upload(z, kF32), gidx = UploadRaw(idx), gdw = Upload(dwt, kF32),
                   gl = Upload(lse, kF32), gdz(dz.size() * 4);
      cudaMemset(gdz.get(), 0x7F, dz.size() * 4);
      ASSERT_OK(MoeRouterBackward(gz.as<float>(), gidx.as<int32_t>(), gdw.as<float>(),
                                  gl.as<float>(), zloss, gdz.as<float>(), s.T, s.E, s.K, 0));
      ExpectClose(Download(gdz.get(), s.T * s.E, kF32), dz, kF32, "dlogits");
    }
  }
}

// ---- Grouping ----------------------------------------------------------------------------------

void CheckGroupRows(const std::vector<int32_t>& keys, int64_t per_source, int64_t E, int64_t align,
                    const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t cap = n + E * (align - 1) + 5;
  std::vector<int64_t> counts(E), offsets(E + 1);
  std::vector<int32_t> item_row(n), row_source(cap, -1);
  cpu::MoeGroupRows(keys.data(), n, per_source, E, align, counts.data(), offsets.data(),
                    item_row.data(), row_source.data());
  DeviceBuffer dk = UploadRaw(keys), dc(E * 8), doff((E + 1) * 8), dir(n * 4 + 4), drs(cap * 4),
               ws(MoeGroupRowsWorkspaceBytes(n, E));
  cudaMemset(drs.get(), 0x33, cap * 4);
  int64_t* host = nullptr;
  ASSERT_CUDA(cudaMallocHost(&host, E * sizeof(int64_t)));
  std::fill(host, host + E, int64_t{-7});
  for (int rep = 0; rep < 2; ++rep) {
    ASSERT_OK(MoeGroupRows(dk.as<int32_t>(), n, per_source, E, align, dc.as<int64_t>(),
                           doff.as<int64_t>(), dir.as<int32_t>(), drs.as<int32_t>(), cap, host,
                           {ws.get(), ws.bytes()}, 0));
    ASSERT_CUDA(cudaStreamSynchronize(0));
    EXPECT_EQ(DownloadAs<int64_t>(dc.get(), E), counts);
    EXPECT_EQ(std::vector<int64_t>(host, host + E), counts);
    EXPECT_EQ(DownloadAs<int64_t>(doff.get(), E + 1), offsets);
    EXPECT_EQ(DownloadAs<int32_t>(dir.get(), n), item_row);
    EXPECT_EQ(DownloadAs<int32_t>(drs.get(), cap), row_source);  // -1 past offsets[E] too
  }
  cudaFreeHost(host);
}

TEST_F(MoeCuda, GroupRowsMatchesCpu) {
  for (const Shape& s : Shapes()) {
    for (int64_t align : {1, 16}) {
      std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(s.E - 1));
      std::vector<int32_t> uniform(s.T * s.K);
      for (auto& k : uniform) k = any(rng_);
      const std::string tag = "T " + std::to_string(s.T) + " E " + std::to_string(s.E) + " K " +
                              std::to_string(s.K) + " align " + std::to_string(align) + Seed();
      CheckGroupRows(uniform, s.K, s.E, align, "uniform " + tag);
      CheckGroupRows(SkewedKeys(rng_, s.T * s.K, s.E), s.K, s.E, align, "skewed " + tag);
    }
  }
  // Many tiles (more than one scan pass of 256 tiles), and the largest E.
  CheckGroupRows(SkewedKeys(rng_, 37 * 1024 * 8 + 3, 64), 8, 64, 16, "37K tokens x 8" + Seed());
  CheckGroupRows(SkewedKeys(rng_, 5000, kMoeMaxExperts), 2, kMoeMaxExperts, 16, "E 1024" + Seed());
  CheckGroupRows({}, 4, 8, 16, "no items");
}

// ---- Gathers -----------------------------------------------------------------------------------

std::vector<int32_t> RandomSources(std::mt19937& rng, int64_t rows, int64_t T) {
  std::uniform_int_distribution<int32_t> pick(-1, static_cast<int32_t>(T - 1));
  std::vector<int32_t> src(rows);
  for (auto& s : src) s = pick(rng);
  return src;
}

TEST_F(MoeCuda, GatherRowsMatchesCpu) {
  for (DType dt : {kF32, kBf16}) {
    for (int64_t D : {16, 17, 37, 48}) {
      for (int64_t T : {17, 127}) {
        SCOPED_TRACE(std::string(DTypeName(dt)) + " D " + std::to_string(D) + " T " +
                     std::to_string(T) + Seed());
        auto in = Normal(rng_, T * D);
        RoundTo(dt, in);
        const int64_t rows = 3 * T + 5;
        const auto src = RandomSources(rng_, rows, T);
        std::vector<float> want(rows * D);
        cpu::GatherRows(in.data(), src.data(), want.data(), rows, D);
        DeviceBuffer din = Upload(in, dt), dsrc = UploadRaw(src), dout(rows * D * 4);
        cudaMemset(dout.get(), 0x7F, rows * D * 4);
        ASSERT_OK(GatherRows(din.get(), dsrc.as<int32_t>(), dout.get(), rows, D, dt, 0));
        ExpectSameBits(Download(dout.get(), rows * D, dt), want, "gathered rows");
      }
    }
  }
}

TEST_F(MoeCuda, GatherRowsFp8MatchesCpuEmulation) {
  for (DType dt : {kF32, kBf16}) {
    for (DType fmt : {DType::kFp8E4M3, DType::kFp8E5M2}) {
      for (int64_t D : {16, 32, 48}) {
        for (const Shape& s : {Shape{17, 5, 2}, Shape{37, 8, 1}, Shape{127, 64, 8}}) {
          SCOPED_TRACE(std::string(DTypeName(dt)) + " " + DTypeName(fmt) + " D " +
                       std::to_string(D) + " T " + std::to_string(s.T) + Seed());
          // A wide dynamic range: FP8 subnormals and underflow among the codes.
          std::vector<float> in = Normal(rng_, s.T * D);
          std::uniform_int_distribution<int> exponent(-14, 4);
          for (auto& v : in) v = std::ldexp(v, exponent(rng_));
          RoundTo(dt, in);
          // Rows as the engine makes them: groups of the (token, choice) pairs, padded to 16.
          const auto keys = SkewedKeys(rng_, s.T * s.K, s.E);
          const int64_t cap = s.T * s.K + s.E * 15;
          std::vector<int64_t> counts(s.E), offsets(s.E + 1);
          std::vector<int32_t> item_row(keys.size()), row_source(cap, -1);
          cpu::MoeGroupRows(keys.data(), s.T * s.K, s.K, s.E, 16, counts.data(), offsets.data(),
                            item_row.data(), row_source.data());
          const int64_t rows = offsets[s.E];
          std::vector<float> gathered(rows * D);
          cpu::GatherRows(in.data(), row_source.data(), gathered.data(), rows, D);
          const float amax = cpu::AbsMax(gathered.data(), rows * D);
          const cpu::Fp8Scale sc = cpu::TensorwiseScale(amax, CpuFormat(fmt));
          std::vector<uint8_t> want(rows * D), want_t(rows * D);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < D; ++c) {
              const uint8_t q = cpu::FloatToFp8(gathered[r * D + c] * sc.scale, CpuFormat(fmt));
              want[r * D + c] = q;
              want_t[c * rows + r] = q;
            }
          }
          DeviceBuffer din = Upload(in, dt), dsrc = UploadRaw(row_source), codes(rows * D + 16),
                       codes_t(rows * D + 16), scalars(64);
          cudaMemset(codes.get(), 0x5A, rows * D + 16);
          cudaMemset(codes_t.get(), 0x5A, rows * D + 16);
          cudaMemcpy(scalars.get(), &amax, 4, cudaMemcpyHostToDevice);
          Fp8Output q;
          q.format = fmt;
          q.codes = codes.get();
          q.codes_t = codes_t.get();
          q.amax = scalars.as<float>();
          q.scale = scalars.as<float>() + 4;
          q.inverse_scale = scalars.as<float>() + 8;
          ASSERT_OK(GatherRowsFp8(din.get(), dsrc.as<int32_t>(), rows, D, dt, q, 0));
          EXPECT_EQ(DownloadAs<uint8_t>(codes.get(), rows * D), want);
          EXPECT_EQ(DownloadAs<uint8_t>(codes_t.get(), rows * D), want_t);
          const auto sc_got = DownloadAs<float>(scalars.get(), 12);
          EXPECT_EQ(sc_got[4], sc.scale);
          EXPECT_EQ(sc_got[8], sc.inverse);
        }
      }
    }
  }
}

// ---- Combine -----------------------------------------------------------------------------------

// Rows of y named by (token, choice) pairs through MoeGroupRows, as the engine's.
struct Routing {
  std::vector<int32_t> item_row;
  std::vector<float> w;
  int64_t rows;
};
Routing MakeRouting(std::mt19937& rng, const Shape& s) {
  const auto keys = SkewedKeys(rng, s.T * s.K, s.E);
  std::vector<int64_t> counts(s.E), offsets(s.E + 1);
  Routing r;
  r.item_row.resize(keys.size());
  std::vector<int32_t> row_source(s.T * s.K + s.E * 15);
  cpu::MoeGroupRows(keys.data(), s.T * s.K, s.K, s.E, 16, counts.data(), offsets.data(),
                    r.item_row.data(), row_source.data());
  r.rows = offsets[s.E];
  r.w = Normal(rng, s.T * s.K, 0.5f, 0.3f);
  return r;
}

TEST_F(MoeCuda, CombineMatchesCpu) {
  for (DType ydt : {kF32, kBf16}) {
    for (DType odt : {kF32, kBf16}) {
      for (int64_t D : {16, 37, 48}) {
        for (const Shape& s : {Shape{17, 5, 2}, Shape{37, 8, 8}, Shape{127, 64, 8}}) {
          for (bool accumulate : {false, true}) {
            for (bool weighted : {true, false}) {
              SCOPED_TRACE(std::string(DTypeName(ydt)) + " -> " + DTypeName(odt) + " D " +
                           std::to_string(D) + " T " + std::to_string(s.T) + " K " +
                           std::to_string(s.K) + (accumulate ? " acc" : "") +
                           (weighted ? " weighted" : "") + Seed());
              const Routing r = MakeRouting(rng_, s);
              auto y = Normal(rng_, r.rows * D);
              RoundTo(ydt, y);
              auto out = Normal(rng_, s.T * D);
              RoundTo(odt, out);
              std::vector<float> want = out;
              cpu::MoeCombine(y.data(), r.item_row.data(), weighted ? r.w.data() : nullptr,
                              want.data(), s.T, s.K, D, accumulate);
              DeviceBuffer dy = Upload(y, ydt), drow = UploadRaw(r.item_row),
                           dw = Upload(r.w, kF32), dout = Upload(out, odt);
              ASSERT_OK(MoeCombine(dy.get(), ydt, drow.as<int32_t>(),
                                   weighted ? dw.as<float>() : nullptr, dout.get(), odt, s.T, s.K,
                                   D, accumulate, 0));
              ExpectClose(Download(dout.get(), s.T * D, odt), want, odt, "combined");
            }
          }
        }
      }
    }
  }
}

TEST_F(MoeCuda, CombineBackwardMatchesCpu) {
  for (DType dt : {kF32, kBf16}) {
    for (int64_t D : {16, 37, 48}) {
      for (const Shape& s : {Shape{17, 5, 2}, Shape{37, 8, 1}, Shape{127, 64, 8}}) {
        SCOPED_TRACE(std::string(DTypeName(dt)) + " D " + std::to_string(D) + " T " +
                     std::to_string(s.T) + " K " + std::to_string(s.K) + Seed());
        const Routing r = MakeRouting(rng_, s);
        auto y = Normal(rng_, r.rows * D);
        auto dout = Normal(rng_, s.T * D);
        RoundTo(dt, y);
        RoundTo(dt, dout);
        std::vector<float> dy(r.rows * D, 0.0f), dw(s.T * s.K);
        cpu::MoeCombineBackward(dout.data(), y.data(), r.item_row.data(), r.w.data(), dy.data(),
                                dw.data(), s.T, s.K, D);
        float want_amax = 0.0f;
        for (float& v : dy) {
          if (dt == kBf16) v = testing::RoundBf16(v);
          want_amax = std::max(want_amax, std::abs(v));
        }
        DeviceBuffer gout = Upload(dout, dt), gy = Upload(y, dt), grow = UploadRaw(r.item_row),
                     gw = Upload(r.w, kF32), gdy(r.rows * D * 4 + 16), gdw(s.T * s.K * 4),
                     gamax(16);
        std::vector<float> runs[2];
        for (int rep = 0; rep < 2; ++rep) {
          cudaMemset(gdy.get(), 0, r.rows * D * 4 + 16);
          ASSERT_OK(MoeCombineBackward(gout.get(), gy.get(), grow.as<int32_t>(), gw.as<float>(),
                                       gdy.get(), gdw.as<float>(), s.T, s.K, D, dt, 0,
                                       gamax.as<float>()));
          ExpectClose(Download(gdy.get(), r.rows * D, dt), dy, dt, "dy");
          runs[rep] = Download(gdw.get(), s.T * s.K, kF32);
          ExpectClose(runs[rep], dw, kF32, "dw");
          EXPECT_EQ(DownloadAs<float>(gamax.get(), 1)[0], want_amax);
        }
        ExpectSameBits(runs[0], runs[1], "dw reruns");
      }
    }
  }
}

// ---- Grouped GEMMs -----------------------------------------------------------------------------

// Row offsets of G groups of random sizes (multiples of `align`, some empty).
std::vector<int64_t> RandomOffsets(std::mt19937& rng, int64_t G, int64_t align) {
  std::uniform_int_distribution<int> size(0, 6);
  std::vector<int64_t> off(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = (g % 3 == 1) ? 0 : size(rng) * align + (align == 1 ? size(rng) : 0);
    off[g + 1] = off[g] + m;
  }
  return off;
}

// out[rows, N] = in[rows, K] W_g^T per group, on the CPU (fp32).
void CpuGroupedForward(const std::vector<float>& A, const std::vector<float>& B,
                       std::vector<float>& C, const std::vector<int64_t>& off, int64_t N,
                       int64_t K) {
  const int64_t G = static_cast<int64_t>(off.size()) - 1;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) continue;
    cpu::Gemm(false, true, m, N, K, 1.0f, A.data() + off[g] * K, K, B.data() + g * N * K, K, 0.0f,
              C.data() + off[g] * N, N);
  }
}

// kPersistent runs its kernel where it takes the call (bf16 on sm_90, N and K multiples of 8,
// the weight gradient's offsets multiples of 64), the rest as kStreams.
const GroupedGemmMethod kMethods[] = {GroupedGemmMethod::kLoop, GroupedGemmMethod::kStreams,
                                      GroupedGemmMethod::kGroupedBatched,
                                      GroupedGemmMethod::kPersistent};

TEST_F(MoeCuda, GroupedGemmMatchesCpu) {
  for (DType dt : {kBf16, kF32}) {
    for (int64_t G : {5, 8}) {
      for (auto [N, K] : {std::pair<int64_t, int64_t>{32, 48}, {17, 37}, {48, 16}}) {
        const auto off = RandomOffsets(rng_, G, 1);
        const int64_t rows = off[G];
        SCOPED_TRACE(std::string(DTypeName(dt)) + " G " + std::to_string(G) + " N " +
                     std::to_string(N) + " K " + std::to_string(K) + " rows " +
                     std::to_string(rows) + Seed());
        auto A = Normal(rng_, rows * K), B = Normal(rng_, G * N * K, 0.2f),
             dC = Normal(rng_, rows * N), dA0 = Normal(rng_, rows * K);
        RoundTo(dt, A), RoundTo(dt, B), RoundTo(dt, dC), RoundTo(dt, dA0);
        const auto dB0 = Normal(rng_, G * N * K);
        std::vector<float> C(rows * N, 0.0f), dA(rows * K, 0.0f), dB = dB0;
        CpuGroupedForward(A, B, C, off, N, K);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t m = off[g + 1] - off[g];
          if (m == 0) continue;
          cpu::Gemm(false, false, m, K, N, 1.0f, dC.data() + off[g] * N, N, B.data() + g * N * K, K,
                    0.0f, dA.data() + off[g] * K, K);
          cpu::Gemm(true, false, N, K, m, 1.0f, dC.data() + off[g] * N, N, A.data() + off[g] * K, K,
                    1.0f, dB.data() + g * N * K, K);
        }
        std::vector<float> dA_acc = dA;
        for (size_t i = 0; i < dA_acc.size(); ++i) dA_acc[i] += dA0[i];
        DeviceBuffer gA = Upload(A, dt), gB = Upload(B, dt), gdC = Upload(dC, dt),
                     gC(rows * N * 4 + 16), gdA(rows * K * 4 + 16);
        std::vector<float> first_C;
        for (GroupedGemmMethod method : kMethods) {
          SCOPED_TRACE(GroupedGemmMethodName(method));
          std::unique_ptr<GroupedGemm> gg;
          ASSERT_OK(GroupedGemm::Create({method, 3}, &gg));
          ASSERT_OK(gg->Forward(gA.get(), gB.get(), gC.get(), off.data(), G, N, K, dt, 0));
          const auto got_C = Download(gC.get(), rows * N, dt);
          ExpectClose(got_C, C, dt, "C");
          if (method == GroupedGemmMethod::kLoop) first_C = got_C;
          if (method == GroupedGemmMethod::kStreams) ExpectSameBits(got_C, first_C, "streams C");
          ASSERT_OK(gg->BackwardData(gdC.get(), gB.get(), gdA.get(), off.data(), G, N, K, dt, 0));
          ExpectClose(Download(gdA.get(), rows * K, dt), dA, dt, "dA");
          DeviceBuffer acc = Upload(dA0, dt);
          ASSERT_OK(gg->BackwardData(gdC.get(), gB.get(), acc.get(), off.data(), G, N, K, dt, 0,
                                     /*accumulate=*/true));
          ExpectClose(Download(acc.get(), rows * K, dt), dA_acc, dt, "dA accumulated");
          DeviceBuffer gdB = Upload(dB0, kF32);
          ASSERT_OK(
              gg->BackwardWeight(gdC.get(), gA.get(), gdB.as<float>(), off.data(), G, N, K, dt, 0));
          // bf16 inputs are exact in fp32: only the accumulation order differs from the CPU's.
          ExpectClose(Download(gdB.get(), G * N * K, kF32), dB, kF32, "dB", 4.0);
        }
      }
    }
  }
}

// The FP8 roles on codes made by the project's producers: activations gathered and quantized
// (GatherRowsFp8, E4M3), weights cast per expert (Fp8CastWeights, E4M3, both layouts), output
// gradients quantized whole (Fp8Quantize, E5M2, both layouts). Each against the fp32 product of
// the dequantized codes.
TEST_F(MoeCuda, GroupedGemmFp8MatchesCpuOnCodes) {
  for (GroupedGemmMethod method : {GroupedGemmMethod::kLoop, GroupedGemmMethod::kStreams}) {
    for (auto [N, K] : {std::pair<int64_t, int64_t>{32, 48}, {48, 16}}) {
      const int64_t G = 8, T = 37, topk = 2;
      SCOPED_TRACE(std::string(GroupedGemmMethodName(method)) + " N " + std::to_string(N) + " K " +
                   std::to_string(K) + Seed());
      // Activations x [T, K] gathered into groups of 16-multiples.
      auto x = Normal(rng_, T * K);
      RoundTo(kBf16, x);
      const auto keys = SkewedKeys(rng_, T * topk, G);
      std::vector<int64_t> counts(G), off(G + 1);
      std::vector<int32_t> item_row(keys.size()), row_source(T * topk + G * 15);
      cpu::MoeGroupRows(keys.data(), T * topk, topk, G, 16, counts.data(), off.data(),
                        item_row.data(), row_source.data());
      const int64_t rows = off[G];
      std::vector<float> gathered(rows * K);
      cpu::GatherRows(x.data(), row_source.data(), gathered.data(), rows, K);
      const float x_amax = cpu::AbsMax(gathered.data(), rows * K);
      const cpu::Fp8Scale xs = cpu::TensorwiseScale(x_amax, cpu::Fp8Format::kE4M3);
      std::vector<float> xq(rows * K);  // dequantized
      for (size_t i = 0; i < xq.size(); ++i) {
        xq[i] = cpu::RoundToFp8(gathered[i] * xs.scale, cpu::Fp8Format::kE4M3) * xs.inverse;
      }
      // Weights [G, N, K], each expert its own scale.
      const auto W = Normal(rng_, G * N * K, 0.05f);
      std::vector<float> wq(W.size());
      for (int64_t g = 0; g < G; ++g) {
        const float* wg = W.data() + g * N * K;
        const cpu::Fp8Scale ws =
            cpu::TensorwiseScale(cpu::AbsMax(wg, N * K), cpu::Fp8Format::kE4M3);
        for (int64_t i = 0; i < N * K; ++i) {
          wq[g * N * K + i] = cpu::RoundToFp8(wg[i] * ws.scale, cpu::Fp8Format::kE4M3) * ws.inverse;
        }
      }
      // Output gradients [rows, N] (zero on padding rows, as the combine's backward leaves them
      // after a memset).
      auto dy = Normal(rng_, rows * N, 1e-3f);
      for (int64_t r = 0; r < rows; ++r) {
        if (row_source[r] < 0) std::fill(dy.begin() + r * N, dy.begin() + (r + 1) * N, 0.0f);
      }
      RoundTo(kBf16, dy);
      const cpu::Fp8Scale gs =
          cpu::TensorwiseScale(cpu::AbsMax(dy.data(), rows * N), cpu::Fp8Format::kE5M2);
      std::vector<float> dyq(dy.size());
      for (size_t i = 0; i < dy.size(); ++i) {
        dyq[i] = cpu::RoundToFp8(dy[i] * gs.scale, cpu::Fp8Format::kE5M2) * gs.inverse;
      }
      std::vector<float> C(rows * N, 0.0f), dA(rows * K, 0.0f), dB(G * N * K, 0.0f);
      CpuGroupedForward(xq, wq, C, off, N, K);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = off[g + 1] - off[g];
        if (m == 0) continue;
        cpu::Gemm(false, false, m, K, N, 1.0f, dyq.data() + off[g] * N, N, wq.data() + g * N * K, K,
                  0.0f, dA.data() + off[g] * K, K);
        cpu::Gemm(true, false, N, K, m, 1.0f, dyq.data() + off[g] * N, N, xq.data() + off[g] * K, K,
                  0.0f, dB.data() + g * N * K, K);
      }
      // Device side.
      DeviceBuffer gx = Upload(x, kBf16), gsrc = UploadRaw(row_source), xc(rows * K + 16),
                   xct(rows * K + 16), gW = Upload(W, kF32), wc(G * N * K + 16),
                   wct(G * N * K + 16), wscal(G * 16 * 4), xscal(64), gdy = Upload(dy, kBf16),
                   dyc(rows * N + 16), dyct(rows * N + 16), dscal(64), gC(rows * N * 2 + 16),
                   gdA(rows * K * 2 + 16), gdB(G * N * K * 4);
      cudaMemcpy(xscal.get(), &x_amax, 4, cudaMemcpyHostToDevice);
      Fp8Output xo{
          DType::kFp8E4M3,      xc.get(), xct.get(), xscal.as<float>(), xscal.as<float>() + 4,
          xscal.as<float>() + 8};
      ASSERT_OK(GatherRowsFp8(gx.get(), gsrc.as<int32_t>(), rows, K, kBf16, xo, 0));
      std::vector<Fp8WeightCast> casts(G);
      float* ws = wscal.as<float>();  // expert g: amax, scale at g*16 + 8, inverse at g*16 + 4
      for (int64_t g = 0; g < G; ++g) {
        casts[g].master = gW.as<float>() + g * N * K;
        casts[g].rows = N, casts[g].cols = K;
        casts[g].out = {DType::kFp8E4M3,
                        static_cast<uint8_t*>(wc.get()) + g * N * K,
                        static_cast<uint8_t*>(wct.get()) + g * N * K,
                        ws + g * 16,
                        ws + g * 16 + 8,
                        ws + g * 16 + 4};
      }
      ASSERT_OK(Fp8CastWeights(casts.data(), G, 0));
      Fp8Output dyo{
          DType::kFp8E5M2,      dyc.get(), dyct.get(), dscal.as<float>(), dscal.as<float>() + 4,
          dscal.as<float>() + 8};
      ASSERT_OK(Fp8Quantize(gdy.get(), rows, N, kBf16, dyo, 0));
      const Fp8Experts w_codes{wc.get(), DType::kFp8E4M3, ws + 4, 16};
      const Fp8Experts w_codes_t{wct.get(), DType::kFp8E4M3, ws + 4, 16};
      std::unique_ptr<GroupedGemm> gg;
      ASSERT_OK(GroupedGemm::Create({method, 3}, &gg));
      ASSERT_OK(gg->ForwardFp8({xc.get(), DType::kFp8E4M3, xo.inverse_scale}, w_codes, gC.get(),
                               kBf16, off.data(), G, N, K, 0));
      ExpectClose(Download(gC.get(), rows * N, kBf16), C, kBf16, "C");
      ASSERT_OK(gg->BackwardDataFp8({dyc.get(), DType::kFp8E5M2, dyo.inverse_scale}, w_codes_t,
                                    gdA.get(), kBf16, off.data(), G, N, K, 0));
      ExpectClose(Download(gdA.get(), rows * K, kBf16), dA, kBf16, "dA");
      cudaMemset(gdB.get(), 0, G * N * K * 4);
      ASSERT_OK(gg->BackwardWeightFp8({dyct.get(), DType::kFp8E5M2, dyo.inverse_scale},
                                      {xct.get(), DType::kFp8E4M3, xo.inverse_scale},
                                      gdB.as<float>(), off.data(), G, N, K, 0));
      ExpectClose(Download(gdB.get(), G * N * K, kF32), dB, kF32, "dB", 4.0);
    }
  }
}

TEST_F(MoeCuda, ArgumentErrors) {
  DeviceBuffer buf(1024);
  EXPECT_EQ(MoeRouterForward(buf.as<float>(), buf.as<float>(), buf.as<int32_t>(), buf.as<float>(),
                             nullptr, 4, 4, 5, 0)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MoeRouterBackward(buf.as<float>(), buf.as<int32_t>(), buf.as<float>(), nullptr, 0.1f,
                              buf.as<float>(), 4, 4, 2, 0)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MoeGroupRows(buf.as<int32_t>(), 10, 2, 4, 16, buf.as<int64_t>(), buf.as<int64_t>(),
                         buf.as<int32_t>(), buf.as<int32_t>(), 20, nullptr, {buf.get(), 1024}, 0)
                .code(),
            StatusCode::kInvalidArgument);
  Fp8Output q{DType::kFp8E4M3, buf.get(), nullptr, buf.as<float>(), nullptr, buf.as<float>()};
  EXPECT_EQ(GatherRowsFp8(buf.get(), buf.as<int32_t>(), 17, 16, kBf16, q, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(GatherRows(buf.get(), buf.as<int32_t>(), buf.get(), 1, 1, DType::kFloat16, 0).code(),
            StatusCode::kUnsupported);
  std::unique_ptr<GroupedGemm> gg;
  ASSERT_OK(GroupedGemm::Create({GroupedGemmMethod::kLoop, 1}, &gg));
  const int64_t off[3] = {0, 8, 24};
  EXPECT_EQ(gg->ForwardFp8({buf.get(), DType::kFp8E4M3, buf.as<float>()},
                           {buf.get(), DType::kFp8E4M3, buf.as<float>(), 4}, buf.get(), kBf16, off,
                           2, 16, 16, 0)
                .code(),
            StatusCode::kInvalidArgument);
  const int64_t bad[3] = {0, 8, 4};
  EXPECT_EQ(gg->Forward(buf.get(), buf.get(), buf.get(), bad, 2, 4, 4, kBf16, 0).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace spindle::kernels::cuda
