// CudaModel's mixture-of-experts FFN against the CPU engine's bf16 emulation (the same model, the
// same bf16 roundings of the same tensors: worker/engine/numerics.h), on a tiny-moe variant with a
// dense first layer, a shared expert, random balancing biases and the router z-loss, on fresh
// random tokens with documents: one training step's loss and every parameter's gradient, the
// loads the router's choices put on the experts and the biases they move; recomputing every layer
// gives the step of keeping every cache; a second fresh model repeats the step; expert
// parallelism (ep 2 with cp 2, and ep 4 with cp 2 x dp 2; ranks as threads sharing the GPU, Gloo
// between them through pinned staging) gives the one-rank step; under train.precision fp8 the step
// follows the bf16 one within FP8's error, and recomputing repeats it; under the blockwise recipe
// the step matches the CPU's blockwise emulation (with and without recompute) and expert
// parallelism gives the one-rank step. Skips without a GPU.
//
// Tolerances: as test_cuda_model.cc's (loss 1%, each matrix's gradient 6% in relative L2, norm
// weights 18%), but against the emulation, so the router sees the same bf16 inputs on both and
// chooses the same experts (a near tie decided differently would move a few rows of an expert's
// gradient: the loads are compared to one pair an expert).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "model_test_util.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/batch.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/cp/cp_layout.h"
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
      report +=
          "\n  " + g.name + ": rel " + std::to_string(g.rel) + " cos " + std::to_string(g.cos);
  }
  EXPECT_LT(worst, 0.06) << report;
  EXPECT_GT(worst_cos, 0.995) << report;
  // The loads and the biases they move.
  auto want_moe = cpu->FinishMoeStep(nullptr);
  auto got_moe = gpu->FinishMoeStep(nullptr);
  ASSERT_TRUE(want_moe.ok() && got_moe.ok());
  const auto& wl = (*want_moe)["moe"]["load_max_over_mean"];
  const auto& gl = (*got_moe)["moe"]["load_max_over_mean"];
  ASSERT_EQ(gl.size(), 3u);                 // layers 1-3
  const double pair = 8.0 / (203.0 * 2.0);  // one pair of an expert, over the mean load
  for (size_t i = 0; i < wl.size(); ++i)
    EXPECT_NEAR(gl[i].get<double>(), wl[i].get<double>(), pair + 1e-9) << "layer " << i + 1;
  // The router's mean lse^2 (the z-loss it reports), reduced on the device.
  const auto& wz = (*want_moe)["moe"]["router_lse_sq"];
  const auto& gz = (*got_moe)["moe"]["router_lse_sq"];
  ASSERT_EQ(gz.size(), wz.size());
  for (size_t i = 0; i < wz.size(); ++i) {
    EXPECT_GT(wz[i].get<double>(), 0.0) << "layer " << i + 1;
    EXPECT_NEAR(gz[i].get<double>() / wz[i].get<double>(), 1.0, 1e-3) << "layer " << i + 1;
  }
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

// The experts' GEMMs on the persistent grouped kernel (CudaModel::SetExpertGemm, bf16, sm_90;
// elsewhere it falls back to streams per call, and the test then checks that path) against the
// default two streams of cuBLASLt calls: the same products with other fp32 summation orders,
// rounded to bf16 at the same points, so the loss agrees within 1e-3 and every tensor's gradient
// within 2% (relative L2; bf16's step is 0.4%; the rows are grouped with other padding, 64
// against 1, which changes no value). Setting "streams" again repeats the first step exactly, and
// an unknown name is refused.
TEST(CudaMoe, PersistentExpertGemmFollowsTheStreamsStep) {
  SPINDLE_REQUIRE_GPU();
  const ModelConfig c = TinyMoe();
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Batch b = RandomBatch(c, 224, 70, seed);
  auto m = CudaModel::Create(c, seed);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->SetExpertGemm("cutlass").code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (const char* method : {"streams", "persistent", "streams"}) {
    ASSERT_TRUE((*m)->SetExpertGemm(method).ok()) << method;
    ASSERT_TRUE((*m)->ZeroGrads().ok());
    (*m)->BeginStep(static_cast<double>(b.T));
    auto s = (*m)->ForwardBackward(b, 0.01f, Recompute::None());
    ASSERT_TRUE(s.ok()) << method << ": " << s.status();
    losses.push_back(s->loss_sum);
    ASSERT_TRUE((*m)->DownloadGrads().ok());
    ParamSet& P = (*m)->host_params();
    grads.emplace_back(P.flat_grad().f32(), P.flat_grad().f32() + P.numel());
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-3 * std::abs(losses[0]));
  const std::string report =
      testing::GradientsAbove((*m)->host_params(), grads[0].data(), grads[1].data(), 2e-2);
  EXPECT_TRUE(report.empty()) << "persistent against streams:" << report;
  EXPECT_EQ(losses[2], losses[0]);
  EXPECT_EQ(grads[2], grads[0]);
}

// ep ranks of `ep` (with cp 2, dp = ep / cp sequences) against one rank over every sequence: the
// summed losses, and every tensor's gradient assembled from the ranks (the experts from their
// shards, the rest summed), compared as test_cuda_cp.cc compares CP (relative L2 3%, norm weights
// 9%; the layouts round differently in bf16). The loads must agree (a near tie decided
// differently would move a token to another expert: see test_moe_model.cc).
// `blockwise`: both sides under train.precision fp8 with the blockwise recipe, whose FP8 values
// are the same at any ep (numerics.h: row blocks each token's own, the weight gradients' column
// blocks restarting at each (expert, source rank) segment, which at ep > 1 start off the 16-row
// grid, so those GEMMs run on our own block-scaled kernel); where the layouts' different bf16
// roundings move a value across an FP8 rounding boundary the two differ by one FP8 step of it,
// so the bounds are the FP8 tests' (relative L2 15%, norm weights 30%, cosine above 0.99).
void ExpectExpertParallelMatchesOneRank(int ep, bool blockwise = false) {
  const ModelConfig c = TinyMoe();
  const int cp = 2, dp = std::max(1, ep / cp), world = cp * dp;
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << "seed " << seed << " ep " << ep << (blockwise ? " blockwise" : ""));
  auto set_precision = [&](CudaModel& m) {
    return blockwise ? m.SetPrecision(TrainPrecision::kFp8, TrainFp8Recipe::kBlockwise)
                     : absl::OkStatus();
  };
  std::vector<Batch> seqs;
  int64_t valid = 0;
  for (int i = 0; i < dp; ++i) {
    seqs.push_back(RandomBatch(c, 128, 40, seed + i));
    valid += seqs.back().NumValidTargets();
  }
  const float scale = 1.0f / static_cast<float>(valid);
  // One rank.
  auto one = CudaModel::Create(c, seed);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(set_precision(**one).ok());
  (*one)->BeginStep(static_cast<double>(dp * 128));
  double want_loss = 0.0;
  for (const Batch& b : seqs) {
    auto s = (*one)->ForwardBackward(b, scale, Recompute::None());
    ASSERT_TRUE(s.ok()) << s.status();
    want_loss += s->loss_sum;
  }
  ASSERT_TRUE((*one)->DownloadGrads().ok());
  ParamSet& W = (*one)->host_params();
  // The world.
  MemoryKvStore store;
  std::vector<double> losses(world);
  std::vector<std::vector<float>> whole(world, std::vector<float>(W.numel(), 0.0f));
  absl::Status st = testing::RunRanks(world, [&](int rank) -> absl::Status {
    const int cp_rank = rank % cp, dp_rank = rank / cp;
    auto cc = CreateGlooCommunicator(store, absl::StrCat("cp", dp_rank), cp_rank, cp,
                                     testing::TestGloo());
    if (!cc.ok()) return cc.status();
    auto ec = CreateGlooCommunicator(store, absl::StrCat("ep", rank / ep), rank % ep, ep,
                                     testing::TestGloo());
    if (!ec.ok()) return ec.status();
    auto m = CudaModel::Create(c, seed, 0, ep, rank % ep);
    if (!m.ok()) return m.status();
    if (absl::Status s = (*m)->SetCp({cc->get(), CpMode::kAll2All, CpMode::kAll2All}); !s.ok())
      return s;
    if (absl::Status s = (*m)->SetExpertParallel(ec->get()); !s.ok()) return s;
    if (absl::Status s = set_precision(**m); !s.ok()) return s;
    (*m)->BeginStep(static_cast<double>(dp * 128));
    auto b = ShardForCp(seqs[dp_rank], cp, cp_rank);
    if (!b.ok()) return b.status();
    auto s = (*m)->ForwardBackward(*b, scale, Recompute::None());
    if (!s.ok()) return s.status();
    losses[rank] = s->loss_sum;
    if (!(*m)->DownloadGrads().ok()) return absl::InternalError("gradient download failed");
    ParamSet& P = (*m)->host_params();
    for (int i = 0; i < P.size(); ++i) {
      const ParamInfo& p = P.info(i);
      const int w = W.Find(p.name);
      if (w < 0) return absl::InternalError(p.name);
      for (int64_t j = 0; j < p.numel; ++j)
        whole[rank][W.info(w).offset + p.full_offset + j] = P.grad(i)[j];
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  double got_loss = 0.0;
  std::vector<float> sum(W.numel(), 0.0f);
  for (int r = 0; r < world; ++r) {
    got_loss += losses[r];
    for (int64_t j = 0; j < W.numel(); ++j) sum[j] += whole[r][j];
  }
  EXPECT_NEAR(got_loss / want_loss, 1.0, 1e-2);
  std::string report;
  for (const testing::GradAgreement& g :
       testing::CompareGradients(W, W.flat_grad().f32(), sum.data())) {
    if (g.name.find("router.bias") != std::string::npos) continue;
    const double rel = g.rel / (g.norm ? 3.0 : 1.0);
    if (blockwise ? g.rel > (g.norm ? 0.30 : 0.15) || g.cos < 0.99 : rel > 0.03 || g.cos < 0.999)
      report +=
          "\n  " + g.name + ": rel " + std::to_string(g.rel) + " cos " + std::to_string(g.cos);
  }
  EXPECT_TRUE(report.empty()) << report;
}

TEST(CudaMoe, ExpertParallelOverGlooMatchesOneRank) {
  SPINDLE_REQUIRE_GPU();
  ExpectExpertParallelMatchesOneRank(2);
  ExpectExpertParallelMatchesOneRank(4);
}

// train.precision fp8: the experts' grouped GEMMs on FP8 codes (a scale per expert, the gathers
// quantizing, each expert's rows padded to 16 by the grouping) against the same model's bf16 step
// on the GPU. FP8's own error (about 4% per GEMM input, 6% per product: test_fp8_cuda.cc) over the
// attention's and the experts' GEMMs: loss within 2%, each matrix's gradient within 15% relative L2
// (norm weights 30%) and cosine above 0.99, test_cuda_model.cc's FP8 tolerances; the experts'
// gradients must differ from bf16's by more than bf16 roundings (or FP8 did not run). Recomputing
// every layer repeats the FP8 step (same quantizations of the same values).
TEST(CudaMoe, Fp8StepFollowsTheBf16Step) {
  SPINDLE_REQUIRE_GPU();
  const ModelConfig c = TinyMoe();
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Batch b = RandomBatch(c, 208, 60, seed);
  const float scale = 1.0f / static_cast<float>(b.NumValidTargets());
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  std::unique_ptr<CudaModel> first;
  const std::pair<TrainPrecision, Recompute> runs[] = {{TrainPrecision::kBf16, Recompute::None()},
                                                       {TrainPrecision::kFp8, Recompute::None()},
                                                       {TrainPrecision::kFp8, Recompute::All()}};
  for (const auto& [precision, recompute] : runs) {
    auto m = CudaModel::Create(c, seed);
    ASSERT_TRUE(m.ok()) << m.status();
    SetBiases((*m)->host_params(), seed);
    ASSERT_TRUE((*m)->UploadParams().ok());
    const absl::Status set = (*m)->SetPrecision(precision);
    ASSERT_TRUE(set.ok()) << set;
    (*m)->SetPoisonActivations(true);
    (*m)->BeginStep(static_cast<double>(b.T));
    auto s = (*m)->ForwardBackward(b, scale, recompute);
    ASSERT_TRUE(s.ok()) << s.status();
    losses.push_back(s->loss_sum);
    ASSERT_TRUE((*m)->DownloadGrads().ok());
    ParamSet& P = (*m)->host_params();
    grads.emplace_back(P.flat_grad().f32(), P.flat_grad().f32() + P.numel());
    if (!first) first = std::move(*m);
  }
  EXPECT_NEAR(losses[1] / losses[0], 1.0, 2e-2);
  double experts_rel = 0.0;
  std::string report;
  for (const testing::GradAgreement& g :
       testing::CompareGradients(first->host_params(), grads[0].data(), grads[1].data())) {
    if (g.name.find("router.bias") != std::string::npos) continue;  // no gradient
    if (g.rel > (g.norm ? 0.30 : 0.15) || g.cos < 0.99)
      report +=
          "\n  " + g.name + ": rel " + std::to_string(g.rel) + " cos " + std::to_string(g.cos);
    if (g.name.find("experts.") != std::string::npos) experts_rel = std::max(experts_rel, g.rel);
  }
  EXPECT_TRUE(report.empty()) << report;
  EXPECT_GT(experts_rel, 0.01) << "the experts' gradients are bf16's: FP8 did not run";
  EXPECT_EQ(losses[2], losses[1]);
  const std::string recomputed =
      testing::GradientsAbove(first->host_params(), grads[1].data(), grads[2].data(), 1e-3);
  EXPECT_TRUE(recomputed.empty()) << "recompute under fp8:" << recomputed;
}

// train.fp8_recipe "blockwise": the experts' grouped GEMMs on block-scaled FP8 (each expert's
// weights in 128 x 128 blocks, the gathered rows, SwiGLU's output and the output gradients in
// 1 x 128 row blocks, their transposed codes in 128-token blocks per expert) against the CPU's
// blockwise emulation, which quantizes the same values in the same blocks, and against the exact
// fp32 step: test_cuda_model.cc's blockwise bounds for the same reasons (the two sides differ by
// bf16 roundings and, where one moves a value across an FP8 rounding boundary or a block's amax
// across a power of two, by one FP8 step of the values concerned): loss within 1%, 15% relative
// L2 per matrix gradient (norms 30%), cosine above 0.99, the emulation closer than fp32. 640
// tokens choosing 2 of 8 experts put about 160 rows on an expert: one and two (the second
// partial) 128-token column blocks per expert; d 64 and the experts' 32 give partial row blocks.
// Recomputing every layer (the first forward writes no transposed codes, the backward's forward
// writes them) must match as well.
void ExpectBlockwiseStepMatchesEmulation(Recompute rc) {
  const ModelConfig c = TinyMoe();
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " recompute " << rc.layers);
  const Batch b = RandomBatch(c, 640, 90, seed);
  const float scale = 1.0f / static_cast<float>(b.NumValidTargets());
  auto cpu_step = [&](Numerics n, std::unique_ptr<Model>* out) {
    auto m = *Model::Create(c, seed);
    m->SetNumerics(n);
    SetBiases(m->params(), seed);
    m->BeginStep(static_cast<double>(b.T));
    const LossStats l = m->ForwardBackward(b, scale, Recompute::None());
    *out = std::move(m);
    return l;
  };
  std::unique_ptr<Model> emulated, exact;
  const LossStats want =
      cpu_step(CpuNumerics(TrainPrecision::kFp8, TrainFp8Recipe::kBlockwise), &emulated);
  const LossStats exact_loss = cpu_step(CpuNumerics(TrainPrecision::kFp32), &exact);
  auto gpu_or = CudaModel::Create(c, seed);
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status();
  auto& gpu = *gpu_or;
  SetBiases(gpu->host_params(), seed);
  ASSERT_TRUE(gpu->UploadParams().ok());
  const absl::Status set = gpu->SetPrecision(TrainPrecision::kFp8, TrainFp8Recipe::kBlockwise);
  ASSERT_TRUE(set.ok()) << set;
  gpu->SetPoisonActivations(true);
  gpu->BeginStep(static_cast<double>(b.T));
  auto got = gpu->ForwardBackward(b, scale, rc);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(gpu->DownloadGrads().ok());
  std::printf("[ moe blockwise ] loss: gpu %.6f emulated %.6f fp32 %.6f\n",
              got->loss_sum / got->n_valid, want.loss_sum / want.n_valid,
              exact_loss.loss_sum / exact_loss.n_valid);
  EXPECT_NEAR(got->loss_sum / want.loss_sum, 1.0, 1e-2);
  const float* g = gpu->host_params().flat_grad().f32();
  const auto vs_emulation =
      testing::CompareGradients(emulated->params(), emulated->params().flat_grad().f32(), g);
  const auto vs_exact =
      testing::CompareGradients(exact->params(), exact->params().flat_grad().f32(), g);
  double sum_emulation = 0, sum_exact = 0;
  for (size_t i = 0; i < vs_emulation.size(); ++i) {
    const testing::GradAgreement &e = vs_emulation[i], &x = vs_exact[i];
    if (e.name.find("router.bias") != std::string::npos) continue;  // no gradient
    std::printf("[ moe blockwise ] %-32s rel vs emulation %.4f  vs fp32 %.4f\n", e.name.c_str(),
                e.rel, x.rel);
    EXPECT_LT(e.rel, e.norm ? 0.30 : 0.15) << e.name;
    EXPECT_GT(e.cos, 0.99) << e.name;
    sum_emulation += e.rel, sum_exact += x.rel;
  }
  EXPECT_LT(sum_emulation, sum_exact)
      << "the GPU's blockwise step is closer to fp32 than to the emulation";
}

TEST(CudaMoe, Fp8BlockwiseStepMatchesTheCpuEmulation) {
  SPINDLE_REQUIRE_GPU();
  ExpectBlockwiseStepMatchesEmulation(Recompute::None());
  ExpectBlockwiseStepMatchesEmulation(Recompute::All());
}

// Expert parallelism under blockwise (see ExpectExpertParallelMatchesOneRank): ep 2 with cp 2.
TEST(CudaMoe, Fp8BlockwiseExpertParallelOverGlooMatchesOneRank) {
  SPINDLE_REQUIRE_GPU();
  ExpectExpertParallelMatchesOneRank(2, /*blockwise=*/true);
}

// An expert width FP8's GEMMs cannot take is refused by name, and the model still trains in bf16.
TEST(CudaMoe, Fp8RefusesAnExpertWidthItCannotRun) {
  SPINDLE_REQUIRE_GPU();
  ModelConfig c = TinyMoe();
  c.moe.expert_ffn = 40;
  auto m = CudaModel::Create(c, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  const absl::Status s = (*m)->SetPrecision(TrainPrecision::kFp8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("moe.expert_ffn"), std::string::npos) << s;
  (*m)->BeginStep(112.0);
  EXPECT_TRUE((*m)->ForwardBackward(RandomBatch(c, 112, 30, 1), 0.01f, Recompute::None()).ok());
}

}  // namespace
}  // namespace spindle
