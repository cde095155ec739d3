// CudaModel's mixture-of-experts FFN against the CPU engine's bf16 emulation (the same model, the
// same bf16 roundings of the same tensors: worker/engine/numerics.h), on a tiny-moe variant with a
// dense first layer, a shared expert, random balancing biases and the router z-loss, on fresh
// random tokens with documents: one training step's loss and every parameter's gradient, the
// loads the router's choices put on the experts and the biases they move; recomputing every layer
// gives the step of keeping every cache; a second fresh model repeats the step. Skips without a
// GPU.
//
// Tolerances: as test_cuda_model.cc's (loss 1%, each matrix's gradient 6% in relative L2, norm
// weights 18%), but against the emulation, so the router sees the same bf16 inputs on both and
// chooses the same experts (a near tie decided differently would move a few rows of an expert's
// gradient: the loads are compared to one pair an expert).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "model_test_util.h"
#include "worker/engine/batch.h"
#include "worker/engine/cuda/cuda_model.h"
#include "worker/engine/model.h"
#include "worker/engine/numerics.h"

namespace spindle {
namespace {

using kernels::cuda::testing::FreshSeed;
using testing::RandomBatch;

ModelConfig TinyMoe() {
  ModelConfig c = *ModelPreset("tiny-moe");
  c.norm_eps = 1e-2;  // see test_cuda_model.cc: near-zero norm inputs amplify roundings
  c.moe.first_dense = 1;
  c.moe.z_loss = 0.01;
  c.moe.bias_rate = 0.01;
  return c;
}

void SetBiases(ParamSet& P, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int i = 0; i < P.size(); ++i)
    if (P.info(i).name.find("router.bias") != std::string::npos)
      for (int64_t j = 0; j < P.info(i).numel; ++j) P.data(i)[j] = d(gen);
}

TEST(CudaMoe, StepMatchesTheCpuBf16Emulation) {
  SPINDLE_REQUIRE_GPU();
  const ModelConfig c = TinyMoe();
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Batch b = RandomBatch(c, 203, 60, seed);
  const float scale = 1.0f / static_cast<float>(b.NumValidTargets());
  auto cpu = *Model::Create(c, seed);
  cpu->SetNumerics(CpuNumerics(TrainPrecision::kBf16));
  SetBiases(cpu->params(), seed);
  cpu->BeginStep(static_cast<double>(b.T));
  const LossStats want = cpu->ForwardBackward(b, scale, Recompute::None());
  auto gpu_or = CudaModel::Create(c, seed);
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status();
  auto& gpu = *gpu_or;
  SetBiases(gpu->host_params(), seed);
  ASSERT_TRUE(gpu->UploadParams().ok());
  gpu->SetPoisonActivations(true);
  gpu->BeginStep(static_cast<double>(b.T));
  auto got = gpu->ForwardBackward(b, scale, Recompute::None());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->n_valid, want.n_valid);
  EXPECT_NEAR(got->loss_sum / want.loss_sum, 1.0, 1e-2);
  ASSERT_TRUE(gpu->DownloadGrads().ok());
  double worst = 0.0, worst_cos = 1.0;
  std::string report;
  for (const testing::GradAgreement& g : testing::CompareGradients(
           cpu->params(), cpu->params().flat_grad().f32(), gpu->host_params().flat_grad().f32())) {
    if (g.name.find("router.bias") != std::string::npos) continue;  // no gradient
    const double rel = g.rel / (g.norm ? 3.0 : 1.0);
    worst = std::max(worst, rel);
    worst_cos = std::min(worst_cos, g.cos);
    if (rel > 0.006 || g.cos < 0.9995)
      report += "\n  " + g.name + ": rel " + std::to_string(g.rel) + " cos " + std::to_string(g.cos);
  }
  EXPECT_LT(worst, 0.06) << report;
  EXPECT_GT(worst_cos, 0.995) << report;
  // The loads and the biases they move.
  auto want_moe = cpu->FinishMoeStep(nullptr);
  auto got_moe = gpu->FinishMoeStep(nullptr);
  ASSERT_TRUE(want_moe.ok() && got_moe.ok());
  const auto& wl = (*want_moe)["moe"]["load_max_over_mean"];
  const auto& gl = (*got_moe)["moe"]["load_max_over_mean"];
  ASSERT_EQ(gl.size(), 3u);  // layers 1-3
  const double pair = 8.0 / (203.0 * 2.0);  // one pair of an expert, over the mean load
  for (size_t i = 0; i < wl.size(); ++i)
    EXPECT_NEAR(gl[i].get<double>(), wl[i].get<double>(), pair + 1e-9) << "layer " << i + 1;
  const auto& wb = (*want_moe)["moe"]["bias_max"];
  const auto& gb = (*got_moe)["moe"]["bias_max"];
  for (size_t i = 0; i < wb.size(); ++i)
    EXPECT_NEAR(gb[i].get<double>(), wb[i].get<double>(), 2 * 0.01 + 1e-6) << "layer " << i + 1;
}

// Every layer recomputing (the MoE forward runs again before its backward, exchange and all) and
// a fresh model's second run both give the plain step's gradients.
TEST(CudaMoe, RecomputeAndASecondRunRepeatTheStep) {
  SPINDLE_REQUIRE_GPU();
  const ModelConfig c = TinyMoe();
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Batch b = RandomBatch(c, 160, 50, seed);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  std::unique_ptr<CudaModel> first;
  for (const Recompute r : {Recompute::None(), Recompute::All(), Recompute::None()}) {
    auto m = CudaModel::Create(c, seed);
    ASSERT_TRUE(m.ok()) << m.status();
    (*m)->BeginStep(static_cast<double>(b.T));
    auto s = (*m)->ForwardBackward(b, 0.01f, r);
    ASSERT_TRUE(s.ok()) << s.status();
    losses.push_back(s->loss_sum);
    ASSERT_TRUE((*m)->DownloadGrads().ok());
    ParamSet& P = (*m)->host_params();
    grads.emplace_back(P.flat_grad().f32(), P.flat_grad().f32() + P.numel());
    if (!first) first = std::move(*m);
  }
  for (int run : {1, 2}) {
    EXPECT_EQ(losses[run], losses[0]) << "run " << run;
    const std::string report =
        testing::GradientsAbove(first->host_params(), grads[0].data(), grads[run].data(), 1e-3);
    EXPECT_TRUE(report.empty()) << "run " << run << ":" << report;
  }
}

TEST(CudaMoe, Fp8IsRefusedByName) {
  SPINDLE_REQUIRE_GPU();
  auto m = CudaModel::Create(TinyMoe(), 1);
  ASSERT_TRUE(m.ok()) << m.status();
  const absl::Status s = (*m)->SetPrecision(TrainPrecision::kFp8);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("does not run the mixture-of-experts FFN yet"), std::string::npos) << s;
}

}  // namespace
}  // namespace spindle
