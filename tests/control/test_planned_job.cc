// The PlannedJob (planner/planned_job.h): a job planned once with every decision in its spec,
// carried whole through its wire form, and taken again only by Replan, which keeps what still runs
// and says what it changed. Also the plan's checks of what the CUDA engine would refuse at start
// (the FP8 shape limits).
#include <cstdint>
#include <string>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "planner/plan_proto.h"
#include "planner/planned_job.h"
#include "spindle/v1/job.pb.h"

namespace spindle {
namespace {

JobSpec Spec(const std::string& extra_train = "", const std::string& parallel = R"({"cp": 2})",
             const std::string& resources = "cpu", const std::string& model = R"({"preset": "tiny"})",
             int64_t seq_len = 1024) {
  absl::StatusOr<JobSpec> s = ParseJobSpec(
      std::string(R"({"name": "p", "model": )") + model + R"(, "seq_len": )" +
      std::to_string(seq_len) + R"(, "data": {"source": "synthetic:recall"}, "parallel": )" +
      parallel + R"(, "train": {"steps": 3)" + extra_train + R"(}, "resources": ")" + resources +
      R"("})");
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : JobSpec{};
}

TEST(PlannedJobTest, EveryDecisionIsInTheSpecAndTheWireFormCarriesItWhole) {
  const JobSpec requested = Spec(R"(, "recompute": "auto")", R"({"cp": 2, "mla_mode": "fastest"})");
  ASSERT_FALSE(IsPlanned(requested));
  const PlannedJob job = PlanJob(requested, int64_t{8} << 30);
  ASSERT_TRUE(job.ok());
  EXPECT_TRUE(IsPlanned(job.spec));
  EXPECT_EQ(job.spec.parallel.lightning_mode, CpMode::kAll2All);  // the rule: 4 heads, cp 2
  EXPECT_EQ(job.spec.parallel.mla_mode, job.plan.ModeOf("mla"));
  EXPECT_NE(job.spec.parallel.mla_mode, CpMode::kFastest);
  EXPECT_EQ(job.spec.train.recompute_layers, job.plan.memory.recompute_layers);
  EXPECT_EQ(job.requested_json, requested.ToJson().dump());

  const absl::StatusOr<PlannedJob> back = DecodePlannedJob(EncodePlannedJob(job));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->spec.ToJson(), job.spec.ToJson());
  EXPECT_EQ(back->requested_json, job.requested_json);
  EXPECT_EQ(EncodePlan(back->plan), EncodePlan(job.plan));
  EXPECT_EQ(back->plan.layers[1].reason, job.plan.layers[1].reason);  // "fastest by the cost model"

  // What a record of an older release stored (only its plan) is not a planned job.
  EXPECT_EQ(DecodePlannedJob(EncodePlan(job.plan)).status().code(), absl::StatusCode::kDataLoss);
  // A planned job whose spec leaves a decision open is refused: nothing downstream decides.
  v1::PlannedJob open;
  PlannedJobToProto(job, &open);
  open.set_spec_json(requested.ToJson().dump());
  const absl::Status refused = PlannedJobFromProto(open).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("leaves a decision open"), std::string::npos) << refused;
  open.set_spec_json("{not json");
  EXPECT_EQ(PlannedJobFromProto(open).status().code(), absl::StatusCode::kInvalidArgument);
}

// Planned before any device was known: "auto" recompute (every layer) is decided for the devices
// the gang got, the modes stay, and the change is one line.
TEST(PlannedJobTest, PlacementDecidesWhatWasDecidedForLackOfADevice) {
  const PlannedJob job = PlanJob(Spec(R"(, "recompute": "auto")"), 0);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job.spec.train.recompute_layers, 4);  // tiny's 4 layers, no device known
  std::string change;
  const PlannedJob placed =
      Replan(job, ReplanCause::kPlacement, int64_t{8} << 30, nullptr, &change);
  EXPECT_EQ(placed.spec.train.recompute_layers, 0);  // 1024 tokens of tiny fit 8 GiB
  EXPECT_EQ(placed.spec.parallel.lightning_mode, job.spec.parallel.lightning_mode);
  EXPECT_EQ(placed.spec.parallel.mla_mode, job.spec.parallel.mla_mode);
  EXPECT_EQ(placed.plan.memory.device_memory_bytes, int64_t{8} << 30);
  EXPECT_EQ(change,
            "re-planned for the placement's devices (8.00 GiB each): train.recompute 4 -> 0 of 4 "
            "layers");
  // Planned against a device, it keeps every decision where its plan still runs.
  const PlannedJob again =
      Replan(placed, ReplanCause::kPlacement, int64_t{4} << 30, nullptr, &change);
  EXPECT_EQ(change, "");
  EXPECT_EQ(again.spec.ToJson(), placed.spec.ToJson());
  // A fixed recompute is not the planner's to change.
  const PlannedJob fixed = PlanJob(Spec(R"(, "recompute": 3)"), 0);
  Replan(fixed, ReplanCause::kPlacement, int64_t{8} << 30, nullptr, &change);
  EXPECT_EQ(change, "");
}

// Out of device memory: "auto" recomputes more layers (half of those keeping theirs, at least
// two) until every layer does; a fixed recompute stays.
TEST(PlannedJobTest, OutOfMemoryRecomputesMoreOnlyWhereTheSpecSaidAuto) {
  PlannedJob job = PlanJob(Spec(R"(, "recompute": "auto")"), int64_t{8} << 30);
  ASSERT_EQ(job.spec.train.recompute_layers, 0);
  std::string change;
  for (const int64_t want : {2, 4}) {
    job = Replan(job, ReplanCause::kOutOfMemory, int64_t{8} << 30, nullptr, &change);
    EXPECT_EQ(job.spec.train.recompute_layers, want);
    EXPECT_EQ(job.plan.memory.recompute_layers, want);
    EXPECT_EQ(change, "train.recompute \"auto\": " + std::to_string(want) +
                          " of 4 layers recompute from now on");
  }
  job = Replan(job, ReplanCause::kOutOfMemory, int64_t{8} << 30, nullptr, &change);
  EXPECT_EQ(change, "");
  const PlannedJob fixed = PlanJob(Spec(R"(, "recompute": 1)"), int64_t{8} << 30);
  EXPECT_EQ(Replan(fixed, ReplanCause::kOutOfMemory, int64_t{8} << 30, nullptr, &change)
                .spec.train.recompute_layers,
            1);
  EXPECT_EQ(change, "");
}

// A record of an older release kept only its plan: a restart takes that plan's decisions (the
// stored mode is changed here to the one the planner does not pick, so that a re-decision would
// show), and plans again only what has no stored plan, "auto" recompute as that plan decided it.
TEST(PlannedJobTest, AnOlderRecordKeepsItsStoredDecisions) {
  const JobSpec requested = Spec(R"(, "recompute": "auto")", R"({"cp": 2, "mla_mode": "fastest"})");
  const PlannedJob job = PlanJob(requested, int64_t{8} << 30);
  ASSERT_TRUE(job.ok());
  CpPlan stored = job.plan;
  const CpMode other = stored.layers[1].mode == CpMode::kRing ? CpMode::kAllGather : CpMode::kRing;
  stored.layers[1].mode = other;
  const PlannedJob kept = PlannedJobOfOlderRecord(requested, DecodePlan(EncodePlan(stored)));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept.spec.parallel.mla_mode, other) << "re-decided";
  EXPECT_EQ(kept.spec.parallel.lightning_mode, job.spec.parallel.lightning_mode);
  EXPECT_EQ(kept.spec.train.recompute_layers, job.plan.memory.recompute_layers);
  EXPECT_TRUE(IsPlanned(kept.spec));

  CpPlan three = job.plan;
  three.memory.recompute_layers = 3;
  three.layers.clear();  // no decisions to keep: planned again, the recompute kept
  const PlannedJob again = PlannedJobOfOlderRecord(requested, DecodePlan(EncodePlan(three)));
  EXPECT_EQ(again.spec.train.recompute_layers, 3);
  EXPECT_TRUE(IsPlanned(again.spec));
  EXPECT_TRUE(IsPlanned(
      PlannedJobOfOlderRecord(requested, absl::DataLossError("stored plan does not parse")).spec));
}

TEST(PlannedJobTest, DecisionChangesAreNamed) {
  JobSpec a = Spec("", R"({"cp": 4, "lightning_mode": "all2all", "mla_mode": "ring"})");
  JobSpec b = a;
  EXPECT_EQ(DescribeDecisionChange(a, b), "");
  b.parallel.lightning_mode = CpMode::kAllGather;
  b.parallel.mla_mode = CpMode::kHybrid;
  b.parallel.ulysses = 2;
  EXPECT_EQ(DescribeDecisionChange(a, b),
            "lightning mode all2all -> allgather, mla mode ring -> hybrid, parallel.ulysses 1 -> 2");
}

JobSpec Elastic(const std::string& parallel, int64_t seq_len = 1024,
                const std::string& model = R"({"preset": "tiny"})") {
  absl::StatusOr<JobSpec> s = ParseJobSpec(
      std::string(R"({"name": "e", "model": )") + model + R"(, "seq_len": )" +
      std::to_string(seq_len) + R"(, "data": {"source": "synthetic:recall"}, "parallel": )" +
      parallel + R"(, "train": {"steps": 3}, "checkpoint": {"dir": "/tmp/e"}})");
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : JobSpec{};
}

// A world change lays the job out again: the present cp where it divides the world, the modes
// kept where they run, the step's tokens as parallel.elastic.batch says; back at the submitted
// world it is the submitted layout.
TEST(PlannedJobTest, ReplanForWorldKeepsWhatRunsAndSaysWhatChanged) {
  const PlannedJob job = PlanJob(Elastic(R"({"cp": 4, "elastic": {"min_world": 2}})"), 0);
  ASSERT_TRUE(job.ok());
  ASSERT_EQ(job.spec.parallel.lightning_mode, CpMode::kAll2All);  // 4 heads over cp 4
  std::string change;
  EXPECT_EQ(ReplanForWorld(job, 4, 0, nullptr, &change).spec.ToJson(), job.spec.ToJson());
  EXPECT_EQ(change, "");
  const PlannedJob two = ReplanForWorld(job, 2, 0, nullptr, &change);
  ASSERT_TRUE(two.ok()) << two.plan.problems.front();
  EXPECT_EQ(two.spec.parallel.cp, 2);
  EXPECT_EQ(two.spec.parallel.dp, 1);
  EXPECT_EQ(two.plan.world, 2);
  EXPECT_EQ(two.spec.parallel.lightning_mode, CpMode::kAll2All);
  EXPECT_EQ(two.requested_json, job.requested_json);
  EXPECT_EQ(change,
            "world 4 -> 2: cp x dp 4 x 1 -> 2 x 1; tokens per step kept at 1024 "
            "(parallel.elastic.batch \"keep\")");
  const PlannedJob back = ReplanForWorld(two, 4, 0, nullptr, &change);
  EXPECT_EQ(back.spec.ToJson(), job.spec.ToJson());
  EXPECT_EQ(change,
            "world 2 -> 4: cp x dp 2 x 1 -> 4 x 1; tokens per step kept at 1024 "
            "(parallel.elastic.batch \"keep\")");

  // World 3: 1024 tokens do not cut into 6 chunks, and dp 3 would change the step's one sequence.
  const PlannedJob three = ReplanForWorld(job, 3, 0, nullptr, &change);
  EXPECT_FALSE(three.ok());
  EXPECT_EQ(change, "");
  ASSERT_EQ(three.plan.problems.size(), 1u);
  EXPECT_EQ(three.plan.problems[0],
            "no layout of world 3 runs: cp x dp 3 x 1: seq_len: 1024 is not divisible by 2*cp = "
            "6 (zigzag chunks need equal sizes)" +
                std::string("; cp x dp 1 x 3: dp 3 does not divide the 1 sequences of a step "
                            "(parallel.elastic.batch \"keep\")"))
      << three.plan.problems[0];
  // At 1536 tokens cp 3 runs, but all2all does not split 4 heads over 3 ranks: the planner's rule
  // takes that mode again.
  const PlannedJob job1536 = PlanJob(Elastic(R"({"cp": 4, "elastic": {"min_world": 2}})", 1536), 0);
  const PlannedJob cp3 = ReplanForWorld(job1536, 3, 0, nullptr, &change);
  ASSERT_TRUE(cp3.ok()) << cp3.plan.problems.front();
  EXPECT_EQ(cp3.spec.parallel.cp, 3);
  EXPECT_EQ(cp3.spec.parallel.lightning_mode, CpMode::kAllGather);
  EXPECT_EQ(change,
            "world 4 -> 3: cp x dp 4 x 1 -> 3 x 1, lightning mode all2all -> allgather, mla mode "
            "all2all -> allgather; tokens per step kept at 1536 (parallel.elastic.batch "
            "\"keep\")");
  // Back at cp 4 the rule picks all2all again: the job runs as it ran there.
  const PlannedJob back4 = ReplanForWorld(cp3, 4, 0, nullptr, &change);
  EXPECT_EQ(back4.spec.ToJson(), job1536.spec.ToJson());
  EXPECT_EQ(change,
            "world 3 -> 4: cp x dp 3 x 1 -> 4 x 1, lightning mode allgather -> all2all, mla mode "
            "allgather -> all2all; tokens per step kept at 1536 (parallel.elastic.batch "
            "\"keep\")");
  // A forced mode that runs at the new layout stays.
  const PlannedJob forced = PlanJob(
      Elastic(R"({"cp": 4, "lightning_mode": "allgather", "elastic": {"min_world": 2}})"), 0);
  EXPECT_EQ(ReplanForWorld(forced, 2, 0, nullptr, &change).spec.parallel.lightning_mode,
            CpMode::kAllGather);
}

// Data parallelism: "keep" holds a step's sequences with more micro-batches, "scale" lets them
// follow dp; 2-D modes whose Ulysses groups no longer split cp, and an ep that no longer divides
// the world, are left to the planner and named.
TEST(PlannedJobTest, ReplanForWorldStatesTheStepsTokensAndReleasesWhatCannotRun) {
  std::string change;
  const PlannedJob keep = PlanJob(Elastic(R"({"cp": 2, "dp": 2, "elastic": {"min_world": 1}})"), 0);
  const PlannedJob kept = ReplanForWorld(keep, 2, 0, nullptr, &change);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept.spec.parallel.cp, 2);
  EXPECT_EQ(kept.spec.parallel.dp, 1);
  EXPECT_EQ(kept.spec.train.micro_batches, 2);
  EXPECT_EQ(change,
            "world 4 -> 2: cp x dp 2 x 2 -> 2 x 1, train.micro_batches 1 -> 2; tokens per step "
            "kept at 2048 (parallel.elastic.batch \"keep\")");
  const PlannedJob scale =
      PlanJob(Elastic(R"({"cp": 2, "dp": 2, "elastic": {"min_world": 1, "batch": "scale"}})"), 0);
  const PlannedJob scaled = ReplanForWorld(scale, 2, 0, nullptr, &change);
  EXPECT_EQ(scaled.spec.train.micro_batches, 1);
  EXPECT_EQ(change,
            "world 4 -> 2: cp x dp 2 x 2 -> 2 x 1; tokens per step 2048 -> 1024 "
            "(parallel.elastic.batch \"scale\")");

  const PlannedJob hybrid =
      PlanJob(Elastic(R"({"cp": 4, "ulysses": 2, "lightning_mode": "hybrid", "mla_mode": "hybrid",
                  "elastic": {"min_world": 2}})"),
              0);
  ASSERT_TRUE(hybrid.ok());
  const PlannedJob unsplit = ReplanForWorld(hybrid, 2, 0, nullptr, &change);
  ASSERT_TRUE(unsplit.ok());
  EXPECT_EQ(unsplit.spec.parallel.ulysses, 1);
  EXPECT_EQ(unsplit.spec.parallel.mla_mode, CpMode::kAll2All);
  EXPECT_NE(change.find("parallel.ulysses 2 -> 1"), std::string::npos) << change;
  EXPECT_NE(change.find("(parallel.ulysses 2 with the \"hybrid\" modes does not split cp 2: "
                        "modes left to the planner)"),
            std::string::npos)
      << change;

  const PlannedJob moe = PlanJob(Elastic(R"({"cp": 4, "ep": 4, "elastic": {"min_world": 2}})", 1024,
                                         R"({"preset": "tiny-moe"})"),
                                 0);
  ASSERT_TRUE(moe.ok()) << moe.plan.problems.front();
  const PlannedJob moe2 = ReplanForWorld(moe, 2, 0, nullptr, &change);
  ASSERT_TRUE(moe2.ok()) << moe2.plan.problems.front();
  EXPECT_EQ(2 % moe2.spec.parallel.ep, 0);
  EXPECT_NE(change.find("parallel.ep 4 does not divide world 2: left to the planner"),
            std::string::npos)
      << change;
}

// What the CUDA engine refuses at start under FP8 the plan refuses first, naming the width.
TEST(PlannedJobTest, Fp8ShapeLimitsAreThePlansProblems) {
  const JobSpec narrow = Spec(R"(, "precision": "fp8")", R"({"cp": 1})", "cuda",
                              R"({"preset": "tiny", "d_model": 72})");
  const PlannedJob job = PlanJob(narrow, 0);
  ASSERT_FALSE(job.ok());
  ASSERT_EQ(job.plan.problems.size(), 1u);
  EXPECT_EQ(job.plan.problems[0],
            "train.precision: \"fp8\" on resources \"cuda\": layers.0.la.qkv.weight is 216 x 72, "
            "and cuBLASLt's FP8 GEMMs need widths that are multiples of 16; use \"bf16\" or "
            "another shape");
  EXPECT_TRUE(PlanJob(Spec(R"(, "precision": "bf16")", R"({"cp": 1})", "cuda",
                           R"({"preset": "tiny", "d_model": 72})"),
                      0)
                  .ok());
  EXPECT_TRUE(PlanJob(Spec(R"(, "precision": "fp8")", R"({"cp": 1})", "cpu",
                           R"({"preset": "tiny", "d_model": 72})"),
                      0)
                  .ok());  // the CPU emulation has no such limit
  // Tokens per rank: 1000 / 2 = 500, not a multiple of 16.
  const PlannedJob tokens =
      PlanJob(Spec(R"(, "precision": "fp8")", R"({"cp": 2})", "cuda", R"({"preset": "tiny"})", 1000),
              0);
  ASSERT_FALSE(tokens.ok());
  EXPECT_NE(tokens.plan.problems.back().find("seq_len / cp = 500"), std::string::npos)
      << tokens.plan.problems.back();
  // A MoE model's experts (quantized a scale per expert) are held to the same widths.
  const PlannedJob experts = PlanJob(Spec(R"(, "precision": "fp8")", R"({"cp": 1})", "cuda",
                                          R"({"preset": "tiny-moe", "moe": {"expert_ffn": 40}})"),
                                     0);
  ASSERT_FALSE(experts.ok());
  EXPECT_NE(experts.plan.problems[0].find("the experts are 40 x 64 (moe.expert_ffn x d_model)"),
            std::string::npos)
      << experts.plan.problems[0];
  const PlannedJob moe = PlanJob(
      Spec(R"(, "precision": "fp8")", R"({"cp": 1})", "cuda", R"({"preset": "tiny-moe"})"), 0);
  EXPECT_TRUE(moe.ok()) << moe.plan.problems.front();
  // The one list of FP8 weights: tiny's 3 Lightning layers' 3 projections, its MLA layer's q_a
  // (none: q_lora_rank 0), kv_a and out, and 4 dense FFNs of 3.
  EXPECT_EQ(Fp8LinearWeights(*ModelPreset("tiny")).size(), 3u * 3 + 2 + 4 * 3);
}

}  // namespace
}  // namespace spindle
