// Tests of the CPU dense kernels (kernels/cpu/ops.h): every forward against an fp64 reference
// written here, every backward against central finite differences of that reference, on odd
// shapes with fresh random inputs (the seed is printed on failure; SPINDLE_TEST_SEED replays it).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

// Tolerances: |got - want| <= atol + rtol * |want| elementwise, with `want` from fp64.
// Forwards are a few fp32 roundings away from the exact value.
constexpr double kFwdAtol = 1e-5;
constexpr double kFwdRtol = 1e-5;
// Backwards accumulate more fp32 roundings (reductions over a row); the fp64 finite
// differences themselves are accurate to ~1e-9.
constexpr double kBwdAtol = 1e-4;
constexpr double kBwdRtol = 1e-4;

uint64_t PickSeed() {
  if (const char* env = std::getenv("SPINDLE_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

class DenseOpsTest : public ::testing::Test {
 protected:
  DenseOpsTest() : seed_(PickSeed()), rng_(seed_) {}

  std::string SeedTrace() const { return "SPINDLE_TEST_SEED=" + std::to_string(seed_); }

  Vec Uniform(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    Vec v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  Vec Normal(int64_t n, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    Vec v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::vector<int32_t> Ints(int64_t n, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> dist(lo, hi);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = dist(rng_);
    return v;
  }

  uint64_t seed_;
  std::mt19937_64 rng_;
};

DVec ToDouble(const Vec& v) { return DVec(v.begin(), v.end()); }

// Elementwise closeness; written so that a NaN or inf on either side fails.
void ExpectClose(const Vec& got, const DVec& want, double atol, double rtol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  int64_t first_bad = -1;
  double max_err = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const bool ok = err <= atol + rtol * std::abs(want[i]);  // false for NaN
    if (!ok) {
      if (first_bad < 0) first_bad = static_cast<int64_t>(i);
      ++bad;
    }
    if (!(err <= max_err)) max_err = err;  // keeps NaN visible
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off, first at "
                    << first_bad << " (got " << (first_bad >= 0 ? got[first_bad] : 0.0f)
                    << ", want " << (first_bad >= 0 ? want[first_bad] : 0.0) << "), max error "
                    << max_err;
}

void ExpectBitwiseEqual(const Vec& a, const Vec& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  EXPECT_EQ(bad, 0) << what << ": results differ between runs";
}

// Central differences of a scalar fp64 function with respect to each element of x.
DVec NumericGrad(const std::function<double(const DVec&)>& f, DVec x) {
  DVec grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    const double h = 1e-6 * std::max(1.0, std::abs(x0));
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    grad[i] = (fp - fm) / (2.0 * h);
  }
  return grad;
}

double Dot(const DVec& a, const DVec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

DVec Add(const Vec& base, const DVec& delta) {
  DVec out(base.size());
  for (size_t i = 0; i < base.size(); ++i) out[i] = base[i] + delta[i];
  return out;
}

// ---- fp64 references ---------------------------------------------------------------------------

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

DVec RefRmsNorm(const DVec& x, const DVec& w, int64_t rows, int64_t D, double eps,
                DVec* rstd = nullptr) {
  DVec y(rows * D);
  if (rstd) rstd->assign(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t j = 0; j < D; ++j) ss += x[r * D + j] * x[r * D + j];
    const double s = 1.0 / std::sqrt(ss / D + eps);
    if (rstd) (*rstd)[r] = s;
    for (int64_t j = 0; j < D; ++j) y[r * D + j] = x[r * D + j] * s * w[j];
  }
  return y;
}

DVec RefGroupNormGate(const DVec& o, const DVec& w, const DVec& gate, int64_t T, int64_t H,
                      int64_t Dh, double eps, DVec* rstd = nullptr) {
  const int64_t C = H * Dh;
  DVec y(T * C);
  if (rstd) rstd->assign(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = t * C + h * Dh;
      double ss = 0.0;
      for (int64_t j = 0; j < Dh; ++j) ss += o[off + j] * o[off + j];
      const double s = 1.0 / std::sqrt(ss / Dh + eps);
      if (rstd) (*rstd)[t * H + h] = s;
      for (int64_t j = 0; j < Dh; ++j) {
        y[off + j] = o[off + j] * s * w[h * Dh + j] * Sigmoid(gate[off + j]);
      }
    }
  }
  return y;
}

DVec RefLinear(const DVec& x, const DVec& W, int64_t T, int64_t in, int64_t out) {
  DVec y(T * out, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * W[o * in + i];
      y[t * out + o] = s;
    }
  }
  return y;
}

DVec RefSwiGlu(const DVec& g, const DVec& u) {
  DVec y(g.size());
  for (size_t i = 0; i < g.size(); ++i) y[i] = g[i] * Sigmoid(g[i]) * u[i];
  return y;
}

// Rotate-half RoPE of a dense [T, H, d] tensor.
DVec RefRope(const DVec& x, const std::vector<int32_t>& pos, int64_t T, int64_t H, int64_t d,
             double theta) {
  DVec y(x);
  const int64_t half = d / 2;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < half; ++j) {
        const double angle = pos[t] * std::pow(theta, -2.0 * j / d);
        const int64_t i0 = (t * H + h) * d + j;
        const double a = x[i0];
        const double b = x[i0 + half];
        y[i0] = a * std::cos(angle) - b * std::sin(angle);
        y[i0 + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
  }
  return y;
}

// Per-row loss (0 for ignored rows).
DVec RefCrossEntropyRows(const DVec& logits, const std::vector<int32_t>& targets, int64_t T,
                         int64_t V) {
  DVec loss(T, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (targets[t] < 0) continue;
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, logits[t * V + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[t * V + j] - mx);
    loss[t] = std::log(sum) + mx - logits[t * V + targets[t]];
  }
  return loss;
}

double Sum(const DVec& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return s;
}

// ---- FastExp ------------------------------------------------------------------------------------

TEST_F(DenseOpsTest, FastExpMatchesStdExp) {
  SCOPED_TRACE(SeedTrace());
  Vec x = Uniform(100000, -87.0f, 88.0f);
  // Also the edges and a dense sweep of the range that matters for softmax and sigmoid.
  for (float v = -20.0f; v <= 20.0f; v += 1e-3f) x.push_back(v);
  x.push_back(0.0f);
  x.push_back(-0.0f);
  Vec got(x.size());
  for (size_t i = 0; i < x.size(); ++i) got[i] = internal::FastExp(x[i]);
  DVec want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = std::exp(static_cast<double>(x[i]));
  ExpectClose(got, want, 0.0, 3e-7, "FastExp");  // about 2.5 ulp
}

TEST_F(DenseOpsTest, FastExpSaturatesAndPropagatesNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_GE(internal::FastExp(-inf), 0.0f);
  EXPECT_LT(internal::FastExp(-inf), 1e-37f);
  EXPECT_LT(internal::FastExp(-1e30f), 1e-37f);
  EXPECT_GT(internal::FastExp(1e30f), 1e38f);
  EXPECT_TRUE(std::isfinite(internal::FastExp(inf)));
  EXPECT_TRUE(std::isnan(internal::FastExp(nan)));
  EXPECT_TRUE(std::isnan(internal::FastExp(-nan)));
  EXPECT_EQ(internal::FastSigmoid(1e4f), 1.0f);
  EXPECT_LT(internal::FastSigmoid(-1e4f), 1e-37f);
  EXPECT_GE(internal::FastSigmoid(-1e4f), 0.0f);
}

// ---- Embedding ----------------------------------------------------------------------------------

TEST_F(DenseOpsTest, EmbeddingForwardCopiesRows) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 17, D = 37, vocab = 127;
  const Vec table = Uniform(vocab * D);
  const auto ids = Ints(T, 0, vocab - 1);
  Vec out(T * D, std::numeric_limits<float>::quiet_NaN());
  EmbeddingForward(ids.data(), table.data(), out.data(), T, D);
  DVec want(T * D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < D; ++j) want[t * D + j] = table[ids[t] * D + j];
  }
  ExpectClose(out, want, 0.0, 0.0, "embedding out");
}

// Many tokens over a small vocabulary, so every row of dtable receives many repeated ids; D
// spans several column blocks. Accumulates onto a non-zero dtable.
TEST_F(DenseOpsTest, EmbeddingBackwardAccumulatesRepeatedIds) {
  SCOPED_TRACE(SeedTrace());
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {17, 37, 127}, {4099, 301, 7}, {1000, 1031, 3}};
  for (const auto& [T, D, vocab] : shapes) {
    SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D));
    const auto ids = Ints(T, 0, static_cast<int32_t>(vocab - 1));
    const Vec dout = Uniform(T * D);
    const Vec dtable0 = Uniform(vocab * D);
    DVec want = ToDouble(dtable0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < D; ++j) want[ids[t] * D + j] += dout[t * D + j];
    }
    Vec dtable = dtable0;
    EmbeddingBackward(ids.data(), dout.data(), dtable.data(), T, D, vocab);
    // Up to ~4000 fp32 additions of values in [-1, 1] per element.
    ExpectClose(dtable, want, 1e-3, 1e-5, "dtable");
    // Deterministic across runs and thread counts.
    Vec again = dtable0;
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    EmbeddingBackward(ids.data(), dout.data(), again.data(), T, D, vocab);
    omp_set_num_threads(threads);
    ExpectBitwiseEqual(dtable, again, "dtable 1 thread vs default");
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

struct NormShape {
  int64_t rows, D;
};

TEST_F(DenseOpsTest, RmsNormForwardBackward) {
  SCOPED_TRACE(SeedTrace());
  const float eps = 1e-6f;
  // Model norm shape, per-head q/k norm shape (rows = T*H, D = Dh), and a wide row.
  for (const NormShape s : {NormShape{17, 37}, NormShape{17 * 3, 13}, NormShape{5, 131}}) {
    SCOPED_TRACE("rows=" + std::to_string(s.rows) + " D=" + std::to_string(s.D));
    const int64_t n = s.rows * s.D;
    const Vec x = Normal(n);
    const Vec w = Uniform(s.D, 0.5f, 1.5f);
    const Vec dy = Normal(n);
    Vec y(n), rstd(s.rows);
    RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), s.rows, s.D, eps);
    DVec rstd_ref;
    const DVec y_ref = RefRmsNorm(ToDouble(x), ToDouble(w), s.rows, s.D, eps, &rstd_ref);
    ExpectClose(y, y_ref, kFwdAtol, kFwdRtol, "y");
    ExpectClose(rstd, rstd_ref, 0.0, kFwdRtol, "rstd");

    const Vec dw0 = Uniform(s.D);
    Vec dx(n), dw = dw0;
    RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), s.rows, s.D);
    const DVec dyd = ToDouble(dy);
    const DVec dx_ref = NumericGrad(
        [&](const DVec& xv) { return Dot(dyd, RefRmsNorm(xv, ToDouble(w), s.rows, s.D, eps)); },
        ToDouble(x));
    const DVec dw_ref = NumericGrad(
        [&](const DVec& wv) { return Dot(dyd, RefRmsNorm(ToDouble(x), wv, s.rows, s.D, eps)); },
        ToDouble(w));
    ExpectClose(dx, dx_ref, kBwdAtol, kBwdRtol, "dx");
    ExpectClose(dw, Add(dw0, dw_ref), kBwdAtol, kBwdRtol, "dw (accumulated)");
  }
}

TEST_F(DenseOpsTest, RmsNormAliasing) {
  SCOPED_TRACE(SeedTrace());
  const int64_t rows = 19, D = 41;
  const float eps = 1e-5f;
  const Vec x = Normal(rows * D), w = Uniform(D, 0.5f, 1.5f), dy = Normal(rows * D);
  Vec y(rows * D), rstd(rows);
  RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), rows, D, eps);
  Vec inplace = x, rstd2(rows);
  RmsNormForward(inplace.data(), w.data(), inplace.data(), rstd2.data(), rows, D, eps);
  ExpectBitwiseEqual(inplace, y, "y in place");
  ExpectBitwiseEqual(rstd2, rstd, "rstd in place");

  Vec dx(rows * D), dw(D, 0.0f);
  RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, D);
  Vec dyx = dy, dw2(D, 0.0f);
  RmsNormBackward(x.data(), w.data(), rstd.data(), dyx.data(), dyx.data(), dw2.data(), rows, D);
  ExpectBitwiseEqual(dyx, dx, "dx aliasing dy");
  ExpectBitwiseEqual(dw2, dw, "dw with dx aliasing dy");
}

// Large enough to run on several threads: results must not depend on the thread count.
TEST_F(DenseOpsTest, RmsNormBackwardDeterministicAcrossThreads) {
  SCOPED_TRACE(SeedTrace());
  // A model-norm shape and a per-head shape (D = Dh = 64: narrower column blocks per thread).
  for (const NormShape s : {NormShape{2053, 259}, NormShape{8209, 64}}) {
    SCOPED_TRACE("rows=" + std::to_string(s.rows) + " D=" + std::to_string(s.D));
    const int64_t rows = s.rows, D = s.D;
    const Vec x = Normal(rows * D), w = Uniform(D, 0.5f, 1.5f), dy = Normal(rows * D);
    Vec y(rows * D), rstd(rows);
    RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), rows, D, 1e-6f);
    Vec dx(rows * D), dw(D, 0.0f), dx1(rows * D), dw1(D, 0.0f);
    RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, D);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx1.data(), dw1.data(), rows, D);
    omp_set_num_threads(threads);
    ExpectBitwiseEqual(dx, dx1, "dx");
    ExpectBitwiseEqual(dw, dw1, "dw");
    // And dw agrees with an fp64 sum.
    DVec dw_ref(D, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < D; ++j) {
        dw_ref[j] += static_cast<double>(dy[r * D + j]) * x[r * D + j] * rstd[r];
      }
    }
    ExpectClose(dw, dw_ref, 1e-3, 1e-5, "dw vs fp64");
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

// Positions that restart like packed documents: 0, 1, ..., 0, 1, ...
std::vector<int32_t> RestartingPositions(int64_t T, int64_t doc_len, int32_t offset = 0) {
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = offset + static_cast<int32_t>(t % doc_len);
  return pos;
}

struct RopeShape {
  int64_t T, H, d;
  int32_t pos_offset;
};

// q and k rotated inside a fused [T, 3 * H * d] qkv buffer; v and anything not addressed by the
// view stay untouched, bit for bit.
TEST_F(DenseOpsTest, RopeMatchesFormulaInFusedQkv) {
  SCOPED_TRACE(SeedTrace());
  const float theta = 10000.0f;
  // d = 130 exercises more than one frequency chunk; the offsets, positions near 1e5 and 1e6.
  for (const RopeShape s : {RopeShape{17, 3, 10, 0}, RopeShape{23, 2, 130, 0},
                            RopeShape{9, 3, 64, 100000}, RopeShape{31, 1, 8, 1000003}}) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) +
                 " d=" + std::to_string(s.d));
    const int64_t C = 3 * s.H * s.d;
    const auto pos = RestartingPositions(s.T, 5, s.pos_offset);
    const Vec qkv = Uniform(s.T * C);
    Vec buf = qkv;
    for (int part = 0; part < 2; ++part) {  // q, then k
      RopeApply(buf.data() + part * s.H * s.d, pos.data(), s.T, s.H, s.d, C, s.d, theta, false);
    }
    for (int part = 0; part < 3; ++part) {
      DVec dense(s.T * s.H * s.d);
      Vec got(s.T * s.H * s.d);
      for (int64_t t = 0; t < s.T; ++t) {
        for (int64_t i = 0; i < s.H * s.d; ++i) {
          dense[t * s.H * s.d + i] = qkv[t * C + part * s.H * s.d + i];
          got[t * s.H * s.d + i] = buf[t * C + part * s.H * s.d + i];
        }
      }
      const DVec want = part < 2 ? RefRope(dense, pos, s.T, s.H, s.d, theta) : dense;
      // Angles near 1e5 rad: cos/sin of the fp64 angle, so still ~1 fp32 ulp.
      ExpectClose(got, want, part < 2 ? kFwdAtol : 0.0, part < 2 ? kFwdRtol : 0.0,
                  part == 0   ? "q"
                  : part == 1 ? "k"
                              : "v untouched");
    }
    // The inverse undoes the forward.
    for (int part = 0; part < 2; ++part) {
      RopeApply(buf.data() + part * s.H * s.d, pos.data(), s.T, s.H, s.d, C, s.d, theta, true);
    }
    ExpectClose(buf, ToDouble(qkv), 1e-6, 1e-5, "inverse(forward(x))");
  }
}

// The backward is the inverse rotation applied to dy: compare with finite differences.
TEST_F(DenseOpsTest, RopeInverseIsGradient) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 17, H = 3, d = 12;
  const float theta = 500.0f;
  const auto pos = RestartingPositions(T, 7);
  const Vec x = Uniform(T * H * d), dy = Normal(T * H * d);
  Vec dx = dy;
  RopeApply(dx.data(), pos.data(), T, H, d, H * d, d, theta, true);
  const DVec dyd = ToDouble(dy);
  const DVec dx_ref = NumericGrad(
      [&](const DVec& xv) { return Dot(dyd, RefRope(xv, pos, T, H, d, theta)); }, ToDouble(x));
  ExpectClose(dx, dx_ref, kBwdAtol, kBwdRtol, "dx");
}

// ---- Linear and GEMM ----------------------------------------------------------------------------

TEST_F(DenseOpsTest, LinearForwardBackward) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 17, in = 37, out = 29;
  const Vec x = Uniform(T * in), W = Uniform(out * in), dy = Normal(T * out);
  Vec y(T * out);
  LinearForward(x.data(), W.data(), y.data(), T, in, out);
  ExpectClose(y, RefLinear(ToDouble(x), ToDouble(W), T, in, out), kFwdAtol, kFwdRtol, "y");

  const Vec dW0 = Uniform(out * in);
  Vec dx(T * in, std::numeric_limits<float>::quiet_NaN()), dW = dW0;
  LinearBackward(x.data(), W.data(), dy.data(), dx.data(), dW.data(), T, in, out);
  const DVec dyd = ToDouble(dy);
  const DVec dx_ref =
      NumericGrad([&](const DVec& xv) { return Dot(dyd, RefLinear(xv, ToDouble(W), T, in, out)); },
                  ToDouble(x));
  const DVec dW_ref =
      NumericGrad([&](const DVec& wv) { return Dot(dyd, RefLinear(ToDouble(x), wv, T, in, out)); },
                  ToDouble(W));
  ExpectClose(dx, dx_ref, kBwdAtol, kBwdRtol, "dx");
  ExpectClose(dW, Add(dW0, dW_ref), kBwdAtol, kBwdRtol, "dW (accumulated)");

  // dx == nullptr skips the input gradient and still accumulates dW.
  Vec dW2 = dW0;
  LinearBackward(x.data(), W.data(), dy.data(), nullptr, dW2.data(), T, in, out);
  ExpectBitwiseEqual(dW2, dW, "dW without dx");
}

TEST_F(DenseOpsTest, GemmAllTransposesWithPaddedLeadingDims) {
  SCOPED_TRACE(SeedTrace());
  const int64_t M = 13, N = 17, K = 11, pad = 3;
  const float alpha = 0.75f, beta = -0.5f;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      SCOPED_TRACE("trans_a=" + std::to_string(ta) + " trans_b=" + std::to_string(tb));
      const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
      const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
      const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
      const Vec A = Uniform(a_rows * lda), B = Uniform(b_rows * ldb), C0 = Uniform(M * ldc);
      Vec C = C0;
      Gemm(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
      DVec want = ToDouble(C0);  // padding columns must stay as they were
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double s = 0.0;
          for (int64_t k = 0; k < K; ++k) {
            const double a = ta ? A[k * lda + i] : A[i * lda + k];
            const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
            s += a * b;
          }
          want[i * ldc + j] = alpha * s + beta * static_cast<double>(C0[i * ldc + j]);
        }
      }
      ExpectClose(C, want, kFwdAtol, kFwdRtol, "C");
    }
  }
  // K == 0: C = beta * C; with beta == 0, C is cleared even if it held NaN.
  Vec C(M * N, 2.0f);
  Gemm(false, false, M, N, 0, 1.0f, nullptr, 1, nullptr, N, 0.5f, C.data(), N);
  ExpectClose(C, DVec(M * N, 1.0), 0.0, 0.0, "K=0, beta=0.5");
  Vec Cn(M * N, std::numeric_limits<float>::quiet_NaN());
  Gemm(false, false, M, N, 0, 1.0f, nullptr, 1, nullptr, N, 0.0f, Cn.data(), N);
  ExpectClose(Cn, DVec(M * N, 0.0), 0.0, 0.0, "K=0, beta=0");
}

// ---- SwiGLU -------------------------------------------------------------------------------------

TEST_F(DenseOpsTest, SwiGluForwardBackward) {
  SCOPED_TRACE(SeedTrace());
  const int64_t n = 17 * 37;
  Vec g = Normal(n, 3.0f);
  // Saturated gates must stay finite and exact in the limit.
  g[0] = 40.0f;
  g[1] = -40.0f;
  g[2] = 100.0f;
  g[3] = -100.0f;
  const Vec u = Normal(n), dy = Normal(n);
  Vec y(n);
  SwiGluForward(g.data(), u.data(), y.data(), n);
  ExpectClose(y, RefSwiGlu(ToDouble(g), ToDouble(u)), kFwdAtol, kFwdRtol, "y");

  Vec dg(n), du(n);
  SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  const DVec dyd = ToDouble(dy);
  const DVec dg_ref = NumericGrad(
      [&](const DVec& gv) { return Dot(dyd, RefSwiGlu(gv, ToDouble(u))); }, ToDouble(g));
  const DVec du_ref = NumericGrad(
      [&](const DVec& uv) { return Dot(dyd, RefSwiGlu(ToDouble(g), uv)); }, ToDouble(u));
  ExpectClose(dg, dg_ref, kBwdAtol, kBwdRtol, "dg");
  ExpectClose(du, du_ref, kBwdAtol, kBwdRtol, "du");
}

TEST_F(DenseOpsTest, SwiGluLargeParallel) {
  SCOPED_TRACE(SeedTrace());
  const int64_t n = 300007;  // above the parallel threshold, odd tail
  const Vec g = Normal(n, 4.0f), u = Normal(n), dy = Normal(n);
  Vec y(n), dg(n), du(n);
  SwiGluForward(g.data(), u.data(), y.data(), n);
  SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  const DVec y_ref = RefSwiGlu(ToDouble(g), ToDouble(u));
  DVec dg_ref(n), du_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g[i], s = Sigmoid(gi);
    dg_ref[i] = dy[i] * static_cast<double>(u[i]) * s * (1.0 + gi * (1.0 - s));
    du_ref[i] = dy[i] * gi * s;
  }
  ExpectClose(y, y_ref, kFwdAtol, kFwdRtol, "y");
  ExpectClose(dg, dg_ref, kFwdAtol, kFwdRtol, "dg");
  ExpectClose(du, du_ref, kFwdAtol, kFwdRtol, "du");
}

// Gradients written over the inputs they are computed from, as the engine does to save memory.
TEST_F(DenseOpsTest, SwiGluBackwardInPlace) {
  SCOPED_TRACE(SeedTrace());
  for (const int64_t n : {int64_t{17 * 37}, int64_t{100003}}) {
    const Vec g = Normal(n, 3.0f), u = Normal(n), dy = Normal(n);
    Vec dg(n), du(n);
    SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
    Vec g2 = g, u2 = u;
    SwiGluBackward(g2.data(), u2.data(), dy.data(), g2.data(), u2.data(), n);
    ExpectBitwiseEqual(g2, dg, "dg == g");
    ExpectBitwiseEqual(u2, du, "du == u");
    Vec dy2 = dy, du3(n);
    SwiGluBackward(g.data(), u.data(), dy2.data(), dy2.data(), du3.data(), n);
    ExpectBitwiseEqual(dy2, dg, "dg == dy");
  }
}

// ---- Group RMSNorm + sigmoid gate ---------------------------------------------------------------

TEST_F(DenseOpsTest, GroupNormGateForwardBackward) {
  SCOPED_TRACE(SeedTrace());
  const float eps = 1e-6f;
  // Dh = 13 (one column block per head) and Dh = 70 (a head spans two column blocks).
  for (const int64_t Dh : {13, 70}) {
    const int64_t T = 17, H = 3, C = H * Dh;
    SCOPED_TRACE("Dh=" + std::to_string(Dh));
    const Vec o = Normal(T * C), w = Uniform(C, 0.5f, 1.5f), gate = Normal(T * C, 2.0f);
    const Vec dy = Normal(T * C);
    Vec y(T * C), rstd(T * H);
    GroupNormGateForward(o.data(), w.data(), gate.data(), y.data(), rstd.data(), T, H, Dh, eps);
    DVec rstd_ref;
    const DVec od = ToDouble(o), wd = ToDouble(w), gd = ToDouble(gate), dyd = ToDouble(dy);
    ExpectClose(y, RefGroupNormGate(od, wd, gd, T, H, Dh, eps, &rstd_ref), kFwdAtol, kFwdRtol, "y");
    ExpectClose(rstd, rstd_ref, 0.0, kFwdRtol, "rstd");

    const Vec dw0 = Uniform(C);
    Vec do_(T * C), dw = dw0, dgate(T * C);
    GroupNormGateBackward(o.data(), w.data(), gate.data(), rstd.data(), dy.data(), do_.data(),
                          dw.data(), dgate.data(), T, H, Dh);
    const DVec do_ref = NumericGrad(
        [&](const DVec& v) { return Dot(dyd, RefGroupNormGate(v, wd, gd, T, H, Dh, eps)); }, od);
    const DVec dw_ref = NumericGrad(
        [&](const DVec& v) { return Dot(dyd, RefGroupNormGate(od, v, gd, T, H, Dh, eps)); }, wd);
    const DVec dgate_ref = NumericGrad(
        [&](const DVec& v) { return Dot(dyd, RefGroupNormGate(od, wd, v, T, H, Dh, eps)); }, gd);
    ExpectClose(do_, do_ref, kBwdAtol, kBwdRtol, "do");
    ExpectClose(dw, Add(dw0, dw_ref), kBwdAtol, kBwdRtol, "dw (accumulated)");
    ExpectClose(dgate, dgate_ref, kBwdAtol, kBwdRtol, "dgate");
  }
}

TEST_F(DenseOpsTest, GroupNormGateBackwardAliasing) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 301, H = 3, Dh = 37, C = H * Dh;
  const Vec o = Normal(T * C), w = Uniform(C, 0.5f, 1.5f), gate = Normal(T * C, 2.0f);
  const Vec dy = Normal(T * C);
  Vec y(T * C), rstd(T * H);
  GroupNormGateForward(o.data(), w.data(), gate.data(), y.data(), rstd.data(), T, H, Dh, 1e-6f);
  Vec do_(T * C), dw(C, 0.0f), dgate(T * C);
  GroupNormGateBackward(o.data(), w.data(), gate.data(), rstd.data(), dy.data(), do_.data(),
                        dw.data(), dgate.data(), T, H, Dh);
  Vec dy2 = dy, gate2 = gate, dw2(C, 0.0f);
  GroupNormGateBackward(o.data(), w.data(), gate2.data(), rstd.data(), dy2.data(), dy2.data(),
                        dw2.data(), gate2.data(), T, H, Dh);
  ExpectBitwiseEqual(dy2, do_, "do == dy");
  ExpectBitwiseEqual(gate2, dgate, "dgate == gate");
  ExpectBitwiseEqual(dw2, dw, "dw");
  // The weight gradient does not depend on the thread count either.
  Vec dw1(C, 0.0f), do1(T * C), dgate1(T * C);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  GroupNormGateBackward(o.data(), w.data(), gate.data(), rstd.data(), dy.data(), do1.data(),
                        dw1.data(), dgate1.data(), T, H, Dh);
  omp_set_num_threads(threads);
  ExpectBitwiseEqual(dw1, dw, "dw 1 thread vs default");
  ExpectBitwiseEqual(do1, do_, "do 1 thread vs default");
}

// ---- Cross-entropy ------------------------------------------------------------------------------

TEST_F(DenseOpsTest, CrossEntropyLossAndGradient) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 17, V = 127;
  const float grad_scale = 1.0f / 13.0f;
  const Vec logits = Normal(T * V, 3.0f);
  auto targets = Ints(T, 0, V - 1);
  targets[3] = -1;  // ignored rows
  targets[10] = -1;
  targets[16] = V - 1;
  const DVec ld = ToDouble(logits);
  const DVec rows_ref = RefCrossEntropyRows(ld, targets, T, V);

  int64_t n_valid = 5;  // accumulates
  Vec dlogits(T * V, std::numeric_limits<float>::quiet_NaN());
  const double loss =
      CrossEntropy(logits.data(), targets.data(), T, V, grad_scale, dlogits.data(), &n_valid);
  EXPECT_EQ(n_valid, 5 + T - 2);
  EXPECT_LE(std::abs(loss - Sum(rows_ref)), 1e-5 * Sum(rows_ref))
      << loss << " vs " << Sum(rows_ref);

  const DVec grad_ref = NumericGrad(
      [&](const DVec& v) { return grad_scale * Sum(RefCrossEntropyRows(v, targets, T, V)); }, ld);
  ExpectClose(dlogits, grad_ref, 1e-6, kBwdRtol, "dlogits");
  for (int64_t j = 0; j < V; ++j) {  // exact zeros on ignored rows
    ASSERT_EQ(dlogits[3 * V + j], 0.0f);
    ASSERT_EQ(dlogits[10 * V + j], 0.0f);
  }

  // Without dlogits: the same loss (bitwise: same arithmetic).
  int64_t n2 = 0;
  const double loss2 = CrossEntropy(logits.data(), targets.data(), T, V, grad_scale, nullptr, &n2);
  EXPECT_EQ(n2, T - 2);
  EXPECT_EQ(loss2, loss);

  // In place: dlogits aliases logits.
  Vec inplace = logits;
  int64_t n3 = 0;
  const double loss3 =
      CrossEntropy(inplace.data(), targets.data(), T, V, grad_scale, inplace.data(), &n3);
  EXPECT_EQ(loss3, loss);
  ExpectBitwiseEqual(inplace, dlogits, "in-place dlogits");
}

// z-loss: the objective adds z * lse^2 per valid row; the returned loss stays the cross-entropy,
// the rows' lse^2 sum is accumulated apart, and the gradient is the whole objective's.
TEST_F(DenseOpsTest, CrossEntropyWithZLossMatchesTheObjectivesGradient) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 13, V = 97;
  const float grad_scale = 1.0f / 11.0f, z = 0.3f;
  const Vec logits = Normal(T * V, 3.0f);
  auto targets = Ints(T, 0, V - 1);
  targets[5] = -1;
  const DVec ld = ToDouble(logits);
  auto lse_rows = [&](const DVec& v) {
    DVec out(T, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      if (targets[t] < 0) continue;
      out[t] = RefCrossEntropyRows(v, targets, T, V)[t] + v[t * V + targets[t]];
    }
    return out;
  };
  auto objective = [&](const DVec& v) {
    double o = Sum(RefCrossEntropyRows(v, targets, T, V));
    for (double l : lse_rows(v)) o += z * l * l;
    return grad_scale * o;
  };
  int64_t n_valid = 0;
  double lse_squared = 1.5;  // accumulates
  Vec dlogits(T * V);
  const double loss = CrossEntropy(logits.data(), targets.data(), T, V, grad_scale,
                                   dlogits.data(), &n_valid, z, &lse_squared);
  const double ce_ref = Sum(RefCrossEntropyRows(ld, targets, T, V));
  EXPECT_LE(std::abs(loss - ce_ref), 1e-5 * ce_ref) << loss << " vs " << ce_ref;
  double lse2_ref = 0.0;
  for (double l : lse_rows(ld)) lse2_ref += l * l;
  EXPECT_LE(std::abs(lse_squared - 1.5 - lse2_ref), 1e-5 * lse2_ref);
  EXPECT_EQ(n_valid, T - 1);
  ExpectClose(dlogits, NumericGrad(objective, ld), 1e-6, kBwdRtol, "dlogits with z-loss");
  for (int64_t j = 0; j < V; ++j) ASSERT_EQ(dlogits[5 * V + j], 0.0f);

  // z = 0 is the plain cross-entropy, bit for bit.
  Vec plain(T * V), zero(T * V);
  int64_t n = 0;
  EXPECT_EQ(CrossEntropy(logits.data(), targets.data(), T, V, grad_scale, plain.data(), &n),
            CrossEntropy(logits.data(), targets.data(), T, V, grad_scale, zero.data(), &n, 0.0f,
                         &lse_squared));
  ExpectBitwiseEqual(zero, plain, "z = 0 dlogits");
}

TEST_F(DenseOpsTest, CrossEntropyIsStableForLargeLogits) {
  SCOPED_TRACE(SeedTrace());
  const int64_t T = 9, V = 4099;
  Vec logits = Normal(T * V, 2.0f);
  for (int64_t i = 0; i < T * V; ++i) logits[i] += (i / V) % 2 ? 5000.0f : -5000.0f;
  logits[2 * V + 5] = -std::numeric_limits<float>::infinity();  // a masked logit
  const auto targets = Ints(T, 0, V - 1);
  Vec dlogits(T * V);
  int64_t n_valid = 0;
  const double loss =
      CrossEntropy(logits.data(), targets.data(), T, V, 1.0f, dlogits.data(), &n_valid);
  // The fp64 reference on the same fp32 inputs; the offset costs fp32 input precision only.
  const double want = Sum(RefCrossEntropyRows(ToDouble(logits), targets, T, V));
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LE(std::abs(loss - want), 1e-5 * std::abs(want) + 1e-4) << loss << " vs " << want;
  EXPECT_EQ(n_valid, T);
  // Each gradient row sums to zero: softmax sums to one, minus the one-hot.
  for (int64_t t = 0; t < T; ++t) {
    double row = 0.0;
    for (int64_t j = 0; j < V; ++j) row += dlogits[t * V + j];
    EXPECT_LE(std::abs(row), 1e-5) << "row " << t;
  }
}

TEST_F(DenseOpsTest, CrossEntropyAllIgnoredAndNaN) {
  const int64_t T = 4, V = 33;
  Vec logits(T * V, 1.0f);
  const std::vector<int32_t> ignored(T, -1);
  Vec dlogits(T * V, 7.0f);
  int64_t n_valid = 0;
  EXPECT_EQ(CrossEntropy(logits.data(), ignored.data(), T, V, 1.0f, dlogits.data(), &n_valid), 0.0);
  EXPECT_EQ(n_valid, 0);
  ExpectClose(dlogits, DVec(T * V, 0.0), 0.0, 0.0, "dlogits of ignored rows");

  // A NaN anywhere in a valid row must surface in the loss.
  const std::vector<int32_t> targets = {0, 1, 2, 3};
  logits[1 * V + 20] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(
      CrossEntropy(logits.data(), targets.data(), T, V, 1.0f, dlogits.data(), &n_valid)));
}

// ---- Optimizers ---------------------------------------------------------------------------------

TEST_F(DenseOpsTest, AdamWMatchesScalarReference) {
  SCOPED_TRACE(SeedTrace());
  const int64_t n = 40009;  // above the parallel threshold, odd tail
  AdamWParams hp{
      .lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .step = 0};
  Vec p = Normal(n), m(n, 0.0f), v(n, 0.0f);
  DVec pr = ToDouble(p), mr(n, 0.0), vr(n, 0.0);
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Varying gradient scales, including tiny ones where eps matters.
    const Vec g = Normal(n, step == 4 ? 1e-7f : 1.0f);
    hp.step = step;
    AdamWStep(p.data(), g.data(), m.data(), v.data(), n, hp);
    const double b1 = hp.beta1, b2 = hp.beta2;
    for (int64_t i = 0; i < n; ++i) {
      mr[i] = b1 * mr[i] + (1.0 - b1) * g[i];
      vr[i] = b2 * vr[i] + (1.0 - b2) * static_cast<double>(g[i]) * g[i];
      const double mhat = mr[i] / (1.0 - std::pow(b1, step));
      const double vhat = vr[i] / (1.0 - std::pow(b2, step));
      pr[i] -= static_cast<double>(hp.lr) *
               (static_cast<double>(hp.weight_decay) * pr[i] + mhat / (std::sqrt(vhat) + hp.eps));
    }
    ExpectClose(m, mr, 1e-7, 1e-5, "m");
    ExpectClose(v, vr, 1e-12, 1e-5, "v");
    // Each step moves p by up to ~lr; fp32 rounding of p itself dominates.
    ExpectClose(p, pr, 1e-6, 1e-5, "p");
  }
}

TEST_F(DenseOpsTest, SgdMatchesScalarReference) {
  SCOPED_TRACE(SeedTrace());
  const int64_t n = 40009;
  const float lr = 0.05f, wd = 0.01f;
  for (const float momentum : {0.0f, 0.9f}) {
    SCOPED_TRACE("momentum=" + std::to_string(momentum));
    Vec p = Normal(n), buf(n, 0.0f);
    DVec pr = ToDouble(p), br(n, 0.0);
    for (int step = 0; step < 5; ++step) {
      const Vec g = Normal(n);
      SgdStep(p.data(), g.data(), momentum == 0.0f ? nullptr : buf.data(), n, lr, momentum, wd);
      for (int64_t i = 0; i < n; ++i) {
        const double d = g[i] + static_cast<double>(wd) * pr[i];
        if (momentum == 0.0f) {
          pr[i] -= lr * d;
        } else {
          br[i] = momentum * br[i] + d;
          pr[i] -= lr * br[i];
        }
      }
    }
    ExpectClose(p, pr, 1e-5, 1e-5, "p");
    if (momentum != 0.0f) ExpectClose(buf, br, 1e-5, 1e-5, "momentum buffer");
  }
}

TEST_F(DenseOpsTest, SumSquaresAndScale) {
  SCOPED_TRACE(SeedTrace());
  for (const int64_t n : {int64_t{37}, int64_t{100003}}) {
    Vec x = Normal(n);
    double want = 0.0;
    for (float v : x) want += static_cast<double>(v) * v;
    const double got = SumSquares(x.data(), n);
    EXPECT_LE(std::abs(got - want), 1e-12 * want) << got << " vs " << want;
    const DVec scaled = [&] {
      DVec s(n);
      for (int64_t i = 0; i < n; ++i) s[i] = static_cast<double>(x[i]) * static_cast<double>(0.3f);
      return s;
    }();
    Scale(x.data(), n, 0.3f);
    ExpectClose(x, scaled, 0.0, 6e-8, "scaled");  // one rounding
  }
  Vec nan_x = {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  EXPECT_TRUE(std::isnan(SumSquares(nan_x.data(), 3)));
}

}  // namespace
}  // namespace spindle::kernels::cpu
