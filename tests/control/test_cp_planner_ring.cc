// CpPlanner with MLA's Ring mode and the hybrid modes: the forced modes' reasons, the ring payload,
// the bytes a rank sends per step (against hand-counted collectives and CpLayerCommBytes, which
// the engine's CP tests check against what the communicators measured), the memory terms, and the
// problems (CUDA, and parallel.* combinations built in code).
#include <string>

#include "common/cp_modes.h"
#include "common/job_spec.h"
#include "planner/cp_planner.h"
#include "gtest/gtest.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

constexpr auto Spec = testing::PlannerSpec;

TEST(CpPlannerRingTest, RingModeNamesItsPayloadAndCountsItsBytes) {
  JobSpec s = Spec(4, 4, 1024);
  s.parallel.mla_mode = CpMode::kRing;
  CpPlan p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok()) << p.problems[0];
  const LayerModePlan& mla = p.layers[1];
  EXPECT_EQ(mla.mode, CpMode::kRing);
  EXPECT_TRUE(mla.forced);
  EXPECT_EQ(mla.reason,
            "forced by the spec (parallel.mla_mode = ring): the ring moves the latent (48 values a "
            "token; K and V: 192)");
  EXPECT_EQ(mla.ring_payload, "latent");
  // 256 tokens a rank, blocks of 256 x 48 fp32: 3 sends forward, 6 backward (blocks and their
  // gradient accumulators).
  const int64_t block = 256 * 48 * 4;
  EXPECT_EQ(mla.comm_bytes_per_step, 9 * block);
  // Lightning stays by the rule (All2All) and its bytes are the all-to-alls': q|k|v and o, each
  // way: 3/4 of 256 x 4 d and 3/4 of 256 x d floats a layer and direction, 7 layers.
  EXPECT_EQ(p.layers[0].mode, CpMode::kAll2All);
  EXPECT_EQ(p.layers[0].comm_bytes_per_step, 7 * 2 * 3 * (256 * 64 * 4 / 4) * 4);
  EXPECT_EQ(p.layers[0].ring_payload, "");

  // Recomputing every layer runs each forward twice; two micro-batches double it all.
  s.train.recompute_layers = 8;
  s.train.micro_batches = 2;
  p = CpPlanner().Plan(s, 0);
  EXPECT_EQ(p.layers[1].comm_bytes_per_step, 2 * (2 * 3 + 6) * block);
}

TEST(CpPlannerRingTest, RingMovesKeysAndValuesWhenTheyAreNarrower) {
  JobSpec s = Spec(2, 2, 512);     // K and V of 2 heads: 96 values a token
  s.model.mla.kv_lora_rank = 128;  // the latent: 144
  s.parallel.mla_mode = CpMode::kRing;
  EXPECT_EQ(MlaRingPayloadFor(s.model.mla, 2), MlaRingPayload::kKv);
  CpPlan p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p.layers[1].ring_payload, "kv");
  EXPECT_EQ(p.layers[1].reason,
            "forced by the spec (parallel.mla_mode = ring): the ring moves K and V (96 values a "
            "token; the latent: 144)");
  EXPECT_EQ(p.layers[1].comm_bytes_per_step, 3 * 256 * 96 * 4);
  // The CUDA engine passes the same payload, and the plan says so.
  s.resources = "cuda";
  p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok()) << p.problems[0];
  EXPECT_EQ(p.layers[1].ring_payload, "kv");
  EXPECT_EQ(p.layers[1].comm_bytes_per_step, 3 * 256 * 96 * 4);
  // Wider heads: the latent is narrower on either engine.
  s.model.mla.kv_lora_rank = 64;  // the latent: 80
  EXPECT_EQ(MlaRingPayloadFor(s.model.mla, 2), MlaRingPayload::kLatent);
  p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok()) << p.problems[0];
  EXPECT_EQ(p.layers[1].ring_payload, "latent");
  EXPECT_EQ(p.layers[1].reason,
            "forced by the spec (parallel.mla_mode = ring): the ring moves the latent (80 values "
            "a token; K and V: 96)");
  EXPECT_EQ(p.layers[1].comm_bytes_per_step, 3 * 256 * 80 * 4);
}

TEST(CpPlannerRingTest, HybridModesOverUlyssesGroups) {
  JobSpec s = Spec(8, 8, 1024);
  s.parallel.ulysses = 2;
  s.parallel.lightning_mode = CpMode::kHybrid;
  s.parallel.mla_mode = CpMode::kHybrid;
  CpPlan p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok()) << p.problems[0];
  EXPECT_EQ(p.ulysses, 2);
  EXPECT_EQ(p.layers[0].reason,
            "forced by the spec (parallel.lightning_mode = hybrid): Ulysses over groups of 2 "
            "ranks, the chunk states all-gathered across the 4 groups");
  EXPECT_EQ(p.layers[1].reason,
            "forced by the spec (parallel.mla_mode = hybrid): Ulysses over groups of 2 ranks, "
            "Ring across the 4 groups; the ring moves the latent (48 values a token; K and V: "
            "192)");
  EXPECT_EQ(p.layers[1].ring_payload, "latent");
  // Lightning, per layer and direction, T = 128 tokens a rank, d = 64, 8 heads of 8: the
  // group's all-to-alls of q|k|v and o (half of each to the other member) and the all-gather
  // of 2 states of the 4 heads a member computes to the 3 other groups.
  const int64_t l_dir = (3 * 128 * 64 / 2) * 4 + (128 * 64 / 2) * 4 + 3 * 2 * 4 * 8 * 8 * 4;
  EXPECT_EQ(p.layers[0].comm_bytes_per_step, 7 * 2 * l_dir);
  // MLA: Q (32 values a head) and O (16) half to the other member, the latent gathered in the
  // group (and its gradient reduce-scattered), the group's 256-token blocks around a ring of 4.
  const int64_t ulysses = (128 * 8 * 32 / 2) * 4 + (128 * 8 * 16 / 2) * 4 + 128 * 48 * 4;
  const int64_t ring_block = 256 * 48 * 4;
  EXPECT_EQ(p.layers[1].comm_bytes_per_step, 2 * ulysses + 9 * ring_block);
  // The formula the engine's tests hold the communicators to.
  const CpCommBytes b = CpLayerCommBytes(s.model, 'M', CpMode::kHybrid, s.parallel, s.seq_len);
  EXPECT_EQ(b.forward + b.backward, p.layers[1].comm_bytes_per_step);

  // The hybrid Lightning layers keep the head-split q, k, v; the MLA layer its group's share.
  JobSpec ag = s;
  ag.parallel.ulysses = 1;
  ag.parallel.lightning_mode = ag.parallel.mla_mode = CpMode::kAllGather;
  const CpPlan q = CpPlanner().Plan(ag, 0);
  const int64_t extra_per_token = 7 * 3 * 64 + (8 * (32 + 16 + 1) + 2 * 48) - 8 * 48;
  EXPECT_EQ(p.memory.activations_bytes - q.memory.activations_bytes, 128 * 4 * extra_per_token);
}

TEST(CpPlannerRingTest, ProblemsOfTheNewModes) {
  // The CUDA engine runs every mode.
  JobSpec s = Spec(4, 4, 1024);
  s.resources = "cuda";
  s.parallel.mla_mode = CpMode::kRing;
  CpPlan p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << p.problems[0];
  s.parallel.ulysses = 2;
  s.parallel.lightning_mode = s.parallel.mla_mode = CpMode::kHybrid;
  p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << p.problems[0];
  // A spec built in code (the parser refuses it) plans with the parser's error as a problem.
  s = Spec(8, 4, 1024);
  s.parallel.ulysses = 3;
  s.parallel.lightning_mode = CpMode::kHybrid;
  p = CpPlanner().Plan(s, 0);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.problems[0], "parallel.ulysses: must divide parallel.cp, got ulysses=3 and cp=8");
  EXPECT_EQ(p.layers[0].comm_bytes_per_step, 0);
}

}  // namespace
}  // namespace spindle
