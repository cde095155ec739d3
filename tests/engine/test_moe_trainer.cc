// The trainer with a mixture-of-experts model:
//  - A checkpoint written at ep = 4 (cp 2 x dp 2, ranks as threads with Gloo) holds whole expert
//    tensors: it resumes at ep = 1 and at ep = 2 with every rank's parameters and AdamW moments
//    bit for bit the whole tensors' (its shard of them), and the resumed steps' losses follow the
//    uninterrupted ep = 4 run within 1e-4 relative (summation order differs between layouts).
//  - The aux-loss-free balancing bias evens out a router that skewed data unbalances: the worst
//    layer's max/mean expert load falls below kBalancedLoad within 200 steps (see the bound's
//    comment for what was measured).
//  - A spec that leaves parallel.ep undecided is refused (the trainer runs planned specs).
#include <omp.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

std::string TempDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-moe-XXXXXX";
  std::string d = mkdtemp(tmpl);
  return d + "/" + tag;
}

JobSpec MoeJob(int64_t steps, int64_t ep, const std::string& ckpt) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "moe", "model": {"preset": "tiny-moe", "moe": {"z_loss": 0.01}},
          "data": {"source": "synthetic:copy"}, "seq_len": 128,
          "parallel": {"cp": 2, "dp": 2, "lightning_mode": "all2all",
                       "mla_mode": "all2all", "ep": )",
      ep, R"(}, "train": {"steps": )", steps,
      R"(, "lr": 3e-3, "seed": 5, "recompute": false},
          "checkpoint": {"dir": ")",
      ckpt, R"(", "every": 3}})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Runs the world; `check(rank, trainer)` sees each rank's trainer after Create (resumed).
absl::Status RunWorld(const JobSpec& spec, std::vector<std::vector<double>>* losses,
                      const std::function<void(int, Trainer&)>& check = nullptr) {
  const int world = static_cast<int>(spec.parallel.world());
  MemoryKvStore store;
  losses->assign(world, {});
  return testing::RunRanks(world, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = world;
    o.store = &store;
    o.gloo = testing::TestGloo();
    auto t = Trainer::Create(std::move(o));
    if (!t.ok()) return t.status();
    if (check) check(rank, **t);
    if (absl::Status s = (*t)->Run(); !s.ok()) return s;
    (*losses)[rank] = (*t)->losses();
    return absl::OkStatus();
  });
}

TEST(MoeTrainer, CheckpointAtEp4ResumesAtEp1AndEp2Exactly) {
  const std::string root = TempDir("ckpt");
  std::vector<std::vector<double>> full;
  const absl::Status run = RunWorld(MoeJob(6, 4, root), &full);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(full[0].size(), 6u);
  // The step-3 checkpoint, loaded whole (ep 1) as the reference of what every layout must read.
  const std::string step3 = root + "/step_00000003";
  const JobSpec ref_spec = MoeJob(6, 4, root);
  auto whole = Model::Create(ref_spec.model, 5);
  ASSERT_TRUE(whole.ok());
  Optimizer whole_opt(ref_spec.train, (*whole)->params());
  ASSERT_TRUE(LoadCheckpoint(step3, (*whole)->params(), &whole_opt, ref_spec.model).ok());
  for (int64_t ep : {1, 2}) {
    // Resume from step 3 at this ep: a copy of the root without the step-6 checkpoint.
    const std::string copy = TempDir(absl::StrCat("ep", ep));
    ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", copy, " && cp -r ", step3, " ", copy,
                                       "/").c_str()),
              0);
    std::vector<std::vector<double>> resumed;
    std::atomic<int64_t> checked{0};  // the ranks run on threads of their own
    absl::Status s = RunWorld(MoeJob(6, ep, copy), &resumed, [&](int rank, Trainer& t) {
      EXPECT_EQ(t.state().step, 3);
      ParamSet& P = t.backend().host_params();
      ParamSet& W = (*whole)->params();
      for (int i = 0; i < P.size(); ++i) {
        const ParamInfo& p = P.info(i);
        const int w = W.Find(p.name);
        ASSERT_GE(w, 0) << p.name;
        const int64_t at = W.info(w).offset + p.full_offset;
        for (int64_t j = 0; j < p.numel; ++j) {
          ASSERT_EQ(P.data(i)[j], W.data(w)[p.full_offset + j]) << p.name << " rank " << rank;
          ASSERT_EQ(t.optimizer().state0().f32()[p.offset + j], whole_opt.state0().f32()[at + j])
              << p.name;
          ASSERT_EQ(t.optimizer().state1().f32()[p.offset + j], whole_opt.state1().f32()[at + j])
              << p.name;
        }
        if (p.sharded()) EXPECT_EQ(p.shape[0] * ep, p.full_shape[0]) << p.name;
      }
      ++checked;
    });
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(checked.load(), 4);
    ASSERT_EQ(resumed[0].size(), 3u) << "ep " << ep;
    for (int i = 0; i < 3; ++i)
      EXPECT_NEAR(resumed[0][i], full[0][3 + i], 1e-4 * full[0][3 + i])
          << "ep " << ep << ", step " << 4 + i;
  }
}

// The bound, measured first (tiny-moe: 8 experts, top 2; 512-token sequences of Zipf-distributed
// tokens, so that the embedding steers most tokens to the same experts; lr 1e-6, so that the
// data's skew and not learning decides the routing). The worst layer's max/mean load starts at
// 1.35-2.2 (exponents 1.0-1.5) and its mean over steps 191-200 is 1.17-1.27 with the default
// bias_rate 1e-3, reached by step 15-47; without the bias (bias_rate 0) it stays near 1.44. At
// 512 x 2 / 8 = 128 pairs an expert, the sampling noise alone puts the worst of 4 layers near
// 1.15. (Training faster, lr 1e-4 from step 0, makes the last layers' inputs alike for every token
// as the model first learns token frequencies: then no bias can spread them, and the load goes to
// 4 = E / K with or without it.)
constexpr double kBalancedLoad = 1.3;

// The worst layer's max/mean load of each of 200 steps.
std::vector<double> WorstLoads(const std::string& tokens, double bias_rate, uint32_t seed) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "bal", "model": {"preset": "tiny-moe", "moe": {"bias_rate": )", bias_rate,
      R"(}}, "data": {"source": "tokens:)", tokens, R"(", "token_bytes": 2, "eos_id": 0},
          "seq_len": 512, "parallel": {"ep": 1},
          "train": {"steps": 200, "lr": 1e-6, "schedule": "constant", "seed": )",
      seed, R"(, "recompute": false}})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  std::vector<double> worst;
  TrainerOptions o;
  o.spec = *spec;
  o.on_event = [&](const nlohmann::json& e) {
    if (e.value("event", "") != "step") return;
    double most = 0.0;
    for (double r : e["moe"]["load_max_over_mean"]) most = std::max(most, r);
    worst.push_back(most);
  };
  auto t = Trainer::Create(std::move(o));
  EXPECT_TRUE(t.ok()) << t.status();
  if (t.ok()) EXPECT_TRUE((*t)->Run().ok());
  return worst;
}

TEST(MoeTrainer, BalancingBiasEvensTheLoadOnSkewedData) {
  // Tokens from a Zipf law (exponent 1.2) over 255 ids, documents of 40.
  const std::string dir = TempDir("data");
  ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", dir).c_str()), 0);
  std::mt19937 gen(std::random_device{}());
  std::vector<double> w(255);
  for (int i = 0; i < 255; ++i) w[i] = 1.0 / std::pow(i + 1.0, 1.2);
  std::discrete_distribution<int> zipf(w.begin(), w.end());
  std::vector<uint16_t> toks;
  while (toks.size() < 40000) {
    for (int i = 0; i < 39; ++i) toks.push_back(static_cast<uint16_t>(1 + zipf(gen)));
    toks.push_back(0);
  }
  std::ofstream(dir + "/tokens.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(toks.data()), toks.size() * 2);
  const uint32_t seed = gen() % 1000;
  auto last10 = [](const std::vector<double>& v) {
    double m = 0.0;
    for (size_t i = v.size() - 10; i < v.size(); ++i) m += v[i] / 10;
    return m;
  };
  const std::vector<double> with = WorstLoads(dir + "/tokens.bin", 1e-3, seed);
  const std::vector<double> without = WorstLoads(dir + "/tokens.bin", 0.0, seed);
  ASSERT_EQ(with.size(), 200u);
  ASSERT_EQ(without.size(), 200u);
  EXPECT_GT(with[0], kBalancedLoad) << "the data must unbalance the router at first; seed " << seed;
  EXPECT_LT(last10(with), kBalancedLoad) << "first " << with[0] << ", seed " << seed;
  EXPECT_GT(last10(without), last10(with)) << "seed " << seed;
}

TEST(MoeTrainer, TheDenseTrainerRefusesAnUndecidedEp) {
  auto spec = ParseJobSpec(R"({"name": "m", "model": {"preset": "tiny-moe"},
      "data": {"source": "synthetic:copy"}, "seq_len": 64, "train": {"recompute": false}})");
  ASSERT_TRUE(spec.ok());
  TrainerOptions o;
  o.spec = *spec;
  auto t = Trainer::Create(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("parallel.ep is not decided"), std::string::npos);
  o.spec.parallel.ep = 1;
  EXPECT_TRUE(Trainer::Create(o).ok());
}

}  // namespace
}  // namespace spindle
