// The MoE kernels (kernels/cpu/moe.h) on odd shapes and fresh random inputs: the router against
// its definition computed here in double, its backward and the combine's backward against central
// finite differences (double-checked in fp32 at a relative tolerance of 2e-3 of the largest
// gradient), the grouping's rows, counts and padding, and the weights of every token summing to
// one (dropless: every pair has a row).
#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/moe.h"

namespace spindle::kernels::cpu {
namespace {

std::vector<float> Randn(int64_t n, std::mt19937& gen, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

struct Shape {
  int64_t T, E, K;
};

class MoeRouter : public ::testing::TestWithParam<Shape> {};

TEST_P(MoeRouter, ChoosesTopKOfBiasedScoresAndRenormalises) {
  const auto [T, E, K] = GetParam();
  std::mt19937 gen(std::random_device{}());
  const std::vector<float> z = Randn(T * E, gen), b = Randn(E, gen, 0.3f);
  std::vector<int32_t> idx(T * K);
  std::vector<float> w(T * K), lse(T);
  MoeRouterForward(z.data(), b.data(), idx.data(), w.data(), lse.data(), T, E, K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<double, int>> key;
    double m = -1e30, se = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      key.push_back({1.0 / (1.0 + std::exp(-static_cast<double>(z[t * E + e]))) + b[e], -e});
      m = std::max(m, static_cast<double>(z[t * E + e]));
    }
    for (int64_t e = 0; e < E; ++e) se += std::exp(z[t * E + e] - m);
    EXPECT_NEAR(lse[t], m + std::log(se), 1e-5);
    std::sort(key.rbegin(), key.rend());
    double sum_w = 0.0, sum_s = 0.0;
    for (int64_t k = 0; k < K; ++k) sum_s += key[k].first - b[-key[k].second];
    for (int64_t k = 0; k < K; ++k) {
      const int e = -key[k].second;
      ASSERT_EQ(idx[t * K + k], e) << "token " << t << " choice " << k;
      EXPECT_NEAR(w[t * K + k], (key[k].first - b[e]) / sum_s, 1e-6);
      sum_w += w[t * K + k];
    }
    EXPECT_NEAR(sum_w, 1.0, 1e-6) << "token " << t << ": its weights must sum to one";
  }
}

// d/dz of L = sum_k c_k w_k + zs * sum_t lse_t^2 against central differences, the choices held
// (a perturbation small enough not to change them: checked).
TEST_P(MoeRouter, BackwardMatchesFiniteDifferences) {
  const auto [T, E, K] = GetParam();
  std::mt19937 gen(std::random_device{}());
  std::vector<float> z = Randn(T * E, gen);
  const std::vector<float> b = Randn(E, gen, 0.3f), c = Randn(T * K, gen);
  const float zs = 0.37f;
  std::vector<int32_t> idx(T * K), idx2(T * K);
  std::vector<float> w(T * K), lse(T), dz(T * E);
  MoeRouterForward(z.data(), b.data(), idx.data(), w.data(), lse.data(), T, E, K);
  MoeRouterBackward(z.data(), idx.data(), c.data(), lse.data(), zs, dz.data(), T, E, K);
  auto loss = [&](const std::vector<float>& zz, bool* same) {
    std::vector<float> ww(T * K), ll(T);
    MoeRouterForward(zz.data(), b.data(), idx2.data(), ww.data(), ll.data(), T, E, K);
    *same = idx2 == idx;
    double L = 0.0;
    for (int64_t i = 0; i < T * K; ++i) L += static_cast<double>(c[i]) * ww[i];
    for (int64_t t = 0; t < T; ++t) L += zs * static_cast<double>(ll[t]) * ll[t];
    return L;
  };
  const float h = 1e-2f;
  double max_g = 0.0, max_err = 0.0;
  for (int64_t i = 0; i < T * E; ++i) {
    std::vector<float> p = z, m = z;
    p[i] += h;
    m[i] -= h;
    bool sp = false, sm = false;
    const double fd = (loss(p, &sp) - loss(m, &sm)) / (2.0 * h);
    if (!sp || !sm) continue;  // the perturbation changed a choice
    max_g = std::max(max_g, std::abs(static_cast<double>(dz[i])));
    max_err = std::max(max_err, std::abs(fd - dz[i]));
  }
  EXPECT_GT(max_g, 0.0);
  EXPECT_LE(max_err, 2e-3 * max_g + 1e-5);
}

INSTANTIATE_TEST_SUITE_P(OddShapes, MoeRouter,
                         ::testing::Values(Shape{17, 5, 1}, Shape{37, 8, 2}, Shape{13, 64, 8},
                                           Shape{5, 3, 3}));

TEST(MoeGroupRows, GroupsStablyWithPaddedGroups) {
  std::mt19937 gen(std::random_device{}());
  for (const auto& [n, per, E, align] : std::vector<std::array<int64_t, 4>>{
           {37 * 2, 2, 8, 1}, {17, 1, 5, 16}, {127 * 3, 3, 64, 16}, {0, 1, 4, 16}}) {
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(E) - 2);  // E-1 empty
    std::vector<int32_t> key(n);
    for (auto& k : key) k = pick(gen);
    std::vector<int64_t> counts(E), offsets(E + 1);
    std::vector<int32_t> item_row(n);
    int64_t rows = 0;
    {
      std::vector<int64_t> c(E, 0);
      for (int32_t k : key) ++c[k];
      for (int64_t e = 0; e < E; ++e) rows += (c[e] + align - 1) / align * align;
    }
    std::vector<int32_t> row_source(rows, 7);
    MoeGroupRows(key.data(), n, per, E, align, counts.data(), offsets.data(), item_row.data(),
                 row_source.data());
    ASSERT_EQ(offsets[E], rows);
    EXPECT_EQ(counts[E - 1], 0);
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), n);
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(offsets[e] % align, 0);
      EXPECT_GE(offsets[e + 1] - offsets[e], counts[e]);
      EXPECT_LT(offsets[e + 1] - offsets[e], counts[e] + align);
    }
    std::vector<int> seen(rows, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = item_row[i];
      ASSERT_GE(r, offsets[key[i]]);
      ASSERT_LT(r, offsets[key[i]] + counts[key[i]]);
      EXPECT_EQ(row_source[r], i / per);
      ++seen[r];
      if (i > 0 && key[i - 1] == key[i]) EXPECT_LT(item_row[i - 1], r) << "stable order";
    }
    for (int64_t r = 0; r < rows; ++r)
      if (!seen[r]) EXPECT_EQ(row_source[r], -1) << "padding row " << r;
  }
}

TEST(MoeCombine, WeightedSumAndBackwardAgainstFiniteDifferences) {
  std::mt19937 gen(std::random_device{}());
  const int64_t T = 13, K = 3, D = 19, R = T * K + 5;
  std::vector<int32_t> row(T * K);
  std::iota(row.begin(), row.end(), 2);
  std::shuffle(row.begin(), row.end(), gen);
  std::vector<float> y = Randn(R * D, gen), w = Randn(T * K, gen), dout = Randn(T * D, gen);
  std::vector<float> out(T * D, 0.5f);
  MoeCombine(y.data(), row.data(), w.data(), out.data(), T, K, D, /*accumulate=*/true);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D; ++j) {
      double want = 0.5;
      for (int64_t k = 0; k < K; ++k) want += w[t * K + k] * y[row[t * K + k] * D + j];
      EXPECT_NEAR(out[t * D + j], want, 1e-5);
    }
  std::vector<float> dy(R * D, 9.0f), dw(T * K);
  MoeCombineBackward(dout.data(), y.data(), row.data(), w.data(), dy.data(), dw.data(), T, K, D);
  EXPECT_EQ(dy[0], 9.0f) << "rows no pair names are left as they are";
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      double dot = 0.0;
      for (int64_t j = 0; j < D; ++j) {
        dot += static_cast<double>(dout[t * D + j]) * y[row[t * K + k] * D + j];
        EXPECT_FLOAT_EQ(dy[row[t * K + k] * D + j], w[t * K + k] * dout[t * D + j]);
      }
      EXPECT_NEAR(dw[t * K + k], dot, 1e-4);
    }
}

TEST(GatherRows, CopiesNamedRowsAndZeroesTheRest) {
  std::mt19937 gen(std::random_device{}());
  const int64_t D = 7;
  const std::vector<float> in = Randn(5 * D, gen);
  const std::vector<int32_t> src = {4, -1, 0, 0, 2};
  std::vector<float> out(5 * D, 3.0f);
  GatherRows(in.data(), src.data(), out.data(), 5, D);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t j = 0; j < D; ++j)
      EXPECT_EQ(out[r * D + j], src[r] < 0 ? 0.0f : in[src[r] * D + j]);
}

}  // namespace
}  // namespace spindle::kernels::cpu
