// GroupedGemmMethod::kPersistent (the persistent TMA + wgmma kernel, kernels/cuda/moe_gemm_sm90.h)
// on fresh random bf16 inputs, every role (Forward, BackwardData with and without accumulation,
// BackwardWeight into a nonzero fp32 gradient), against the cuBLASLt loop (every output) and an
// fp64 host reference (up to 3000 sampled outputs a tensor), on the moe preset's shapes (W1 | W3:
// N 512, K 2048; W2: N 2048, K 256) and small ones (N, K in {64, 192}), groups of multiples of 64
// rows with empty ones and one huge one (3072 rows), and 64 experts. Also: reruns bitwise equal,
// and the shapes the kernel refuses (fp32, N not a multiple of 8, a weight gradient whose group
// offsets are not multiples of 64) running as kStreams, bitwise equal to it.
//
// Tolerances, with ref the fp64 result and |a||b| the sum of the absolute products of an output:
//  - bf16 outputs: |got - ref| <= 2^-8 |ref| + 1e-4 |a||b| (one bf16 rounding, at most half an
//    ulp = 2^-9 relative, doubled; fp32 accumulation in any order, ~2^-24 a term, far below 1e-4);
//  - fp32 weight gradients: |got - ref| <= 1e-6 |ref| + 1e-4 |a||b|;
//  - against cuBLASLt (both fp32 accumulations, rounded once): |got - lt| <= 2^-7 |lt| + 1e-3
//    rms(lt) for bf16 (an ulp apart where the sums straddle a rounding boundary), 1e-5 |lt| +
//    1e-4 rms(lt) for fp32.
// GPU-only: skips without a device; the kernel's own tests skip where it does not run (not sm_90).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_gemm_sm90.h"
#include "tests/cuda/cuda_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::DeviceBuffer;
using testing::Download;
using testing::ExpectSameBits;
using testing::FreshSeed;
using testing::Normal;
using testing::RoundTo;
using testing::Upload;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBf16 = DType::kBFloat16;

class PersistentGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    SPINDLE_REQUIRE_GPU();
    seed_ = FreshSeed();
    rng_.seed(seed_);
  }
  std::string Seed() const { return " (seed " + std::to_string(seed_) + ")"; }
  // A kPersistent GroupedGemm whose kernel runs here, or null (the caller then skips).
  std::unique_ptr<GroupedGemm> MakePersistent() {
    std::unique_ptr<GroupedGemm> gg;
    const Status s = GroupedGemm::Create({GroupedGemmMethod::kPersistent, 2}, &gg);
    EXPECT_TRUE(s.ok()) << s.message();
    if (!s.ok() || !gg->persistent_kernel()) return nullptr;
    return gg;
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

std::vector<int64_t> Offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) off[g + 1] = off[g] + sizes[g];
  return off;
}

// G random group sizes, multiples of 64 in [0, 64 * max_blocks], every third group empty.
std::vector<int64_t> RandomSizes(std::mt19937& rng, int64_t G, int max_blocks) {
  std::uniform_int_distribution<int> blocks(1, max_blocks);
  std::vector<int64_t> s(G);
  for (int64_t g = 0; g < G; ++g) s[g] = g % 3 == 1 ? 0 : 64 * blocks(rng);
  return s;
}

double Rms(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return x.empty() ? 0.0 : std::sqrt(s / x.size());
}

// Every output of `got` against cuBLASLt's `lt` (tolerances in the file comment).
void ExpectNearLt(const std::vector<float>& got, const std::vector<float>& lt, DType t,
                  const std::string& what) {
  ASSERT_EQ(got.size(), lt.size());
  const double rms = Rms(lt);
  const double rel = t == kBf16 ? 1.0 / 128 : 1e-5, abs = t == kBf16 ? 1e-3 : 1e-4;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - lt[i]);
    if (!(err <= rel * std::abs(lt[i]) + abs * rms)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size()
                    << " outputs off cuBLASLt's, first at " << first << ": "
                    << (first >= 0 ? got[first] : 0.0f) << " vs "
                    << (first >= 0 ? lt[first] : 0.0f);
}

// The problem on the host (bf16-exact values in fp32) and its fp64 reference at an output.
struct Problem {
  std::vector<int64_t> off;
  int64_t G = 0, N = 0, K = 0, rows = 0;
  std::vector<float> A, W, dC, dA0, dB0;  // A [rows, K], W [G, N, K], dC [rows, N]
  int64_t GroupOf(int64_t r) const {
    return static_cast<int64_t>(std::upper_bound(off.begin(), off.end(), r) - off.begin()) - 1;
  }
};

Problem MakeProblem(std::mt19937& rng, const std::vector<int64_t>& sizes, int64_t N, int64_t K) {
  Problem p;
  p.off = Offsets(sizes);
  p.G = static_cast<int64_t>(sizes.size()), p.N = N, p.K = K, p.rows = p.off.back();
  p.A = Normal(rng, p.rows * K), p.W = Normal(rng, p.G * N * K, 0.05f);
  p.dC = Normal(rng, p.rows * N), p.dA0 = Normal(rng, p.rows * K);
  p.dB0 = Normal(rng, p.G * N * K);
  RoundTo(kBf16, p.A), RoundTo(kBf16, p.W), RoundTo(kBf16, p.dC), RoundTo(kBf16, p.dA0);
  return p;
}

// Up to 3000 outputs (all when fewer) of an [n_out] tensor: index i, fp64 value and |a||b|
// from `ref(i, &value, &absdot)`; each against got[i] within rel |value| + abs |a||b| (+ the
// bf16 rounding of `base`, the accumulated-into value, when given).
template <typename Ref>
void ExpectNearFp64(const std::vector<float>& got, int64_t n_out, double rel, double abs,
                    std::mt19937& rng, const std::string& what, Ref ref) {
  std::vector<int64_t> idx;
  if (n_out <= 3000) {
    for (int64_t i = 0; i < n_out; ++i) idx.push_back(i);
  } else {
    std::uniform_int_distribution<int64_t> pick(0, n_out - 1);
    for (int i = 0; i < 3000; ++i) idx.push_back(pick(rng));
  }
  int64_t bad = 0;
  std::string first;
  for (int64_t i : idx) {
    double value = 0.0, absdot = 0.0;
    ref(i, &value, &absdot);
    const double err = std::abs(static_cast<double>(got[i]) - value);
    if (!(err <= rel * std::abs(value) + abs * absdot)) {
      if (bad == 0) {
        first = "output " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs fp64 " +
                std::to_string(value) + " (|a||b| " + std::to_string(absdot) + ")";
      }
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << idx.size() << " sampled outputs off; "
                    << first;
}

// Runs the three roles on `gg` and on a cuBLASLt loop and checks them (file comment).
void CheckAllRoles(GroupedGemm& gg, const Problem& p, std::mt19937& rng) {
  const int64_t G = p.G, N = p.N, K = p.K, rows = p.rows;
  std::unique_ptr<GroupedGemm> loop;
  ASSERT_OK(GroupedGemm::Create({GroupedGemmMethod::kLoop, 1}, &loop));
  DeviceBuffer gA = Upload(p.A, kBf16), gW = Upload(p.W, kBf16), gdC = Upload(p.dC, kBf16);
  const int64_t* off = p.off.data();
  constexpr double kBfRel = 1.0 / 256, kAbs = 1e-4;

  {  // Forward: C [rows, N] = A_g W_g^T.
    DeviceBuffer c1(rows * N * 2 + 16), c2(rows * N * 2 + 16);
    ASSERT_OK(gg.Forward(gA.get(), gW.get(), c1.get(), off, G, N, K, kBf16, 0));
    ASSERT_OK(loop->Forward(gA.get(), gW.get(), c2.get(), off, G, N, K, kBf16, 0));
    const auto got = Download(c1.get(), rows * N, kBf16);
    ExpectNearLt(got, Download(c2.get(), rows * N, kBf16), kBf16, "forward vs cuBLASLt");
    ExpectNearFp64(got, rows * N, kBfRel, kAbs, rng, "forward vs fp64",
                   [&](int64_t i, double* v, double* ad) {
                     const int64_t r = i / N, n = i % N, g = p.GroupOf(r);
                     for (int64_t k = 0; k < K; ++k) {
                       const double t = double(p.A[r * K + k]) * p.W[(g * N + n) * K + k];
                       *v += t, *ad += std::abs(t);
                     }
                   });
    // A rerun writes the same bits.
    ASSERT_OK(gg.Forward(gA.get(), gW.get(), c2.get(), off, G, N, K, kBf16, 0));
    ExpectSameBits(Download(c2.get(), rows * N, kBf16), got, "forward rerun");
  }
  for (bool accumulate : {false, true}) {  // BackwardData: dA [rows, K] (+)= dC_g W_g.
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    DeviceBuffer a1 = Upload(p.dA0, kBf16), a2 = Upload(p.dA0, kBf16);
    ASSERT_OK(gg.BackwardData(gdC.get(), gW.get(), a1.get(), off, G, N, K, kBf16, 0, accumulate));
    ASSERT_OK(
        loop->BackwardData(gdC.get(), gW.get(), a2.get(), off, G, N, K, kBf16, 0, accumulate));
    const auto got = Download(a1.get(), rows * K, kBf16);
    ExpectNearLt(got, Download(a2.get(), rows * K, kBf16), kBf16, "backward data vs cuBLASLt");
    ExpectNearFp64(got, rows * K, kBfRel, kAbs, rng, "backward data vs fp64",
                   [&](int64_t i, double* v, double* ad) {
                     const int64_t r = i / K, k = i % K, g = p.GroupOf(r);
                     if (accumulate) *v = p.dA0[i], *ad = std::abs(p.dA0[i]);
                     for (int64_t n = 0; n < N; ++n) {
                       const double t = double(p.dC[r * N + n]) * p.W[(g * N + n) * K + k];
                       *v += t, *ad += std::abs(t);
                     }
                   });
  }
  {  // BackwardWeight: dB [G, N, K] += dC_g^T A_g (fp32); empty groups untouched.
    DeviceBuffer b1 = Upload(p.dB0, kF32), b2 = Upload(p.dB0, kF32);
    ASSERT_OK(gg.BackwardWeight(gdC.get(), gA.get(), b1.as<float>(), off, G, N, K, kBf16, 0));
    ASSERT_OK(loop->BackwardWeight(gdC.get(), gA.get(), b2.as<float>(), off, G, N, K, kBf16, 0));
    const auto got = Download(b1.get(), G * N * K, kF32);
    ExpectNearLt(got, Download(b2.get(), G * N * K, kF32), kF32, "weight gradient vs cuBLASLt");
    ExpectNearFp64(got, G * N * K, 1e-6, kAbs, rng, "weight gradient vs fp64",
                   [&](int64_t i, double* v, double* ad) {
                     const int64_t g = i / (N * K), n = (i / K) % N, k = i % K;
                     *v = p.dB0[i], *ad = std::abs(p.dB0[i]);
                     for (int64_t r = p.off[g]; r < p.off[g + 1]; ++r) {
                       const double t = double(p.dC[r * N + n]) * p.A[r * K + k];
                       *v += t, *ad += std::abs(t);
                     }
                   });
    for (int64_t g = 0; g < G; ++g) {
      if (p.off[g + 1] != p.off[g]) continue;
      for (int64_t i = g * N * K; i < (g + 1) * N * K; ++i) {
        ASSERT_EQ(got[i], p.dB0[i]) << "empty group " << g << " changed at " << i;
      }
    }
  }
}

TEST_F(PersistentGemm, PresetShapesMatchCublasLtAndFp64) {
  auto gg = MakePersistent();
  if (gg == nullptr) GTEST_SKIP() << "the persistent kernel does not run on this device or build";
  // Empty groups, one huge group (3072 rows: 24 tiles of 128 rows), odd multiples of 64.
  const std::vector<int64_t> sizes = {64, 0, 3072, 192, 0, 320};
  for (auto [N, K] : {std::pair<int64_t, int64_t>{512, 2048}, {2048, 256}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K) + Seed());
    CheckAllRoles(*gg, MakeProblem(rng_, sizes, N, K), rng_);
  }
}

TEST_F(PersistentGemm, SmallShapesAndManyGroupsMatchCublasLtAndFp64) {
  auto gg = MakePersistent();
  if (gg == nullptr) GTEST_SKIP() << "the persistent kernel does not run on this device or build";
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 192}, {192, 64}, {64, 64}, {192, 192}}) {
    for (int64_t G : {1, 9, 64}) {
      auto sizes = RandomSizes(rng_, G, 5);
      if (G == 1) sizes = {64 * 7};
      SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K) + " G " +
                   std::to_string(G) + Seed());
      CheckAllRoles(*gg, MakeProblem(rng_, sizes, N, K), rng_);
    }
  }
}

// Forward and backward-data take group offsets that are not multiples of 64 (a tile's rows past
// its group are never stored); only the weight gradient needs them.
TEST_F(PersistentGemm, ForwardTakesUnalignedGroups) {
  auto gg = MakePersistent();
  if (gg == nullptr) GTEST_SKIP() << "the persistent kernel does not run on this device or build";
  const std::vector<int64_t> sizes = {17, 0, 200, 1, 129};
  const Problem p = MakeProblem(rng_, sizes, 192, 64);
  SCOPED_TRACE(Seed());
  std::unique_ptr<GroupedGemm> loop;
  ASSERT_OK(GroupedGemm::Create({GroupedGemmMethod::kLoop, 1}, &loop));
  DeviceBuffer gA = Upload(p.A, kBf16), gW = Upload(p.W, kBf16);
  DeviceBuffer c1(p.rows * p.N * 2 + 16), c2(p.rows * p.N * 2 + 16);
  ASSERT_OK(gg->Forward(gA.get(), gW.get(), c1.get(), p.off.data(), p.G, p.N, p.K, kBf16, 0));
  ASSERT_OK(loop->Forward(gA.get(), gW.get(), c2.get(), p.off.data(), p.G, p.N, p.K, kBf16, 0));
  ExpectNearLt(Download(c1.get(), p.rows * p.N, kBf16), Download(c2.get(), p.rows * p.N, kBf16),
               kBf16, "forward, unaligned groups");
}

// What the kernel refuses runs as kStreams: the same cuBLASLt calls, so the same bits.
TEST_F(PersistentGemm, RefusedShapesRunAsStreams) {
  std::unique_ptr<GroupedGemm> pers, streams;
  ASSERT_OK(GroupedGemm::Create({GroupedGemmMethod::kPersistent, 2}, &pers));
  ASSERT_OK(GroupedGemm::Create({GroupedGemmMethod::kStreams, 2}, &streams));
  SCOPED_TRACE(Seed());
  struct Case {
    std::vector<int64_t> sizes;
    int64_t N, K;
    DType dt;
    const char* what;
  };
  const Case cases[] = {{{64, 0, 128}, 64, 64, kF32, "fp32"},
                        {{64, 0, 128}, 36, 64, kBf16, "N not a multiple of 8"},
                        {{48, 16, 0, 80}, 64, 192, kBf16, "offsets multiples of 16, not 64"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = MakeProblem(rng_, c.sizes, c.N, c.K);
    const int64_t G = p.G, N = p.N, K = p.K, rows = p.rows;
    DeviceBuffer gA = Upload(p.A, c.dt), gW = Upload(p.W, c.dt), gdC = Upload(p.dC, c.dt);
    DeviceBuffer b1 = Upload(p.dB0, kF32), b2 = Upload(p.dB0, kF32);
    ASSERT_OK(
        pers->BackwardWeight(gdC.get(), gA.get(), b1.as<float>(), p.off.data(), G, N, K, c.dt, 0));
    ASSERT_OK(streams->BackwardWeight(gdC.get(), gA.get(), b2.as<float>(), p.off.data(), G, N, K,
                                      c.dt, 0));
    ExpectSameBits(Download(b1.get(), G * N * K, kF32), Download(b2.get(), G * N * K, kF32),
                   "weight gradient");
    if (c.dt == kBf16 && c.N % 8 != 0) {
      DeviceBuffer c1(rows * N * 2 + 16), c2(rows * N * 2 + 16);
      ASSERT_OK(pers->Forward(gA.get(), gW.get(), c1.get(), p.off.data(), G, N, K, c.dt, 0));
      ASSERT_OK(streams->Forward(gA.get(), gW.get(), c2.get(), p.off.data(), G, N, K, c.dt, 0));
      ExpectSameBits(Download(c1.get(), rows * N, c.dt), Download(c2.get(), rows * N, c.dt),
                     "forward");
    }
  }
}

// The kernel's refusals are kUnsupported with the reason, and change nothing.
TEST_F(PersistentGemm, SupportsNamesWhatItRefuses) {
  std::unique_ptr<internal::PersistentGroupedGemm> k;
  const Status created = internal::PersistentGroupedGemm::Create(&k);
  if (!created.ok()) {
    EXPECT_EQ(created.code(), StatusCode::kUnsupported) << created.message();
    GTEST_SKIP() << created.message();
  }
  DeviceBuffer buf(1 << 20);
  const std::vector<int64_t> off = {0, 64, 128}, off16 = {0, 48, 128};
  char* base = buf.as<char>();
  internal::PersistentGemmArgs a;
  a.role = internal::PersistentRole::kBackwardWeight;
  a.a = base, a.b = base + 4096, a.c = base + 8192, a.offsets = off.data(), a.G = 2, a.N = 64,
  a.K = 64;
  EXPECT_TRUE(k->Supports(a).ok()) << k->Supports(a).message();
  auto refused = [&](internal::PersistentGemmArgs b, const char* needle) {
    const Status s = k->Supports(b);
    EXPECT_EQ(s.code(), StatusCode::kUnsupported) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_EQ(k->Run(b, 0).code(), StatusCode::kUnsupported) << needle;
  };
  auto b = a;
  b.offsets = off16.data();
  refused(b, "multiple of 64");
  b = a, b.N = 36;
  refused(b, "multiples of 8");
  b = a, b.a = base + 2;
  refused(b, "aligned");
  b = a, b.G = 2000;
  refused(b, "groups");
}

}  // namespace
}  // namespace spindle::kernels::cuda
