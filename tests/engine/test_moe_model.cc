// The mixture-of-experts model under expert parallelism: ep = 2 and 4 with cp = 2 and 4 (dp
// filling the world where ep > cp), ranks as threads with their own Gloo communicators over
// 127.0.0.1, equal the ep = 1, cp = 1 model run over the same sequences: the summed losses, every
// dense parameter's gradient summed over the world, every expert tensor's gradient assembled from
// the ranks' shards, and the balancing biases after FinishMoeStep (the loads summed over the
// world). The model has a dense first layer, a shared expert, random balancing biases (so that
// they steer the choices) and the router z-loss; the sequences pack documents that cross chunk and
// rank boundaries. One case recomputes every layer (the exchanges run again in the recompute).
// Under FP8, ep = 2 against ep = 1 over the same cp = 2 layout, both recipes (the last test).
//
// Tolerance (fp32): loss sum relative 1e-5; per tensor max |g_ep - g_1| <= 1e-4 max |g_1|;
// biases exactly equal (the same integer loads move them by the same steps). Top-k routing is
// discontinuous: where a token's k-th and (k+1)-th expert score within the summation-order
// differences of the layouts (~1e-7), the two runs may choose differently, and that token's
// gradients then differ by far more than 1e-4 (seen about once in 40 runs). Such a run shows as
// different loads (the experts' pairs, summed over the ranks), and the case is drawn again with a
// fresh seed, up to 4 times.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "tests/engine/moe_test_util.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/model.h"

namespace spindle {
namespace {

using testing::MoeTestConfig;

// The same random biases on every model, so that they take part in the choices.
void SetBiases(Model& m, uint32_t seed) {
  ParamSet& P = m.params();
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int i = 0; i < P.size(); ++i)
    if (P.info(i).name.find("router.bias") != std::string::npos)
      for (int64_t j = 0; j < P.info(i).numel; ++j) P.data(i)[j] = d(gen);
}

struct Result {
  std::vector<double> loads;  // every MoE layer's pairs per expert, summed over the ranks
  double loss_sum = 0.0;
  std::map<std::string, std::vector<double>> grads;   // whole tensors, by name
  std::map<std::string, std::vector<float>> biases;   // after FinishMoeStep
};

// Adds rank `m`'s gradients into `out` (its shards at their place in the whole tensors).
void AddGrads(Model& m, Result* out) {
  ParamSet& P = m.params();
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    int64_t whole = 1;
    for (int64_t n : p.full_shape) whole *= n;
    std::vector<double>& g = out->grads[p.name];
    g.resize(whole, 0.0);
    for (int64_t j = 0; j < p.numel; ++j) g[p.full_offset + j] += P.grad(i)[j];
  }
}

void AddLoads(const Model& m, Result* out) {
  std::vector<double> l;
  for (const MoeLayerStats& s : m.moe_stats()) l.insert(l.end(), s.load.begin(), s.load.end());
  out->loads.resize(l.size(), 0.0);
  for (size_t i = 0; i < l.size(); ++i) out->loads[i] += l[i];
}

void TakeBiases(Model& m, Result* out) {
  ParamSet& P = m.params();
  for (int i = 0; i < P.size(); ++i)
    if (P.info(i).name.find("router.bias") != std::string::npos)
      out->biases[P.info(i).name].assign(P.data(i), P.data(i) + P.info(i).numel);
}

Result Reference(const ModelConfig& cfg, const std::vector<Batch>& seqs, Recompute recompute,
                 uint32_t bias_seed) {
  auto m = Model::Create(cfg, 7);
  EXPECT_TRUE(m.ok()) << m.status();
  SetBiases(**m, bias_seed);
  (*m)->params().ZeroGrad();
  (*m)->BeginStep(static_cast<double>(seqs.size() * seqs[0].T));
  Result r;
  for (const Batch& b : seqs) r.loss_sum += (*m)->ForwardBackward(b, 1.0f, recompute).loss_sum;
  AddGrads(**m, &r);
  AddLoads(**m, &r);
  EXPECT_TRUE((*m)->FinishMoeStep(nullptr).ok());
  TakeBiases(**m, &r);
  return r;
}

absl::StatusOr<Result> RunExpertParallel(const ModelConfig& cfg, const std::vector<Batch>& seqs,
                                         int cp, int ep, Recompute recompute, uint32_t bias_seed,
                                         const Numerics& numerics = Numerics{}) {
  const int dp = static_cast<int>(seqs.size()), world = cp * dp;
  MemoryKvStore store;
  std::vector<Result> per(world);
  absl::Status st = testing::RunRanks(world, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    const int cp_rank = rank % cp, dp_rank = rank / cp;
    auto wc = CreateGlooCommunicator(store, "world", rank, world, testing::TestGloo());
    if (!wc.ok()) return wc.status();
    auto cc = CreateGlooCommunicator(store, absl::StrCat("cp", dp_rank), cp_rank, cp,
                                     testing::TestGloo());
    if (!cc.ok()) return cc.status();
    auto ec = CreateGlooCommunicator(store, absl::StrCat("ep", rank / ep), rank % ep, ep,
                                     testing::TestGloo());
    if (!ec.ok()) return ec.status();
    auto m = Model::Create(cfg, 7, true, ep, rank % ep);
    if (!m.ok()) return m.status();
    SetBiases(**m, bias_seed);
    (*m)->SetNumerics(numerics);
    (*m)->SetCp({cc->get(), CpMode::kAll2All, CpMode::kAll2All});
    if (absl::Status s = (*m)->SetExpertParallel(ec->get()); !s.ok()) return s;
    auto b = ShardForCp(seqs[dp_rank], cp, cp_rank);
    if (!b.ok()) return b.status();
    (*m)->params().ZeroGrad();
    (*m)->BeginStep(static_cast<double>(seqs.size() * seqs[0].T));
    auto s = (*m)->ForwardBackward(*b, 1.0f, recompute);
    if (!s.ok()) return s.status();
    per[rank].loss_sum = s->loss_sum;
    AddGrads(**m, &per[rank]);
    AddLoads(**m, &per[rank]);
    auto fields = (*m)->FinishMoeStep(wc->get());
    if (!fields.ok()) return fields.status();
    TakeBiases(**m, &per[rank]);
    // Dispatch and return moved bytes over the EP group (an all-to-all of counts and of rows).
    int64_t moe_calls = 0;
    for (const auto& [key, amount] : (*ec)->TakeStats())
      if (key.second == CommLayer::kMoe) moe_calls += amount.calls;
    if (ep > 1) EXPECT_GT(moe_calls, 0) << "rank " << rank;
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  Result sum;
  for (int r = 0; r < world; ++r) {
    sum.loss_sum += per[r].loss_sum;
    sum.loads.resize(per[r].loads.size(), 0.0);
    for (size_t i = 0; i < per[r].loads.size(); ++i) sum.loads[i] += per[r].loads[i];
    for (const auto& [name, g] : per[r].grads) {
      std::vector<double>& s = sum.grads[name];
      s.resize(g.size(), 0.0);
      for (size_t j = 0; j < g.size(); ++j) s[j] += g[j];
    }
    for (const auto& [name, b] : per[r].biases)
      EXPECT_EQ(b, per[0].biases.at(name)) << name << ": rank " << r << " moved its biases apart";
  }
  sum.biases = per[0].biases;
  return sum;
}

struct Case {
  int cp, ep;
  bool recompute;
};

class MoeExpertParallel : public ::testing::TestWithParam<Case> {};

TEST_P(MoeExpertParallel, MatchesOneRank) {
  const auto [cp, ep, recompute_all] = GetParam();
  const ModelConfig cfg = MoeTestConfig();
  const int dp = std::max(1, ep / cp);
  const Recompute rc = recompute_all ? Recompute::All() : Recompute::None();
  uint32_t seed = 0;
  Result ref;
  absl::StatusOr<Result> got;
  for (int draw = 0; draw < 4; ++draw) {
    seed = std::random_device{}();
    std::vector<Batch> seqs;
    for (int i = 0; i < dp; ++i) seqs.push_back(MakeSequenceBatch(testing::PackedTokens(seed + i), 256));
    ref = Reference(cfg, seqs, rc, seed);
    got = RunExpertParallel(cfg, seqs, cp, ep, rc, seed);
    ASSERT_TRUE(got.ok()) << got.status();
    if (got->loads == ref.loads) break;
    std::printf("seed %u: a near tie was routed differently; drawing again\n", seed);
  }
  ASSERT_EQ(got->loads, ref.loads) << "four draws routed differently, last seed " << seed;
  EXPECT_NEAR(got->loss_sum, ref.loss_sum, 1e-5 * std::abs(ref.loss_sum)) << "seed " << seed;
  ASSERT_EQ(got->grads.size(), ref.grads.size());
  for (const auto& [name, g] : ref.grads) {
    const std::vector<double>& h = got->grads.at(name);
    ASSERT_EQ(h.size(), g.size()) << name;
    double most = 0.0, diff = 0.0;
    for (size_t j = 0; j < g.size(); ++j) {
      most = std::max(most, std::abs(g[j]));
      diff = std::max(diff, std::abs(h[j] - g[j]));
    }
    if (name.find("router.bias") != std::string::npos) {
      EXPECT_EQ(most, 0.0) << name << " is moved by the loads, not by gradients";
      continue;
    }
    EXPECT_GT(most, 0.0) << name;
    EXPECT_LE(diff, 1e-4 * most) << name << ": max diff " << diff << ", max " << most << ", seed "
                                 << seed;
  }
  ASSERT_EQ(got->biases.size(), 2u);
  for (const auto& [name, b] : ref.biases) EXPECT_EQ(got->biases.at(name), b) << name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeExpertParallel,
                         ::testing::Values(Case{2, 2, false}, Case{4, 2, false}, Case{2, 4, false},
                                           Case{4, 4, false}, Case{2, 2, true}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return absl::StrCat("Cp", i.param.cp, "Ep", i.param.ep,
                                               i.param.recompute ? "Recompute" : "");
                         });

// Under FP8 the MoE FFN depends on ep only where tensorwise scaling forces it (numerics.h). ep = 2
// against ep = 1 over the same cp = 2 layout (each rank holds the same tokens in both), blockwise:
// every FP8 value is the same at both (row blocks are each row's, the weights' blocks each
// expert's, the weight gradients' column blocks each (expert, source rank)'s rows), and only the
// experts' GEMMs sum in another order (one GEMM over both sources' rows against one per rank,
// summed here). Tensorwise: a rank's scales are the amax of the rows its experts hold, at ep = 1
// its own tokens', at ep = 2 those both ranks route to its experts, so the two runs quantize with
// other scales; recorded beside and bounded loosely. Measured over 30 seeds (2 cores, OpenBLAS
// 0.3.21): blockwise the loss equal every time and every gradient within relative L2 3.2e-8 (the
// summation order); tensorwise the loss within 4.8e-7 and the expert gradients 0.085-0.118.
// Bounds: blockwise loss 1e-6 and gradients 1e-5 (room for a BLAS whose row blocking flips a
// rounding somewhere), tensorwise 1e-4 and 0.25. (Without the column blocks' restart at the
// source ranks blockwise measured up to 2.5e-7: power-of-two block scales change an FP8 value
// only where it falls into the subnormals.)
TEST(MoeExpertParallelFp8, Ep2MatchesEp1OverTheSameTokens) {
  const ModelConfig cfg = MoeTestConfig();
  for (TrainFp8Recipe recipe : {TrainFp8Recipe::kBlockwise, TrainFp8Recipe::kTensorwise}) {
    const bool blockwise = recipe == TrainFp8Recipe::kBlockwise;
    SCOPED_TRACE(blockwise ? "blockwise" : "tensorwise");
    const Numerics n = CpuNumerics(TrainPrecision::kFp8, recipe);
    uint32_t seed = 0;
    absl::StatusOr<Result> one, two;
    for (int draw = 0; draw < 4; ++draw) {
      seed = std::random_device{}();
      const std::vector<Batch> seqs = {MakeSequenceBatch(testing::PackedTokens(seed), 256)};
      one = RunExpertParallel(cfg, seqs, 2, 1, Recompute::None(), seed, n);
      two = RunExpertParallel(cfg, seqs, 2, 2, Recompute::None(), seed, n);
      ASSERT_TRUE(one.ok()) << one.status();
      ASSERT_TRUE(two.ok()) << two.status();
      if (two->loads == one->loads) break;
      std::printf("seed %u: a near tie was routed differently; drawing again\n", seed);
    }
    ASSERT_EQ(two->loads, one->loads) << "four draws routed differently, last seed " << seed;
    const double loss_rel = std::abs(two->loss_sum - one->loss_sum) / std::abs(one->loss_sum);
    std::printf("%s seed %u: loss relative %.3g\n", blockwise ? "blockwise" : "tensorwise", seed,
                loss_rel);
    EXPECT_LE(loss_rel, blockwise ? 1e-6 : 1e-4) << "seed " << seed;
    double worst = 0.0;
    std::string worst_name;
    for (const auto& [name, g] : one->grads) {
      if (name.find("router.bias") != std::string::npos) continue;
      const std::vector<double>& h = two->grads.at(name);
      double num = 0.0, den = 0.0;
      for (size_t j = 0; j < g.size(); ++j) {
        num += (h[j] - g[j]) * (h[j] - g[j]);
        den += g[j] * g[j];
      }
      const double rel = std::sqrt(num / den);
      if (rel > worst) worst = rel, worst_name = name;
      EXPECT_LE(rel, blockwise ? 1e-5 : 0.25) << name << ", seed " << seed;
    }
    std::printf("%s seed %u: worst gradient relative L2 %.3g (%s)\n",
                blockwise ? "blockwise" : "tensorwise", seed, worst, worst_name.c_str());
  }
}

// A sharded model refuses to run without its EP group, and a group of the wrong size.
TEST(MoeExpertParallel, RefusesAMissingOrWrongGroup) {
  auto m = Model::Create(MoeTestConfig(), 7, true, 2, 1);
  ASSERT_TRUE(m.ok());
  Batch b = MakeSequenceBatch(testing::PackedTokens(1), 256);
  auto cpb = ShardForCp(b, 1, 0);
  ASSERT_TRUE(cpb.ok());
  auto s = (*m)->ForwardBackward(*cpb, 1.0f, Recompute::None());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("sharded over 2 ranks"), std::string::npos) << s.status();
  EXPECT_EQ((*m)->SetExpertParallel(nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Model::Create(MoeTestConfig(), 7, true, 3, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace spindle
