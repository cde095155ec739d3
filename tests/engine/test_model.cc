// Model-level checks: every parameter tensor's gradient against a central finite difference of
// the loss along a fresh random direction (fp32 model, double loss accumulation), recompute
// giving the same gradients, and the evaluation forward giving the training loss.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "worker/engine/batch.h"
#include "worker/engine/model.h"
#include "worker/engine/rng.h"

namespace spindle {
namespace {

ModelConfig TinyConfig(const std::string& pattern, int64_t q_lora) {
  ModelConfig c = *ModelPreset("tiny");
  c.d_model = 32;
  c.n_heads = 2;
  c.ffn_dim = 48;
  c.n_layers = static_cast<int64_t>(pattern.size());
  c.layer_pattern = pattern;
  c.mla = {q_lora, 12, 8, 6, 10};
  // At a document's first token the Lightning output is scale * (q.k) v, which can be close to
  // zero; its group RMSNorm then amplifies perturbations by up to 1/sqrt(eps), and finite
  // differences lose all accuracy. A larger eps keeps the check well conditioned; the kernels'
  // own tests cover the real eps.
  c.norm_eps = 0.05;
  return c;
}

// A sequence with several documents (EOS = 256) of odd lengths.
std::vector<int32_t> RandomTokens(std::mt19937& gen, int64_t T) {
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(T);
  for (auto& x : t) x = tok(gen);
  for (int64_t i : {5, 6, 19, 30}) if (i < T) t[i] = 256;
  return t;
}

double LossSum(Model& m, const Batch& b) { return m.Forward(b).loss_sum; }

// Every tensor's analytic gradient of the model `pattern` under `numerics` (exact ones: fp32, with
// or without injected outliers) against finite differences.
void ExpectFiniteDifferenceGradients(const std::string& pattern, int64_t q_lora,
                                     const Numerics& numerics) {
  const uint32_t seed = getenv("SPINDLE_TEST_SEED") ? static_cast<uint32_t>(std::stoul(getenv("SPINDLE_TEST_SEED"))) : std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  auto model = Model::Create(TinyConfig(pattern, q_lora), seed);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  m.SetNumerics(numerics);
  // Larger init than training uses, so every path carries a clearly non-zero gradient.
  ParamSet& P = m.params();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    for (int64_t j = 0; j < p.numel; ++j)
      P.data(i)[j] = p.init == ParamInit::kOnes ? 1.0f + 0.2f * nd(gen) : 0.15f * nd(gen);
  }
  Batch b = MakeSequenceBatch(RandomTokens(gen, 37), 256);
  P.ZeroGrad();
  m.ForwardBackward(b, 1.0f, Recompute::None());
  std::vector<float> grad(P.flat_grad().f32(), P.flat_grad().f32() + P.numel());
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    SCOPED_TRACE(p.name);
    // Direction: the analytic gradient plus an independent random part, both of unit norm, so a
    // wrong gradient shows either as a wrong magnitude or as a wrong projection.
    std::vector<float> u(p.numel), saved(P.data(i), P.data(i) + p.numel);
    double gn = 0.0, rn = 0.0;
    std::vector<float> r(p.numel);
    for (int64_t j = 0; j < p.numel; ++j) {
      r[j] = nd(gen);
      gn += static_cast<double>(grad[p.offset + j]) * grad[p.offset + j];
      rn += static_cast<double>(r[j]) * r[j];
    }
    gn = std::sqrt(gn) + 1e-30;
    rn = std::sqrt(rn);
    double analytic = 0.0;
    for (int64_t j = 0; j < p.numel; ++j) {
      u[j] = static_cast<float>(grad[p.offset + j] / gn + r[j] / rn);
      analytic += static_cast<double>(u[j]) * grad[p.offset + j];
    }
    // Central differences at h and 2h combined by Richardson extrapolation (error O(h^4)): the
    // Lightning recurrence makes the loss cubic in the q/k/v weights, so plain central
    // differences need a very small h.
    auto central = [&](float h) {
      for (int64_t j = 0; j < p.numel; ++j) P.data(i)[j] = saved[j] + h * u[j];
      const double lp = LossSum(m, b);
      for (int64_t j = 0; j < p.numel; ++j) P.data(i)[j] = saved[j] - h * u[j];
      const double lm = LossSum(m, b);
      std::copy(saved.begin(), saved.end(), P.data(i));
      return (lp - lm) / (2.0 * h);
    };
    auto richardson = [&](float h) { return (4.0 * central(h / 2) - central(h)) / 3.0; };
    // fp32 forward noise (~1e-7 of a loss sum near 200) over steps of 2h: allow 0.5% + 2e-2.
    auto tol = [](double numeric) { return 0.005 * std::fabs(numeric) + 2e-2; };
    float h = 1e-3f;
    double numeric = richardson(h);
    // Along some directions (about one seed in 75 puts one at layer 0's q/k/v or the embedding of
    // the three-layer model) the loss curves so sharply that the estimate at h is off by 1-4%,
    // although it converges to the analytic value as h shrinks. There the step halves, down to
    // 1.25e-4 (below which fp32 noise grows past the tolerance), until two successive estimates
    // settle. A wrong gradient still fails: the estimates settle on the true derivative.
    while (std::fabs(analytic - numeric) > tol(numeric) && h > 1.3e-4f) {
      h /= 2;
      const double next = richardson(h);
      const bool settled = std::fabs(next - numeric) <= tol(next) / 2;
      numeric = next;
      if (settled) break;
    }
    EXPECT_NEAR(analytic, numeric, tol(numeric))
        << "analytic " << analytic << " numeric " << numeric << " at h " << h;
  }
}

class ModelGradTest : public ::testing::TestWithParam<std::pair<std::string, int64_t>> {};

TEST_P(ModelGradTest, EveryTensorMatchesFiniteDifferences) {
  ExpectFiniteDifferenceGradients(GetParam().first, GetParam().second, Numerics{});
}

INSTANTIATE_TEST_SUITE_P(Patterns, ModelGradTest,
                         ::testing::Values(std::make_pair(std::string("LM"), int64_t{0}),
                                           std::make_pair(std::string("ML"), int64_t{10}),
                                           std::make_pair(std::string("LLM"), int64_t{0}),
                                           std::make_pair(std::string("MM"), int64_t{10})));

// An injected outlier per layer (Numerics::outliers, the FP8 experiments' model): the backward
// carries the multiplication through its element, so the gradients stay the loss's.
TEST(ModelTest, GradientsWithInjectedOutliersMatchFiniteDifferences) {
  Numerics n;
  n.outliers = OutlierInjection{20.0f, 5};
  ExpectFiniteDifferenceGradients("LM", 0, n);
}

TEST(ModelTest, RecomputeGivesTheSameGradients) {
  const uint32_t seed = getenv("SPINDLE_TEST_SEED") ? static_cast<uint32_t>(std::stoul(getenv("SPINDLE_TEST_SEED"))) : std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  auto model = Model::Create(TinyConfig("LLM", 0), seed);
  ASSERT_TRUE(model.ok());
  Model& m = **model;
  Batch b = MakeSequenceBatch(RandomTokens(gen, 53), 256);
  ParamSet& P = m.params();
  P.ZeroGrad();
  LossStats a = m.ForwardBackward(b, 0.5f, Recompute::None());
  std::vector<float> g1(P.flat_grad().f32(), P.flat_grad().f32() + P.numel());
  // Every layer, then only the first one or two (the others keep their activations); the plain
  // step last again, after the caches were shared.
  for (Recompute rc :
       {Recompute::All(), Recompute::First(1), Recompute::First(2), Recompute::None()}) {
    SCOPED_TRACE(::testing::Message() << "recompute " << rc.layers << " layers");
    P.ZeroGrad();
    LossStats r = m.ForwardBackward(b, 0.5f, rc);
    EXPECT_EQ(a.loss_sum, r.loss_sum);
    EXPECT_EQ(a.n_valid, r.n_valid);
    for (int64_t j = 0; j < P.numel(); ++j)
      ASSERT_EQ(g1[j], P.flat_grad().f32()[j]) << "index " << j;
  }
  LossStats e = m.Forward(b);
  EXPECT_NEAR(e.loss_sum, a.loss_sum, 1e-9 * std::fabs(a.loss_sum));
}

TEST(ModelTest, ParameterNamesFollowTheDesign) {
  auto model = Model::Create(TinyConfig("LM", 10), 1);
  ASSERT_TRUE(model.ok());
  ParamSet& P = (*model)->params();
  for (const char* name :
       {"embed.weight", "layers.0.attn_norm.weight", "layers.0.la.qkv.weight",
        "layers.0.la.gate.weight", "layers.0.la.out.weight", "layers.0.la.q_norm.weight",
        "layers.0.la.k_norm.weight", "layers.0.la.out_norm.weight", "layers.0.ffn.w1.weight",
        "layers.0.ffn.w2.weight", "layers.0.ffn.w3.weight", "layers.0.ffn_norm.weight",
        "layers.1.mla.q_a.weight", "layers.1.mla.q_a_norm.weight", "layers.1.mla.q_b.weight",
        "layers.1.mla.kv_a.weight", "layers.1.mla.kv_norm.weight", "layers.1.mla.kv_b.weight",
        "layers.1.mla.out.weight", "final_norm.weight", "lm_head.weight"})
    EXPECT_GE(P.Find(name), 0) << name;
  EXPECT_EQ(P.info(P.Find("layers.0.la.qkv.weight")).shape, (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(P.info(P.Find("layers.1.mla.kv_b.weight")).shape,
            (std::vector<int64_t>{2 * (8 + 10), 12}));
  int64_t total = 0;
  for (int i = 0; i < P.size(); ++i) total += P.info(i).numel;
  EXPECT_EQ(total, (*model)->config().NumParams());
}

TEST(ModelTest, OneBillionPresetHasTheReferenceSize) {
  auto c = ModelPreset("1b");
  ASSERT_TRUE(c.ok());
  // ref_model.py's defaults: about 1.0B parameters.
  EXPECT_GT(c->NumParams(), 950'000'000);
  EXPECT_LT(c->NumParams(), 1'100'000'000);
}

TEST(ModelTest, InitialWeightsAreTheSequentialStreamsForAnyThreadCount) {
  // The fill runs in parallel; it must give what one stream per tensor, drawn in order, gives.
  ModelConfig c = *ModelPreset("small");
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  omp_set_num_threads(1);
  auto one = Model::Create(c, seed);
  omp_set_num_threads(2);
  auto two = Model::Create(c, seed);
  ASSERT_TRUE(one.ok() && two.ok());
  ParamSet& a = (*one)->params();
  ParamSet& b = (*two)->params();
  ASSERT_EQ(a.numel(), b.numel());
  EXPECT_EQ(std::memcmp(a.flat_data().f32(), b.flat_data().f32(), a.numel() * 4), 0);
  int checked = 0;
  for (int i = 0; i < a.size(); ++i) {
    const ParamInfo& p = a.info(i);
    const float* d = a.flat_data().f32() + p.offset;
    if (p.init == ParamInit::kOnes) {
      EXPECT_EQ(d[p.numel - 1], 1.0f) << p.name;
      continue;
    }
    if (p.init != ParamInit::kNormal || p.numel < (1 << 15)) continue;  // the parallel path
    Rng rng(HashCombine(seed, HashName(p.name)));
    int64_t differ = 0;
    for (int64_t j = 0; j < p.numel; ++j)
      differ += d[j] != static_cast<float>(rng.Normal()) * p.init_std;
    EXPECT_EQ(differ, 0) << p.name;
    ++checked;
  }
  EXPECT_GT(checked, 3);
  // The padding between parameters and every gradient start at zero.
  for (int i = 0; i + 1 < a.size(); ++i) {
    const ParamInfo& p = a.info(i);
    for (int64_t j = p.offset + p.numel; j < a.info(i + 1).offset; ++j)
      ASSERT_EQ(a.flat_data().f32()[j], 0.0f) << "padding after " << p.name;
  }
  for (int64_t j = 0; j < a.numel(); ++j) ASSERT_EQ(a.flat_grad().f32()[j], 0.0f);
}

TEST(ModelTest, AHostCopyWithoutGradientsGetsThemZeroedOnFirstUse) {
  const ModelConfig c = *ModelPreset("tiny");
  auto eager = Model::Create(c, 5);
  auto lazy = Model::Create(c, 5, /*host_grads=*/false);
  ASSERT_TRUE(eager.ok() && lazy.ok());
  ParamSet& a = (*eager)->params();
  ParamSet& b = (*lazy)->params();
  EXPECT_EQ(std::memcmp(a.flat_data().f32(), b.flat_data().f32(), a.numel() * 4), 0);
  b.ZeroGrad();  // nothing to zero yet: no buffer is made for it
  ASSERT_EQ(b.flat_grad().numel(), a.numel());
  for (int64_t j = 0; j < b.numel(); ++j) ASSERT_EQ(b.flat_grad().f32()[j], 0.0f);
  EXPECT_EQ(b.grad(b.size() - 1), b.flat_grad().f32() + b.info(b.size() - 1).offset);
  // Then it trains like the eager one.
  std::mt19937 gen(3);
  const Batch batch = MakeSequenceBatch(RandomTokens(gen, 64), 256);
  const LossStats la = (*eager)->ForwardBackward(batch, 1.0f, Recompute::None());
  const LossStats lb = (*lazy)->ForwardBackward(batch, 1.0f, Recompute::None());
  EXPECT_EQ(la.loss_sum, lb.loss_sum);
  EXPECT_EQ(std::memcmp(a.flat_grad().f32(), b.flat_grad().f32(), a.numel() * 4), 0);
}

}  // namespace
}  // namespace spindle
