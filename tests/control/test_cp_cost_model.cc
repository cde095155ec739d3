// The planner's cost model (planner/cp_cost_model.h) and its use by the planner: the bytes
// each mode sends follow bench/CP_NOTES.md's formulas, compute follows the rates and the sharing
// of a device, overlap hides what it should, candidates cover every mode the heads allow, and the
// plan marks the rule's pick and the fastest, warns when the rule is 20% slower, honours a forced
// mode and resolves "fastest".
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"
#include "common/job_spec.h"
#include "planner/cp_cost_model.h"
#include "planner/cp_planner.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

JobSpec Spec(const std::string& preset, int64_t seq_len, int64_t cp, const std::string& resources,
             const std::string& lightning = "auto", const std::string& mla = "auto") {
  auto s = ParseJobSpec(absl::StrCat(
      R"({"name": "c", "model": {"preset": ")", preset, R"("}, "data": {"source": "synthetic:recall"},
      "seq_len": )", seq_len, R"(, "parallel": {"cp": )", cp, R"(, "lightning_mode": ")", lightning,
      R"(", "mla_mode": ")", mla, R"("}, "train": {"steps": 10, "recompute": false},
      "resources": ")", resources, R"("})"));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : JobSpec{};
}

Topology Nvlink() { return DefaultTopology("cuda"); }

TEST(CpCostModel, BytesFollowEachModesFormula) {
  const CpCostModel model;
  const JobSpec s = Spec("1b", 262144, 8, "cuda");
  const ModelConfig& m = s.model;
  const double T_loc = 262144.0 / 8, H = m.n_heads, Dh = m.head_dim(), d = m.d_model;
  const double L = m.NumLayersOfKind('L'), M = m.NumLayersOfKind('M');
  const double qk = m.mla.qk_nope_dim + m.mla.qk_rope_dim, v = m.mla.v_head_dim;
  const double latent = m.mla.kv_lora_rank + m.mla.qk_rope_dim;
  // Lightning AllGather: (cp - 1) x 2 fp32 states, forward and backward.
  EXPECT_EQ(model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAllGather, 1}).bytes,
            static_cast<int64_t>(L * 2 * 7 * 2 * H * Dh * Dh * 4));
  // Lightning All2All: q, k, v out and o back, (cp-1)/cp of 4 T_loc d bf16 values, twice.
  EXPECT_EQ(model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAll2All, 1}).bytes,
            static_cast<int64_t>(L * 2 * 4 * T_loc * d * 2 * 7.0 / 8));
  // MLA All2All: Q, K, V, O, twice.
  EXPECT_EQ(model.EstimateLayers(s, Nvlink(), "mla", {CpMode::kAll2All, 1}).bytes,
            static_cast<int64_t>(M * 2 * T_loc * H * (2 * qk + 2 * v) * 2 * 7.0 / 8));
  // MLA AllGather: the bf16 latent gathered, its gradient reduce-scattered.
  EXPECT_EQ(model.EstimateLayers(s, Nvlink(), "mla", {CpMode::kAllGather, 1}).bytes,
            static_cast<int64_t>(M * 2 * 7 * T_loc * latent * 2));
  // MLA Ring: the latent (narrower than K, V) forward, it and its gradient backward.
  EXPECT_EQ(model.EstimateLayers(s, Nvlink(), "mla", {CpMode::kRing, 1}).bytes,
            static_cast<int64_t>(M * 3 * 7 * T_loc * latent * 2));
  // On the CPU, exactly the engine's own accounting (common/cp_modes.h) for every mode.
  const JobSpec c = Spec("small", 4096, 4, "cpu");
  for (const std::string type : {"lightning", "mla"}) {
    for (const ModeChoice& mode : CandidateModes(type, 4, c.model.n_heads)) {
      ParallelSpec p = c.parallel;
      p.ulysses = mode.ulysses;
      const CpCommBytes b =
          CpLayerCommBytes(c.model, type == "mla" ? 'M' : 'L', mode.mode, p, c.seq_len);
      EXPECT_EQ(model.EstimateLayers(c, DefaultTopology("cpu"), type, mode).bytes,
                (b.forward + b.backward) * c.model.NumLayersOfKind(type == "mla" ? 'M' : 'L'))
          << type << " " << ModeChoiceName(mode);
    }
  }
  // Lightning's AllGather bytes do not grow with the sequence; All2All's do.
  const JobSpec longer = Spec("1b", 524288, 8, "cuda");
  EXPECT_EQ(model.EstimateLayers(longer, Nvlink(), "lightning", {CpMode::kAllGather, 1}).bytes,
            model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAllGather, 1}).bytes);
  EXPECT_EQ(model.EstimateLayers(longer, Nvlink(), "lightning", {CpMode::kAll2All, 1}).bytes,
            2 * model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAll2All, 1}).bytes);
}

TEST(CpCostModel, ComputeFollowsTheRatesAndTheSharing) {
  const CpCostModel model;
  const JobSpec s = Spec("small", 4096, 2, "cpu");
  Topology t = DefaultTopology("cpu");
  const StepCost one = model.Estimate(s, t, {CpMode::kAllGather, 1}, {CpMode::kAllGather, 1}, 0);
  Topology faster = t;
  faster.rates.gemm_flops *= 2;
  faster.rates.attention_flops *= 2;
  faster.rates.lightning_flops *= 2;
  faster.rates.memory_bytes *= 2;
  faster.link_rates.bytes_per_s *= 1e6;  // no link time: compute alone
  faster.link_rates.latency_s = 0;
  t.link_rates = faster.link_rates;
  const double base = model.Estimate(s, t, {CpMode::kAllGather, 1}, {CpMode::kAllGather, 1}, 0)
                          .step_s();
  EXPECT_NEAR(model.Estimate(s, faster, {CpMode::kAllGather, 1}, {CpMode::kAllGather, 1}, 0)
                  .step_s(),
              base / 2, base * 1e-6);
  Topology shared = t;
  shared.sharing = 2;
  EXPECT_NEAR(model.Estimate(s, shared, {CpMode::kAllGather, 1}, {CpMode::kAllGather, 1}, 0)
                  .step_s(),
              base * 2, base * 1e-6);
  // Recomputing every layer costs a forward more: more than nothing, less than a second step.
  const double recompute =
      model.Estimate(s, t, {CpMode::kAllGather, 1}, {CpMode::kAllGather, 1}, 8).step_s();
  EXPECT_GT(recompute, base * 1.1);
  EXPECT_LT(recompute, base * 1.5);
  EXPECT_GT(one.step_s(), 0);
}

// Ranks share a host's cores once their compute threads fill it; each communicator thread then
// costs a core where they fill it exactly, less where they fill it several times over
// (bench/CP_NOTES.md, "The two 2-core misses").
TEST(CpCostModel, CoreSharingCountsTheCommunicatorThreads) {
  EXPECT_EQ(CoreSharing(1, 2, 16, 2), 1.0);
  EXPECT_EQ(CoreSharing(4, 2, 16, 4), 1.0);   // 8 compute threads: the communicators fit beside
  EXPECT_EQ(CoreSharing(4, 3, 16, 4), 1.0);   // 12 + 4 = 16
  EXPECT_EQ(CoreSharing(8, 2, 16, 8), 1.5);   // 16 compute threads fill the cores: 1 + 8/16
  EXPECT_EQ(CoreSharing(4, 4, 16, 4), 1.25);  // 1 + 4/16
  EXPECT_EQ(CoreSharing(8, 4, 16, 8), 2.125);  // twice over: 2 + 8/16 communicators at 1/4
  EXPECT_EQ(CoreSharing(2, 2, 2, 2), 2.25);    // the same on 2 cores: 2 + 2/2 at 1/4
  EXPECT_EQ(CoreSharing(2, 1, 2, 2), 2.0);    // two single-threaded ranks on two cores
  EXPECT_EQ(CoreSharing(0, 2, 16, 2), 1.0);   // nothing known: no sharing
  EXPECT_EQ(CoreSharing(8, 2, 0, 8), 1.0);
  // One rank alone runs no communicator: its threads are all it needs of the cores.
  EXPECT_EQ(CoreSharing(1, 2, 2, 1), 1.0);
  EXPECT_EQ(CoreSharing(1, 4, 2, 1), 2.0);
  EXPECT_EQ(CoreSharing(1, 2, 2, 2), 1.5);  // one rank of a larger job does
}

// More ranks or more threads on the same cores never share them less, and a communicator never
// costs more than a whole core of its own (the old rule's ranks (threads + 1) / cores).
TEST(CpCostModel, CoreSharingGrowsWithRanksAndThreads) {
  for (int64_t cores : {1, 2, 3, 8, 16, 64}) {
    for (int64_t threads = 1; threads <= 9; ++threads) {
      double last = 0;
      for (int64_t ranks = 1; ranks <= 40; ++ranks) {
        const double s = CoreSharing(ranks, threads, cores, ranks);
        EXPECT_GE(s, last) << ranks << " x " << threads << " on " << cores;
        EXPECT_GE(s, std::max(1.0, static_cast<double>(ranks * threads) / cores));
        EXPECT_LE(s, std::max(1.0, static_cast<double>(ranks * (threads + 1)) / cores));
        EXPECT_LE(CoreSharing(ranks, threads, cores, ranks),
                  CoreSharing(ranks, threads + 1, cores, ranks))
            << ranks << " x " << threads << " on " << cores;
        last = s;
      }
    }
  }
}

// The CPU engine's all-to-alls by pieces pass through the communicator's packing: two host
// copies of the exchanged buffer, exposed with the exchange; GPU ranks make none.
TEST(CpCostModel, HostPackingCopiesOfTheCpuAllToAlls) {
  const CpCostModel model;
  Topology t = DefaultTopology("cpu");
  t.rates = {30e9, 7e9, 9e9, 5e9, 3e9};
  EXPECT_EQ(HostCopyRate(t.rates), 3e9);  // as measured; the reference machine's where not
  EXPECT_EQ(HostCopyRate({30e9, 7e9, 9e9, 5e9}), DefaultRates("cpu").copy_bytes);
  const JobSpec s = Spec("small", 4096, 2, "cpu");
  const ModeCost a2a = model.EstimateLayers(s, t, "lightning", {CpMode::kAll2All, 1});
  ASSERT_GT(a2a.bytes, 0);
  // Two copies of what is sent x cp / (cp - 1) (the rank's own block is packed too).
  EXPECT_NEAR(a2a.copy_s, 2.0 * a2a.bytes * 2.0 / HostCopyRate(t.rates), a2a.copy_s * 1e-9);
  EXPECT_GT(a2a.exposed_s, a2a.copy_s);  // the link time besides, all of it exposed
  EXPECT_NEAR(a2a.comm_s, a2a.exposed_s, a2a.comm_s * 1e-9);
  // Proportional to the bytes: twice the sequence sends twice as much and copies twice as long.
  const ModeCost longer =
      model.EstimateLayers(Spec("small", 8192, 2, "cpu"), t, "lightning", {CpMode::kAll2All, 1});
  EXPECT_EQ(longer.bytes, 2 * a2a.bytes);
  EXPECT_NEAR(longer.copy_s, 2.0 * a2a.copy_s, a2a.copy_s * 1e-9);
  // At cp = 4 a rank's own block is a quarter of the buffer: copies of bytes x 4/3.
  const ModeCost four =
      model.EstimateLayers(Spec("small", 8192, 4, "cpu"), t, "mla", {CpMode::kAll2All, 1});
  EXPECT_NEAR(four.copy_s, 2.0 * four.bytes * 4.0 / 3.0 / HostCopyRate(t.rates),
              four.copy_s * 1e-9);
  // The copies run on the shared cores: at the copy rate, divided by the sharing.
  Topology shared = t;
  shared.sharing = 2.5;
  EXPECT_NEAR(model.EstimateLayers(s, shared, "lightning", {CpMode::kAll2All, 1}).copy_s,
              2.5 * a2a.copy_s, a2a.copy_s * 1e-9);
  Topology faster = t;
  faster.rates.copy_bytes *= 4;
  EXPECT_NEAR(model.EstimateLayers(s, faster, "lightning", {CpMode::kAll2All, 1}).copy_s,
              a2a.copy_s / 4, a2a.copy_s * 1e-9);
  // A 2-D mode's Ulysses exchange is packed too: Lightning's carries the rank's whole q, k, v and
  // o as All2All does (over 2 ranks instead of 4: the same buffers); MLA's with the latent as the
  // ring's payload carries Q and O only, the latent's all-gather being a plain collective.
  const JobSpec four_ranks = Spec("small", 8192, 4, "cpu");
  const auto copies = [&](const std::string& type, const ModeChoice& m) {
    return model.EstimateLayers(four_ranks, t, type, m).copy_s;
  };
  EXPECT_GT(copies("lightning", {CpMode::kHybrid, 2}), 0);
  EXPECT_NEAR(copies("lightning", {CpMode::kHybrid, 2}), copies("lightning", {CpMode::kAll2All, 1}),
              copies("lightning", {CpMode::kAll2All, 1}) * 1e-9);
  ASSERT_EQ(MlaRingPayloadFor(four_ranks.model.mla, four_ranks.model.n_heads / 2),
            MlaRingPayload::kLatent);
  const double qk = four_ranks.model.mla.qk_nope_dim + four_ranks.model.mla.qk_rope_dim;
  const double v = four_ranks.model.mla.v_head_dim;
  EXPECT_NEAR(copies("mla", {CpMode::kHybrid, 2}),
              copies("mla", {CpMode::kAll2All, 1}) * (qk + v) / (2 * qk + 2 * v),
              copies("mla", {CpMode::kAll2All, 1}) * 1e-9);
  // No pieces, no packing: AllGather and Ring.
  EXPECT_EQ(model.EstimateLayers(s, t, "lightning", {CpMode::kAllGather, 1}).copy_s, 0);
  EXPECT_EQ(model.EstimateLayers(s, t, "mla", {CpMode::kAllGather, 1}).copy_s, 0);
  EXPECT_EQ(model.EstimateLayers(s, t, "mla", {CpMode::kRing, 1}).copy_s, 0);
  // GPU ranks: NCCL sends the pieces where they lie; a staged communicator stages each piece as
  // it stages every collective, which the same-device link's rate stands for.
  const JobSpec gpu = Spec("1b", 16384, 2, "cuda");
  for (LinkClass link : {LinkClass::kNvlink, LinkClass::kSameDevice}) {
    Topology g = DefaultTopology("cuda");
    g.link = link;
    g.link_rates = DefaultLinkRates(link);
    const ModeCost m = model.EstimateLayers(gpu, g, "mla", {CpMode::kAll2All, 1});
    EXPECT_GT(m.bytes, 0);
    EXPECT_EQ(m.copy_s, 0) << LinkClassName(link);
  }
}

// Attention counts the pairs within the source's documents: a synthetic source's known span, or
// one document as long as the sequence for a file; at cp = 1 too.
TEST(CpCostModel, AttentionCountsTheDocumentsOfTheSource) {
  const CpCostModel model;
  const Topology t = DefaultTopology("cpu");
  // cp = 1 (local attention) and cp = 4 All2All (the heads split): compute is attention alone.
  for (const auto& [cp, mode] : {std::pair{1, CpMode::kAllGather}, {4, CpMode::kAll2All}}) {
    auto mla = [&](int64_t seq_len, bool from_file) {
      JobSpec s = Spec("small", seq_len, cp, "cpu");
      if (from_file) {
        s.data.kind = DataKind::kTokens;
        s.data.source = "tokens:/data/corpus.bin";
      }
      return model.EstimateLayers(s, t, "mla", {mode, 1}).compute_s;
    };
    const double span = SyntheticAttentionSpan(Spec("small", 32768, cp, "cpu").data);
    ASSERT_GT(span, 1000);
    EXPECT_GT(mla(32768, false), 0) << cp;
    EXPECT_NEAR(mla(65536, false) / mla(32768, false), 2.0, 1e-9) << cp;  // linear
    EXPECT_NEAR(mla(65536, true) / mla(32768, true), 4.0, 1e-9) << cp;    // quadratic
    EXPECT_NEAR(mla(32768, true) / mla(32768, false), 32768.0 / span, 1e-6) << cp;
    // A sequence shorter than the documents is one document either way.
    EXPECT_DOUBLE_EQ(mla(512, true), mla(512, false)) << cp;
    // A file whose documents were measured (data.doc_span) counts them like a synthetic source's.
    JobSpec measured = Spec("small", 32768, cp, "cpu");
    measured.data.kind = DataKind::kTokens;
    measured.data.source = "tokens:/data/corpus.bin";
    measured.data.doc_span = span;
    EXPECT_DOUBLE_EQ(model.EstimateLayers(measured, t, "mla", {mode, 1}).compute_s,
                     mla(32768, false))
        << cp;
    measured.data.doc_span = 1e9;  // longer than the sequence: one document a sequence
    EXPECT_DOUBLE_EQ(model.EstimateLayers(measured, t, "mla", {mode, 1}).compute_s,
                     mla(32768, true))
        << cp;
  }
}

// The plan's cost basis says what attention counted the documents as.
TEST(CpCostModel, TheBasisNamesTheDocuments) {
  JobSpec s = Spec("small", 4096, 2, "cpu");
  EXPECT_NE(CpPlanner().Plan(s, 0).cost_basis.find("; attention over documents of span "),
            std::string::npos);
  s.data.kind = DataKind::kTokens;
  s.data.source = "tokens:/data/corpus.bin";
  EXPECT_NE(CpPlanner().Plan(s, 0).cost_basis.find(
                "; documents unknown (no data.doc_span): attention counted as one a sequence"),
            std::string::npos);
  s.data.doc_span = 812.4;
  EXPECT_NE(CpPlanner().Plan(s, 0).cost_basis.find(
                "; attention over documents of span 812 tokens (data.doc_span)"),
            std::string::npos);
}

TEST(CpCostModel, OverlapHidesTheLightningStatesButNotAnAll2All) {
  const CpCostModel model;
  const JobSpec s = Spec("1b", 262144, 8, "cuda");
  const ModeCost ag = model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAllGather, 1});
  EXPECT_GT(ag.comm_s, 0);
  EXPECT_EQ(ag.exposed_s, 0);  // 14 MiB against milliseconds of local outputs
  const ModeCost a2a = model.EstimateLayers(s, Nvlink(), "lightning", {CpMode::kAll2All, 1});
  EXPECT_DOUBLE_EQ(a2a.exposed_s, a2a.comm_s);
  EXPECT_GT(a2a.total_s(), ag.total_s());
}

TEST(CpCostModel, CandidatesCoverEveryModeTheHeadsAllow) {
  auto names = [](const std::vector<ModeChoice>& c) {
    std::string s;
    for (const ModeChoice& m : c) absl::StrAppend(&s, s.empty() ? "" : ",", ModeChoiceName(m));
    return s;
  };
  EXPECT_EQ(names(CandidateModes("mla", 8, 16)), "allgather,all2all,ring,hybrid u=2,hybrid u=4");
  EXPECT_EQ(names(CandidateModes("lightning", 8, 16)), "allgather,all2all,hybrid u=2,hybrid u=4");
  EXPECT_EQ(names(CandidateModes("mla", 8, 4)), "allgather,ring,hybrid u=2,hybrid u=4");
  EXPECT_EQ(names(CandidateModes("lightning", 6, 4)), "allgather,hybrid u=2");
  EXPECT_EQ(names(CandidateModes("mla", 1, 4)), "allgather");
}

TEST(CpPlannerCost, ThePlanMarksTheRuleAndTheFastestAndWarns) {
  // 1b at 256K on 8 NVLink GPUs: the rule's Lightning All2All moves 448 MiB a layer and pass
  // where AllGather moves 14 MiB behind the local outputs.
  const CpPlan plan = CpPlanner().Plan(Spec("1b", 262144, 8, "cuda"), 0);
  ASSERT_TRUE(plan.ok()) << plan.problems[0];
  EXPECT_EQ(plan.ModeOf("lightning"), CpMode::kAll2All);  // "auto" stays the rule
  const ModeEstimate* rule = nullptr;
  const ModeEstimate* fastest = nullptr;
  int lightning = 0;
  for (const ModeEstimate& e : plan.estimates) {
    if (e.layer_type != "lightning") continue;
    ++lightning;
    if (e.rule) rule = &e;
    if (e.fastest) fastest = &e;
    EXPECT_EQ(e.chosen, e.rule);
  }
  // AllGather, All2All and the hybrid of every Ulysses degree dividing cp = 8 and the 16 heads
  // (u = 2, 4; u = 8 leaves a ring of one group).
  EXPECT_EQ(lightning, 4);
  ASSERT_NE(rule, nullptr);
  ASSERT_NE(fastest, nullptr);
  EXPECT_EQ(rule->cost.choice.mode, CpMode::kAll2All);
  EXPECT_NE(fastest->cost.choice.mode, CpMode::kAll2All);
  EXPECT_GT(plan.step_s, 0);
  EXPECT_DOUBLE_EQ(plan.step_s, rule->step_s);
  bool warned = false;
  for (const std::string& w : plan.warnings)
    warned |= w.find("lightning: the default rule's all2all is estimated") == 0;
  EXPECT_TRUE(warned);
  EXPECT_NE(plan.cost_basis.find("built-in H200 rates, link nvlink"), std::string::npos)
      << plan.cost_basis;
}

TEST(CpPlannerCost, FastestPicksTheCheapestAndAForcedModeIsKept) {
  const CpPlan fastest = CpPlanner().Plan(Spec("1b", 262144, 8, "cuda", "fastest", "fastest"), 0);
  ASSERT_TRUE(fastest.ok());
  double best = 1e30;
  for (const ModeEstimate& e : fastest.estimates) {
    best = std::min(best, e.step_s);
    if (e.chosen) EXPECT_TRUE(e.fastest) << e.layer_type << " " << ModeChoiceName(e.cost.choice);
  }
  EXPECT_DOUBLE_EQ(fastest.step_s, best);
  EXPECT_NE(fastest.ModeOf("lightning"), CpMode::kAll2All);
  for (const LayerModePlan& l : fastest.layers) {
    EXPECT_FALSE(l.forced);
    EXPECT_EQ(l.reason.rfind("fastest by the cost model", 0), 0u) << l.reason;
  }
  const CpPlan forced = CpPlanner().Plan(Spec("1b", 262144, 8, "cuda", "all2all", "allgather"), 0);
  EXPECT_EQ(forced.ModeOf("lightning"), CpMode::kAll2All);
  EXPECT_EQ(forced.ModeOf("mla"), CpMode::kAllGather);
  for (const ModeEstimate& e : forced.estimates)
    if (e.chosen) EXPECT_TRUE(e.cost.choice.mode == CpMode::kAll2All ? e.layer_type == "lightning"
                                                                      : e.layer_type == "mla");
}

TEST(CpPlannerCost, ATopologyChangesTheEstimateAndIsNamed) {
  const JobSpec s = Spec("small", 4096, 2, "cpu");
  Topology t = DefaultTopology("cpu");
  t.rates.gemm_flops *= 10;
  t.basis = "rates measured by worker w1";
  const CpPlan fast = CpPlanner().Plan(s, 0, &t);
  const CpPlan slow = CpPlanner().Plan(s, 0);
  EXPECT_LT(fast.step_s, slow.step_s);
  EXPECT_EQ(fast.cost_basis.rfind("rates measured by worker w1; attention over documents", 0), 0u)
      << fast.cost_basis;
  EXPECT_TRUE(CpPlanner().Plan(Spec("small", 4096, 1, "cpu"), 0).estimates.empty());
}

// The planner's choice ("fastest") over a table of jobs and topologies. A row names the pick
// of each layer type and why it must be that one (the runner-up then at least 5% slower, but for
// a twin named beside MLA's pick that moves the same bytes), or kAuto: a near tie, every
// candidate within 6% of the fastest (on the CPU the cores dominate and the modes' traffic is
// small beside them).
TEST(CpPlannerCost, TheFastestChoiceOverATableOfJobsAndTopologies) {
  struct Row {
    const char* preset;
    int64_t seq_len, cp;
    const char* resources;
    LinkClass link;
    CpMode lightning, mla;
    const char* why;
    CpMode mla_twin = CpMode::kAuto;  // a mode MLA's pick may have within 5% (it moves as much)
  };
  const CpMode AG = CpMode::kAllGather, TIE = CpMode::kAuto, RING = CpMode::kRing;
  const Row rows[] = {
      {"1b", 262144, 8, "cuda", LinkClass::kNvlink, AG, TIE,
       "Lightning's states (14 MiB a layer) against All2All's 448 MiB; for MLA, AllGather's "
       "rebuild of the other ranks' keys costs about what All2All's exchange does on NVLink"},
      {"1b", 262144, 8, "cuda", LinkClass::kNetwork, AG, AG,
       "at 2.5 GB/s MLA's All2All (Q, K, V and O: ~7x the latent's bytes) loses to the gathered "
       "latent"},
      {"1b", 32768, 2, "cuda", LinkClass::kNetwork, AG, AG,
       "the same at 32K over two ranks; the ring passes as many latent bytes", RING},
      {"1b", 262144, 4, "cuda", LinkClass::kPcie, AG, AG,
       "at PCIe's 40 GB/s All2All's bytes outweigh the rebuild; the ring passes as many latent "
       "bytes",
       RING},
      {"small", 16384, 8, "cpu", LinkClass::kLoopback, TIE, TIE,
       "cp = 8 > 4 heads: no All2All; the ring, the gather and the 2-D modes cost the cores alike"},
      {"small", 65536, 4, "cpu", LinkClass::kNetwork, TIE, TIE,
       "40 GFLOP/s cores: compute dominates every mode"},
      {"1b", 32768, 8, "cpu", LinkClass::kNetwork, TIE, TIE, "the same for the 1b model"},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(::testing::Message() << r.preset << " " << r.seq_len << " cp " << r.cp << " "
                                      << LinkClassName(r.link) << ": " << r.why);
    Topology t = DefaultTopology(r.resources);
    t.link = r.link;
    t.link_rates = DefaultLinkRates(r.link);
    const CpPlan plan =
        CpPlanner().Plan(Spec(r.preset, r.seq_len, r.cp, r.resources, "fastest", "fastest"), 0, &t);
    ASSERT_TRUE(plan.ok()) << plan.problems[0];
    for (const auto& [type, want] : {std::pair{"lightning", r.lightning}, {"mla", r.mla}}) {
      std::vector<double> steps;
      for (const ModeEstimate& e : plan.estimates)
        if (e.layer_type == type &&
            !(type == std::string("mla") && e.cost.choice.mode == r.mla_twin))
          steps.push_back(e.step_s);
      ASSERT_GE(steps.size(), 2u) << type;
      std::sort(steps.begin(), steps.end());
      if (want == TIE) {
        EXPECT_LT(steps.back(), 1.06 * steps.front()) << type;
        continue;
      }
      EXPECT_EQ(plan.ModeOf(type), want) << type;
      EXPECT_GT(steps[1], 1.05 * steps[0]) << type << ": the runner-up is too close to call";
    }
  }
}

TEST(CpCostModel, LinkClassesRoundTrip) {
  for (LinkClass l : {LinkClass::kSameDevice, LinkClass::kNvlink, LinkClass::kPcie,
                      LinkClass::kLoopback, LinkClass::kNetwork}) {
    LinkClass back;
    ASSERT_TRUE(ParseLinkClass(LinkClassName(l), &back));
    EXPECT_EQ(back, l);
    EXPECT_GT(DefaultLinkRates(l).bytes_per_s, 0);
  }
  LinkClass x;
  EXPECT_FALSE(ParseLinkClass("infiniband", &x));
}

}  // namespace
}  // namespace spindle
