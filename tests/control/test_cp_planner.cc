// CpPlanner: default and forced modes, and the exact text of every preflight problem.
#include <algorithm>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "common/model_config.h"
#include "planner/cp_planner.h"
#include "gtest/gtest.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

constexpr auto Spec = testing::PlannerSpec;

// A job is planned once: PlannedSpec writes every decision into the spec (modes, ulysses,
// recompute), IsPlanned then holds, and planning the planned spec again changes nothing.
TEST(CpPlannerTest, APlannedSpecLeavesNothingToDecide) {
  JobSpec s = Spec(4, 8, 1024);
  s.train.recompute_layers = TrainSpec::kRecomputeAuto;
  s.parallel.mla_mode = CpMode::kFastest;
  EXPECT_FALSE(IsPlanned(s));
  const CpPlan plan = CpPlanner().Plan(s, int64_t{64} << 30);
  ASSERT_TRUE(plan.ok()) << plan.problems[0];
  const JobSpec run = PlannedSpec(s, plan);
  EXPECT_TRUE(IsPlanned(run));
  EXPECT_EQ(run.parallel.lightning_mode, CpMode::kAll2All);  // the rule: 4 <= 8 heads
  EXPECT_EQ(run.parallel.mla_mode, plan.ModeOf("mla"));
  EXPECT_NE(run.parallel.mla_mode, CpMode::kFastest);
  EXPECT_EQ(run.parallel.ulysses, plan.ulysses);
  EXPECT_EQ(run.train.recompute_layers, plan.memory.recompute_layers);
  const JobSpec again = PlannedSpec(run, CpPlanner().Plan(run, int64_t{64} << 30));
  EXPECT_EQ(again.ToJson(), run.ToJson());
  // What is still open: "auto" with cp > 1, "fastest" anywhere, "auto" recompute.
  JobSpec open = run;
  open.parallel.lightning_mode = CpMode::kAuto;
  EXPECT_FALSE(IsPlanned(open));
  open.parallel.cp = 1;
  EXPECT_TRUE(IsPlanned(open));  // cp = 1 splits nothing
  open.train.recompute_layers = TrainSpec::kRecomputeAuto;
  EXPECT_FALSE(IsPlanned(open));
}

TEST(CpPlannerTest, DefaultAll2AllWhenHeadsDivisible) {
  CpPlan p = CpPlanner().Plan(Spec(4, 8, 1024), 0);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p.layers.size(), 2u);
  EXPECT_EQ(p.layers[0].layer_type, "lightning");
  EXPECT_EQ(p.layers[0].num_layers, 7);
  EXPECT_EQ(p.layers[0].mode, CpMode::kAll2All);
  EXPECT_EQ(p.layers[0].reason, "default: cp=4 <= n_heads=8 and 8 % 4 == 0");
  EXPECT_EQ(p.layers[1].num_layers, 1);
  EXPECT_EQ(p.layers[1].mode, CpMode::kAll2All);
  EXPECT_EQ(p.tokens_per_rank, 256);
  EXPECT_EQ(p.world, 4);
}

TEST(CpPlannerTest, DefaultAllGatherWhenCpExceedsHeadsOrDoesNotDivide) {
  CpPlan p = CpPlanner().Plan(Spec(8, 4, 1024), 0);
  EXPECT_TRUE(p.ok());
  EXPECT_EQ(p.layers[0].mode, CpMode::kAllGather);
  EXPECT_EQ(p.layers[0].reason, "default: cp=8 > n_heads=4, all2all impossible");
  JobSpec s = Spec(4, 8, 1024);
  s.model.d_model = 96;
  s.model.n_heads = 6;
  p = CpPlanner().Plan(s, 0);
  EXPECT_EQ(p.layers[1].mode, CpMode::kAllGather);
  EXPECT_EQ(p.layers[1].reason, "default: n_heads=6 is not divisible by cp=4 (6 % 4 = 2)");
}

TEST(CpPlannerTest, ForcedModeIsKeptAndMarked) {
  JobSpec s = Spec(2, 4, 1024);
  s.parallel.mla_mode = CpMode::kAllGather;
  CpPlan p = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p.layers[0].mode, CpMode::kAll2All);
  EXPECT_FALSE(p.layers[0].forced);
  EXPECT_EQ(p.layers[1].mode, CpMode::kAllGather);
  EXPECT_TRUE(p.layers[1].forced);
  EXPECT_EQ(p.layers[1].reason, "forced by the spec (parallel.mla_mode = allgather)");
}

TEST(CpPlannerTest, CpOnCudaRunsBothModesOnTheShapesItsKernelsTake) {
  JobSpec s = Spec(2, 4, 1024);
  s.resources = "cuda";
  CpPlan p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << (p.problems.empty() ? "" : p.problems[0]);
  EXPECT_EQ(p.ModeOf("lightning"), CpMode::kAll2All);
  EXPECT_EQ(p.ModeOf("mla"), CpMode::kAll2All);

  s.parallel.cp = 8;  // > n_heads = 4: allgather for both layer types (head size 16)
  p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << (p.problems.empty() ? "" : p.problems[0]);
  EXPECT_EQ(p.ModeOf("lightning"), CpMode::kAllGather);
  EXPECT_EQ(p.ModeOf("mla"), CpMode::kAllGather);

  s.parallel.cp = 2;
  s.parallel.mla_mode = CpMode::kAllGather;  // forced: runs
  p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << (p.problems.empty() ? "" : p.problems[0]);
  EXPECT_EQ(p.ModeOf("mla"), CpMode::kAllGather);
  // The CUDA engine's MLA AllGather keeps the visible rows' keys and values, the CPU's the
  // latent only: the CUDA estimate is the larger.
  JobSpec on_cpu = s;
  on_cpu.resources = "cpu";
  EXPECT_TRUE(CpPlanner().Plan(on_cpu, 0).ok());
  s.parallel.mla_mode = CpMode::kAll2All;
  const int64_t all2all_ws = CpPlanner().Plan(s, 0).memory.workspace_bytes;
  EXPECT_GT(p.memory.workspace_bytes, all2all_ws);

  // Head size 64: Lightning's allgather runs on CUDA, forced or because cp > n_heads.
  s = Spec(2, 4, 1024);
  s.resources = "cuda";
  s.model.d_model = 256;
  s.parallel.lightning_mode = CpMode::kAllGather;
  p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << (p.problems.empty() ? "" : p.problems[0]);
  EXPECT_EQ(p.ModeOf("lightning"), CpMode::kAllGather);
  s.parallel.lightning_mode = CpMode::kAuto;
  s.parallel.cp = 8;
  p = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(p.ok()) << (p.problems.empty() ? "" : p.problems[0]);
  EXPECT_EQ(p.ModeOf("mla"), CpMode::kAllGather);

  // A head size the CUDA kernels do not take is refused on "cuda" whatever the cp, with the
  // problem named; the CPU engine runs it.
  s = Spec(1, 4, 1024);
  s.resources = "cuda";
  s.model.d_model = 192;  // 4 heads of 48
  p = CpPlanner().Plan(s, 0);
  ASSERT_EQ(p.problems.size(), 1u);
  EXPECT_EQ(p.problems[0],
            "model: resources \"cuda\" cannot run Lightning head size d_model/n_heads = 48 (the "
            "CUDA kernels take 64, 128, or an even size up to 32); use resources \"cpu\" or "
            "another shape");
  s.resources = "cpu";
  EXPECT_TRUE(CpPlanner().Plan(s, 0).ok());
}

TEST(CpPlannerTest, ListsEveryProblemWithExactMessages) {
  JobSpec s = Spec(8, 4, 1000);
  s.parallel.lightning_mode = CpMode::kAll2All;
  s.parallel.mla_mode = CpMode::kAll2All;
  CpPlan p = CpPlanner().Plan(s, 1 << 20);  // 1 MiB device: too small
  ASSERT_EQ(p.problems.size(), 4u) << ::testing::PrintToString(p.problems);
  EXPECT_EQ(p.problems[0],
            "parallel.lightning_mode: all2all needs n_heads divisible by cp, but n_heads=4 and "
            "cp=8 (4 % 8 = 4); use allgather or a cp that divides 4");
  EXPECT_EQ(p.problems[1],
            "parallel.mla_mode: all2all needs n_heads divisible by cp, but n_heads=4 and cp=8 "
            "(4 % 8 = 4); use allgather or a cp that divides 4");
  EXPECT_EQ(p.problems[2],
            "seq_len: 1000 is not divisible by 2*cp = 16 (zigzag chunks need equal sizes)");
  EXPECT_EQ(p.problems[3].rfind("memory: estimated ", 0), 0u) << p.problems[3];
  // Without CP a sequence still has two zigzag chunks: an odd length is refused there too.
  const CpPlan odd = CpPlanner().Plan(Spec(1, 4, 1001), 0);
  ASSERT_EQ(odd.problems.size(), 1u) << ::testing::PrintToString(odd.problems);
  EXPECT_EQ(odd.problems[0],
            "seq_len: 1001 is not divisible by 2*cp = 2 (zigzag chunks need equal sizes)");
  // Nothing fits 1 MiB: the hint says what even every layer recomputing needs.
  EXPECT_NE(p.problems[3].find("exceeds the 1.0 MiB of one cpu device; with every layer "
                               "recomputing it still needs "),
            std::string::npos)
      << p.problems[3];
  EXPECT_FALSE(p.ok());
}

// A job that does not fit its device is told what would fit: the fewest leading layers
// recomputing, else the smallest cp with every layer recomputing. Each hint is checked by planning
// what it says (it fits) and one step less (it does not).
TEST(CpPlannerTest, MemoryProblemSaysWhatWouldFit) {
  JobSpec s;
  s.model = *ModelPreset("1b");
  s.resources = "cuda";
  s.seq_len = 131072;
  const int64_t gib = int64_t{1} << 30;
  auto memory_problem = [](const CpPlan& p) {
    for (const std::string& q : p.problems)
      if (q.rfind("memory: ", 0) == 0) return q;
    return std::string();
  };
  // 128K tokens without recompute on an 80 GiB device: some leading layers must recompute.
  CpPlan p = CpPlanner().Plan(s, 80 * gib);
  std::string q = memory_problem(p);
  const std::string lead = "; recomputing the first ";
  const size_t at = q.find(lead);
  ASSERT_NE(at, std::string::npos) << q;
  const int64_t r = std::stoll(q.substr(at + lead.size()));
  EXPECT_NE(q.find(" of 16 layers fits ("), std::string::npos) << q;
  EXPECT_NE(q.find("): train.recompute = " + std::to_string(r) + " or \"auto\""), std::string::npos)
      << q;
  s.train.recompute_layers = r;
  EXPECT_TRUE(CpPlanner().Plan(s, 80 * gib).ok());
  s.train.recompute_layers = r - 1;
  EXPECT_FALSE(CpPlanner().Plan(s, 80 * gib).ok());

  // 1176K tokens with every layer recomputing on one 141 GiB device, which offloading the layer
  // inputs does not fit either: a larger cp, with both layer types in AllGather mode where that
  // holds less than the default modes.
  s.seq_len = 147 << 13;
  s.train.recompute_layers = 16;
  auto hinted_cp = [&](const std::string& problem, bool* allgather) -> int64_t {
    const std::string cp_lead = "; parallel.cp = ";
    const size_t cp_at = problem.find(cp_lead);
    if (cp_at == std::string::npos) return -1;
    *allgather = problem.find(
                     " with parallel.lightning_mode = parallel.mla_mode = \"allgather\" "
                     "and every layer recomputing fits (") != std::string::npos;
    EXPECT_TRUE(*allgather ||
                problem.find(" with every layer recomputing fits (") != std::string::npos)
        << problem;
    return std::stoll(problem.substr(cp_at + cp_lead.size()));
  };
  auto fits = [&](JobSpec j, int64_t cp, CpMode mode) {
    j.parallel.cp = cp;
    j.parallel.lightning_mode = j.parallel.mla_mode = mode;
    return CpPlanner().Plan(j, 141 * gib).ok();
  };
  bool allgather = false;
  q = memory_problem(CpPlanner().Plan(s, 141 * gib));
  const int64_t cp = hinted_cp(q, &allgather);
  ASSERT_GT(cp, 1) << q;
  EXPECT_TRUE(allgather) << q;  // 1176K on two GPUs: only AllGather fits
  EXPECT_TRUE(fits(s, cp, allgather ? CpMode::kAllGather : CpMode::kAuto));
  EXPECT_FALSE(fits(s, cp, CpMode::kAuto));
  for (int64_t smaller = 2; smaller < cp; ++smaller) {
    EXPECT_FALSE(fits(s, smaller, CpMode::kAuto)) << "cp " << smaller;
    EXPECT_FALSE(fits(s, smaller, CpMode::kAllGather)) << "cp " << smaller;
  }
  // With the modes set by the spec the hint keeps them: All2All needs a larger cp.
  s.parallel.lightning_mode = s.parallel.mla_mode = CpMode::kAll2All;
  q = memory_problem(CpPlanner().Plan(s, 141 * gib));
  const int64_t cp_all2all = hinted_cp(q, &allgather);
  EXPECT_FALSE(allgather) << q;
  EXPECT_GT(cp_all2all, cp) << q;
  EXPECT_TRUE(fits(s, cp_all2all, CpMode::kAll2All));
  EXPECT_FALSE(fits(s, cp_all2all - 1, CpMode::kAll2All));
  // Modes the spec sets to AllGather are kept too: the same cp as the hint above, no mode clause.
  s.parallel.lightning_mode = s.parallel.mla_mode = CpMode::kAllGather;
  q = memory_problem(CpPlanner().Plan(s, 141 * gib));
  EXPECT_EQ(hinted_cp(q, &allgather), cp) << q;
  EXPECT_FALSE(allgather) << q;
}

// train.offload on a cuda job: the activations hold kCudaOffloadSlots layer inputs instead of
// n_layers (the rest, host_bytes, in pinned host memory), nothing else changes; a job that does
// not fit even with every layer recomputing is told the offload when that fits, and the longest
// seq_len grows with it. A cpu job never offloads.
TEST(CpPlannerTest, OffloadMovesTheLayerInputsToTheHost) {
  JobSpec s;
  s.model = *ModelPreset("1b");
  s.resources = "cuda";
  s.seq_len = 786432;
  s.train.recompute_layers = 16;
  const int64_t gib = int64_t{1} << 30, h200 = static_cast<int64_t>(139.8 * double(gib));
  const int64_t inputs = (16 - kCudaOffloadSlots) * s.seq_len * 2048 * 2;
  const CpPlan on_device = CpPlanner().Plan(s, h200);
  EXPECT_EQ(on_device.memory.host_bytes, 0);
  ASSERT_FALSE(on_device.ok());
  const std::string& problem = on_device.problems.back();
  EXPECT_NE(problem.find("; with train.offload = true and every layer recomputing it fits ("),
            std::string::npos)
      << problem;
  EXPECT_NE(problem.find(" of pinned host memory)"), std::string::npos) << problem;

  s.train.offload = true;
  const CpPlan offloaded = CpPlanner().Plan(s, h200);
  EXPECT_TRUE(offloaded.ok()) << offloaded.problems.back();
  EXPECT_EQ(offloaded.memory.host_bytes, inputs);
  EXPECT_EQ(on_device.memory.activations_bytes - offloaded.memory.activations_bytes, inputs);
  EXPECT_EQ(on_device.memory.total_bytes - offloaded.memory.total_bytes, inputs);
  EXPECT_GT(offloaded.max_seq_len, on_device.max_seq_len + 131072)
      << offloaded.max_seq_len << " against " << on_device.max_seq_len;
  EXPECT_EQ(on_device.max_seq_len_offload, offloaded.max_seq_len);  // what the plan tells
  EXPECT_EQ(offloaded.max_seq_len_offload, 0);

  // Without recompute the layers' own caches dominate; the offload still moves the inputs.
  s.seq_len = 32768;
  s.train.recompute_layers = 0;
  const MemoryEstimate plain = CpPlanner().Plan(s, 0).memory;
  s.train.offload = false;
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.total_bytes - plain.total_bytes,
            (16 - kCudaOffloadSlots) * int64_t{32768} * 2048 * 2);

  // A model of no more layers than the device keeps offloads nothing.
  s.model = *ModelPreset("tiny");
  s.train.offload = true;
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.host_bytes,
            (4 - kCudaOffloadSlots) * int64_t{32768} * 64 * 2);
  s.model.n_layers = kCudaOffloadSlots;
  s.model.layer_pattern = "LLM";
  ASSERT_TRUE(s.model.Validate().ok()) << s.model.Validate();
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.host_bytes, 0);
  s.resources = "cpu";
  s.model = *ModelPreset("tiny");
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.host_bytes, 0);
}

// MLA's attention backward runs in groups of heads whose fp32 dQ accumulator stays within
// kCudaDqAccumulatorBytes (the largest dividing group, at least one head); a T that is not a
// multiple of 4 keeps every head in one call.
TEST(CpPlannerTest, AttentionHeadGroupsBoundTheDqAccumulator) {
  EXPECT_EQ(CudaAttentionHeadsPerCall(32768, 16, 192), 16);  // 0.38 GiB
  EXPECT_EQ(CudaAttentionHeadsPerCall(131072, 16, 192), 8);  // 0.75 GiB
  EXPECT_EQ(CudaAttentionHeadsPerCall(262144, 16, 192), 4);  // 5 would fit: not a divisor
  EXPECT_EQ(CudaAttentionHeadsPerCall(393216, 16, 192), 2);
  EXPECT_EQ(CudaAttentionHeadsPerCall(917504, 16, 192), 1);   // 0.66 GiB
  EXPECT_EQ(CudaAttentionHeadsPerCall(1 << 22, 16, 192), 1);  // 3 GiB, but one head is the least
  EXPECT_EQ(CudaAttentionHeadsPerCall(131073, 16, 192), 16);  // T % 4 != 0
  EXPECT_EQ(CudaAttentionHeadsPerCall(262144, 12, 192), 4);   // 5 would fit: 4 divides 12
  EXPECT_EQ(CudaAttentionHeadsPerCall(262144, 1, 192), 1);
  for (const int64_t T : {int64_t{4096}, int64_t{131072}, int64_t{655360}, int64_t{1} << 20}) {
    const int64_t g = CudaAttentionHeadsPerCall(T, 16, 192);
    EXPECT_EQ(16 % g, 0) << T;
    EXPECT_TRUE(g == 1 || T * g * 192 * 4 <= kCudaDqAccumulatorBytes) << T;
  }
}

// On one GPU MLA's backward takes its projections' gradients in the attention's head groups where
// that holds less than one group (the copies of a group's inputs and the fp32 sums cost more than
// the group's share of the gradients saves until the groups are small); under MLA All2All in the
// ranks' blocks of heads, where that holds less.
TEST(CpPlannerTest, MlaGradientHeadGroupsHoldLess) {
  const ModelConfig c = *ModelPreset("1b");
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 16), 30848);  // dO, dQ, dK, dkvb and the latent's
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 8), 36224);   // more than one group
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 4), 25984);
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 1), 18304);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 32768), 16);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 131072), 16);  // the attention's 8 would hold more
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 262144), 4);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 524288), 2);
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 2), 20864);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 1048576), 1);
  // Under MLA All2All the groups are the ranks' blocks of heads, read without copies.
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 8, false), 25984);
  EXPECT_EQ(CudaMlaGradBytesPerToken(c, 2, false), 18304);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 131072, 2), 8);
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(c, 131072, 8), 2);
  ModelConfig wide = c;  // a wide latent: the fp32 sums outweigh the rank blocks' saving
  wide.mla.kv_lora_rank = 4096;
  EXPECT_EQ(CudaMlaGradHeadsPerGroup(wide, 131072, 2), 16);
  // The estimate follows: at 1M tokens on one GPU the MLA scratch is no longer the larger kind's,
  // so the workspace holds Lightning's five [T, d] gradients.
  JobSpec s;
  s.model = c;
  s.resources = "cuda";
  s.seq_len = 1048576;
  s.train.recompute_layers = c.n_layers;
  const int64_t T = s.seq_len, d = c.d_model;
  const MemoryEstimate m = CpPlanner().Plan(s, 0).memory;
  EXPECT_EQ(m.workspace_bytes, 4096 * c.vocab * 4 + (int64_t{64} << 20) + T * 2 * (d + 5 * d) +
                                   kCudaFfnBlockRows * 2 * 3 * c.ffn_dim);
}

TEST(CpPlannerTest, ChunksTooShort) {
  CpPlan p = CpPlanner().Plan(Spec(4, 4, 64), 0);
  ASSERT_EQ(p.problems.size(), 1u);
  EXPECT_EQ(p.problems[0], "seq_len: 64 gives 8 tokens per chunk with cp=4; at least 16 are needed");
}

TEST(CpPlannerTest, MemoryEstimateComponentsAndRecompute) {
  JobSpec s = Spec(1, 4, 4096);
  CpPlan a = CpPlanner().Plan(s, 0);
  const int64_t P = s.model.NumParams();
  EXPECT_EQ(a.memory.params_bytes, 4 * P);
  EXPECT_EQ(a.memory.grads_bytes, 4 * P);
  EXPECT_EQ(a.memory.optimizer_bytes, 8 * P);  // AdamW
  EXPECT_EQ(a.memory.total_bytes, a.memory.params_bytes + a.memory.grads_bytes +
                                      a.memory.optimizer_bytes + a.memory.activations_bytes +
                                      a.memory.workspace_bytes);
  s.train.recompute_layers = s.model.n_layers;
  CpPlan b = CpPlanner().Plan(s, 0);
  EXPECT_LT(b.memory.activations_bytes, a.memory.activations_bytes);
  EXPECT_EQ(b.memory.recompute_layers, 8);
  // Activations scale with the tokens per rank: cp=2 halves them (All2All, no gathered latents).
  JobSpec c = Spec(2, 4, 4096);
  CpPlan pc = CpPlanner().Plan(c, 0);
  EXPECT_EQ(pc.memory.activations_bytes * 2, a.memory.activations_bytes);
  EXPECT_EQ(a.warnings.size(), 1u);
}

// Recomputing the first R layers: R = 0 and R = n are the plain and the every-layer estimates,
// and each layer that recomputes instead of keeping its cache saves that cache less its input
// (the shared cache, as large as one layer, is paid once, so R = 1 saves nothing).
TEST(CpPlannerTest, PartialRecomputeEstimate) {
  for (const char* resources : {"cpu", "cuda"}) {
    JobSpec s = Spec(1, 4, 4096);
    s.resources = resources;
    s.model.layer_pattern = "LLLM";  // layers 3 and 7 are MLA
    const std::vector<LayerModePlan> modes = CpPlanner().Plan(s, 0).layers;
    std::vector<int64_t> act;
    for (int64_t r = 0; r <= 8; ++r) act.push_back(EstimateMemory(s, modes, r).activations_bytes);
    s.train.recompute_layers = 0;
    EXPECT_EQ(act[0], CpPlanner().Plan(s, 0).memory.activations_bytes) << resources;
    s.train.recompute_layers = 8;
    EXPECT_EQ(act[8], CpPlanner().Plan(s, 0).memory.activations_bytes) << resources;
    const int64_t B = std::string(resources) == "cuda" ? 2 : 4, T = 4096, d = 64;
    EXPECT_EQ(act[1], act[0] + T * B * d) << resources;
    // Layers 1 and 2 are Lightning: each saves a Lightning cache less its input.
    EXPECT_EQ(act[2] - act[3], act[1] - act[2]) << resources;
    EXPECT_GT(act[1], act[2]) << resources;
    for (int64_t r = 2; r < 8; ++r) EXPECT_GT(act[r], act[r + 1]) << resources << " r " << r;
  }
}

// "auto": the fewest leading layers whose estimate fits 90% of the device; every layer without a
// device (with a warning) or when nothing fits.
TEST(CpPlannerTest, AutoRecomputePicksTheFewestLayersThatFit) {
  JobSpec s = Spec(1, 4, 65536);
  s.train.recompute_layers = TrainSpec::kRecomputeAuto;
  const std::vector<LayerModePlan> modes = CpPlanner().Plan(s, 0).layers;
  auto total = [&](int64_t r) { return EstimateMemory(s, modes, r).total_bytes; };
  for (int64_t want : {0, 3, 5, 8}) {
    const int64_t device = static_cast<int64_t>(total(want) / kRecomputeAutoFill) + 1;
    CpPlan p = CpPlanner().Plan(s, device);
    EXPECT_EQ(p.memory.recompute_layers, want) << "device " << device;
    EXPECT_EQ(RecomputeLayersFor(s, modes, device), want);
    EXPECT_TRUE(p.ok()) << ::testing::PrintToString(p.problems);
    for (int64_t r = 0; r < want; ++r) EXPECT_GT(total(r), kRecomputeAutoFill * device) << r;
  }
  CpPlan none = CpPlanner().Plan(s, 0);
  EXPECT_EQ(none.memory.recompute_layers, 8);
  EXPECT_NE(std::find(none.warnings.begin(), none.warnings.end(),
                      "train.recompute \"auto\": no device known, every layer recomputes"),
            none.warnings.end())
      << ::testing::PrintToString(none.warnings);
  CpPlan tiny = CpPlanner().Plan(s, 1 << 20);
  EXPECT_EQ(tiny.memory.recompute_layers, 8);
  ASSERT_EQ(tiny.problems.size(), 1u);
  EXPECT_EQ(tiny.problems[0].find("train.recompute"), std::string::npos) << tiny.problems[0];
}

// The CUDA estimate against the 1b step measured on H200s (bench/RESULTS_GPU.md, 2026-11-30
// 17:35-17:52: the FFN in 32K-token blocks wherever its activations are not kept; the two layer
// kinds' gradient scratch, and the recomputing layers' shared cache, one kind at a time; each row
// from an empty allocator).
// - Its allocator part (without runtime_bytes), within 5% (it is within 2.3%), against weights +
//   gradients + AdamW state + bf16 copy (16.78 GiB) plus the caching allocator's peak. With
//   recompute the MLA layers keep their attention outputs. The cp = 2 points are per rank; both
//   ranks on one GPU over Gloo use the NCCL path's device buffers (at 256K All2All the two gave
//   45.20 and 45.19 GiB).
// - The whole estimate, within 3%, against the device memory in use (cudaMemGetInfo) at the
//   one-GPU points: beyond the allocator the device holds 0.6 GiB plus cuDNN's fp32 dQ
//   accumulator of one group of heads (CudaAttentionHeadsPerCall: 16 x 192 x 4 bytes a token at
//   32K and 64K, at most 1 GiB from 128K on); and at the points over NCCL on two GPUs, where it
//   also holds NCCL's buffers (1.3 GiB) (bench/cuda/NOTES.md, "NCCL's device memory,
//   and the rest"). The device-use figures from 128K on, and at cp = 2 but for 256K AllGather,
//   were measured with the attention backward in head groups (2026-11-30 22:41-22:52); 917,504
//   tokens with the layer inputs offloaded (train.offload). The one-GPU points from 256K on were
//   measured again with MLA's whole backward in head groups (CudaMlaGradHeadsPerGroup,
//   2026-12-01 00:01-00:26), as was 1M offloaded. The cp = 2 points with an All2All layer kind
//   were measured again once the exchange received into the whole-sequence buffers themselves and
//   MLA's backward took the ranks' blocks of heads as groups (2026-12-01: 256K and 512K over NCCL
//   on two GPUs at 02:14; 384K and 256K AllGather / All2All at 01:52 with both ranks on one
//   GPU over Gloo, bench/cuda/cp_memory_one_gpu.sh, whose device use is not known, with 64 MiB of
//   reordering staging since removed). The cp = 4 points: the four ranks on one GPU over Gloo, the
//   same script (2026-12-01 04:13-04:16).
TEST(CpPlannerTest, CudaEstimateTracksTheMeasured1bSteps) {
  JobSpec s;
  s.model = *ModelPreset("1b");
  s.resources = "cuda";
  const double gib = double(int64_t{1} << 30);
  struct Point {
    int64_t T, cp;
    int64_t recompute_layers;
    CpMode lightning, mla;
    double allocator_gib;  // fixed + the allocator's peak
    double device_gib;     // in use on the device; 0: not measured
    bool offload = false;  // train.offload
  };
  const CpMode A2A = CpMode::kAll2All, AG = CpMode::kAllGather;
  const double fixed = 16.78;
  for (const Point& pt : {Point{32768, 1, 0, A2A, A2A, fixed + 45.60, 63.32},
                          Point{65536, 1, 0, A2A, A2A, fixed + 89.39, 107.49},
                          Point{131072, 1, 9, A2A, A2A, fixed + 93.95, 112.05},
                          Point{131072, 1, 8, A2A, A2A, fixed + 104.14, 122.24},
                          Point{131072, 1, 16, A2A, A2A, fixed + 23.96, 42.07},
                          Point{262144, 1, 16, A2A, A2A, fixed + 44.19, 62.29},
                          Point{524288, 1, 16, A2A, A2A, fixed + 83.29, 101.40},
                          Point{655360, 1, 16, A2A, A2A, fixed + 103.49, 121.78},
                          Point{262144, 2, 16, A2A, A2A, fixed + 28.35, 47.73},
                          Point{262144, 2, 16, AG, A2A, fixed + 27.66, 0},
                          Point{262144, 2, 16, AG, AG, fixed + 27.99, 47.81},
                          Point{393216, 2, 16, A2A, A2A, fixed + 41.31, 0},
                          Point{524288, 2, 16, A2A, A2A, fixed + 54.13, 73.51},
                          Point{1048576, 2, 16, AG, AG, fixed + 103.28, 123.10},
                          Point{131072, 4, 16, A2A, A2A, fixed + 8.89, 0},
                          Point{196608, 4, 16, A2A, A2A, fixed + 12.10, 0},
                          Point{196608, 4, 16, AG, AG, fixed + 13.07, 0},
                          Point{917504, 1, 16, A2A, A2A, fixed + 98.02, 116.12, true},
                          Point{1048576, 1, 16, A2A, A2A, fixed + 111.65, 129.86, true}}) {
    s.seq_len = pt.T;
    s.parallel.cp = pt.cp;
    s.train.recompute_layers = pt.recompute_layers;
    s.parallel.lightning_mode = pt.lightning;
    s.parallel.mla_mode = pt.mla;
    s.train.offload = pt.offload;
    const MemoryEstimate m = CpPlanner().Plan(s, 0).memory;
    const double allocator = (m.total_bytes - m.runtime_bytes) / gib, whole = m.total_bytes / gib;
    SCOPED_TRACE(::testing::Message()
                 << "T " << pt.T << " cp " << pt.cp << " recompute " << pt.recompute_layers
                 << (pt.offload ? " offload " : " ") << CpModeName(pt.lightning) << "/"
                 << CpModeName(pt.mla) << ": estimate " << allocator << " GiB + runtime "
                 << whole - allocator << ", measured " << pt.allocator_gib << " / in use "
                 << pt.device_gib);
    EXPECT_NEAR(allocator / pt.allocator_gib, 1.0, 0.05);
    if (pt.device_gib > 0) EXPECT_NEAR(whole / pt.device_gib, 1.0, 0.03);
  }
  // A CPU job has no CUDA runtime.
  s.resources = "cpu";
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.runtime_bytes, 0);
}

// With a device, the plan names the longest seq_len (in steps of 2 cp x 1024 tokens) whose
// estimate with every layer recomputing fits it: the 1b model on one H200 between the measured
// 640K, which ran with 121.78 GiB in use, and 768K (786,432), which the measured rate from 512K to
// 640K (20.38 GiB for 128K tokens) puts at 142.2 GiB, over the device; with the layer inputs
// offloaded above the measured 1M (129.86 GiB); on two in AllGather mode above the measured 1M.
// Without a device there is none.
TEST(CpPlannerTest, LongestSeqLenFitsTheDeviceAndOneStepMoreDoesNot) {
  JobSpec s;
  s.model = *ModelPreset("1b");
  s.resources = "cuda";
  s.seq_len = 131072;
  s.train.recompute_layers = TrainSpec::kRecomputeAuto;
  const int64_t h200 = static_cast<int64_t>(139.8 * double(int64_t{1} << 30));
  for (const auto& [cp, mode] :
       {std::pair<int64_t, CpMode>{1, CpMode::kAuto}, {2, CpMode::kAllGather}}) {
    s.parallel.cp = cp;
    s.parallel.lightning_mode = s.parallel.mla_mode = mode;
    const CpPlan p = CpPlanner().Plan(s, h200);
    SCOPED_TRACE(::testing::Message() << "cp " << cp << ": longest " << p.max_seq_len);
    const int64_t step = 2 * cp * 1024;
    ASSERT_GT(p.max_seq_len, 0);
    EXPECT_EQ(p.max_seq_len % step, 0);
    auto total = [&](int64_t seq_len) {
      JobSpec j = s;
      j.seq_len = seq_len;
      return EstimateMemory(j, p.layers, s.model.n_layers).total_bytes;
    };
    EXPECT_LE(total(p.max_seq_len), h200);
    EXPECT_GT(total(p.max_seq_len + step), h200);
    if (cp == 1) {
      EXPECT_GE(p.max_seq_len, 655360);
      EXPECT_LT(p.max_seq_len, 786432);
      EXPECT_GE(p.max_seq_len_offload, 1048576);
    } else {
      EXPECT_GE(p.max_seq_len, 1048576);
    }
  }
  EXPECT_EQ(CpPlanner().Plan(s, 0).max_seq_len, 0);
}

// train.precision: "fp8" on "cuda" adds its FP8 copies to the estimate (weights with their
// transposed copies in place of their bf16 ones, each kept layer's linear-layer inputs' transposes and one scratch of their
// row-major codes, one output gradient) less the bf16 activations it leaves unwritten;
// "auto" and "bf16" add nothing on the GPU; on the CPU the emulation's fp32-held copies count.
// Without recompute FP8 leaves bf16 activations unwritten and holds less than bf16.
TEST(CpPlannerTest, Fp8CopiesAreCountedAndPlannedWith) {
  JobSpec s;
  s.model = *ModelPreset("1b");
  s.seq_len = 32768;
  s.resources = "cuda";
  s.train.recompute_layers = 0;
  const ModelConfig& m = s.model;
  const int64_t d = m.d_model, H = m.n_heads, f = m.ffn_dim, T = s.seq_len, V = m.vocab;
  const MlaConfig& a = m.mla;
  // The blocks' linear weights: every parameter but the embedding, the LM head and the norms.
  int64_t norms = d;  // final norm
  for (int64_t i = 0; i < m.n_layers; ++i)
    norms +=
        2 * d + (m.LayerKind(i) == 'L' ? 2 * m.head_dim() + d : a.kv_lora_rank + a.q_lora_rank);
  const int64_t linear = m.NumParams() - 2 * V * d - norms;
  const int64_t nl = m.NumLayersOfKind('L'), nm = m.NumLayersOfKind('M');
  const int64_t inputs =
      nl * (3 * d + f) + nm * (2 * d + a.q_lora_rank + a.kv_lora_rank + H * a.v_head_dim + f);
  // The widest output gradient: 1b's qkv, 3 d, wider than f, H qk and H (qk_nope + v).
  const int64_t widest = 3 * d;
  ASSERT_GT(widest,
            std::max({f, H * (a.qk_nope_dim + a.qk_rope_dim), H * (a.qk_nope_dim + a.v_head_dim)}));
  // The inputs' row-major codes share one scratch of the widest input, f; kept layers leave
  // Lightning's bf16 h, y, h2 and a and MLA's h2 and a unwritten.
  const int64_t scratch = T * f;
  const int64_t unwritten = nl * (3 * d + f) + nm * (d + f);
  // The weights' FP8 codes (2 linear) replace their bf16 working copy (2 linear).
  ASSERT_GT(linear, 0);
  const int64_t want = T * inputs + scratch + 2 * T * widest - 2 * T * unwritten;

  const CpPlan bf16 = CpPlanner().Plan(s, 0);
  EXPECT_EQ(bf16.memory.precision_bytes, 0);
  s.train.precision = TrainPrecision::kBf16;
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.precision_bytes, 0);
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.total_bytes, bf16.memory.total_bytes);
  s.train.precision = TrainPrecision::kFp8;
  const CpPlan fp8 = CpPlanner().Plan(s, 0);
  EXPECT_EQ(fp8.memory.precision_bytes, want);
  EXPECT_EQ(fp8.memory.total_bytes, bf16.memory.total_bytes + want);
  // 1b at 32K without recompute: FP8 holds gigabytes less than bf16, not a rounding error.
  EXPECT_LT(want, -(int64_t{2} << 30));

  // Planned with: a device between the two estimates fits fp8 and refuses bf16, naming memory.
  const int64_t device = bf16.memory.total_bytes + want / 2;
  EXPECT_TRUE(CpPlanner().Plan(s, device).ok());
  s.train.precision = TrainPrecision::kAuto;
  const CpPlan refused = CpPlanner().Plan(s, device);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.problems[0].rfind("memory: estimated ", 0), 0u) << refused.problems[0];
  // With train.recompute "auto" fp8 recomputes no more layers than bf16.
  s.train.recompute_layers = TrainSpec::kRecomputeAuto;
  const int64_t r16 = CpPlanner().Plan(s, device).memory.recompute_layers;
  s.train.precision = TrainPrecision::kFp8;
  EXPECT_LE(CpPlanner().Plan(s, device).memory.recompute_layers, r16);
  EXPECT_GT(r16, 0);
  // Every layer recomputing keeps no layer's bf16 activations to leave unwritten: fp8 then adds.
  s.train.recompute_layers = m.n_layers;
  const int64_t all16 = [&] {
    JobSpec b = s;
    b.train.precision = TrainPrecision::kAuto;
    return CpPlanner().Plan(b, 0).memory.total_bytes;
  }();
  EXPECT_GT(CpPlanner().Plan(s, 0).memory.total_bytes, all16);
  // Under fp8 each recomputing Lightning layer also keeps its norms' and group norm's statistics
  // for its recomputed forward's one-pass quantization: T (2 + H) fp32.
  JobSpec auto_all = s;
  auto_all.train.precision = TrainPrecision::kAuto;
  EXPECT_EQ(CpPlanner().Plan(s, 0).memory.activations_bytes -
                CpPlanner().Plan(auto_all, 0).memory.activations_bytes,
            4 * T * nl * (2 + H));

  // The CPU emulation: a 4 P working copy for bf16; fp8 more.
  JobSpec c;
  c.model = *ModelPreset("tiny");
  c.seq_len = 1024;
  c.train.precision = TrainPrecision::kBf16;
  EXPECT_EQ(CpPlanner().Plan(c, 0).memory.precision_bytes, 4 * c.model.NumParams());
  c.train.precision = TrainPrecision::kFp8;
  EXPECT_GT(CpPlanner().Plan(c, 0).memory.precision_bytes, 8 * c.model.NumParams());
  c.train.precision = TrainPrecision::kFp32;
  EXPECT_EQ(CpPlanner().Plan(c, 0).memory.precision_bytes, 0);
}

// train.fp8_recipe "blockwise" on "cuda": a dense model plans, its estimate the tensorwise one
// plus the block scales (a 4-byte scale per 128 codes of each layout of every kept activation and
// of the output gradient, the weights' 128 x 128 block scales in both layouts) and the bf16 [T, d]
// scratch of the norms that only feed FP8 GEMMs. A MoE model plans too, the experts' block scales
// added: each expert's w1, w2, w3 in 128 x 128 blocks (both layouts), the experts' rows and SwiGLU
// output of each kept MoE layer and the three output gradients in 1 x 128 row blocks and
// 128-token column blocks that restart at each expert's segment.
TEST(CpPlannerTest, Fp8BlockwiseOnCudaPlansDenseAndMoeModels) {
  auto blocks = [](int64_t n) { return (n + 127) / 128; };
  auto padded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  // Floats of a kBlock128 scale tensor of [rows, cols]: rows of blocks padded to 4.
  auto square = [&](int64_t rows, int64_t cols) {
    return blocks(rows) * ((blocks(cols) + 3) / 4 * 4);
  };
  // What the dense linears add (as the engine lays it out): the kept inputs as
  // Fp8CopiesAreCountedAndPlannedWith counts them (a MoE layer's FFN apart), the widest output
  // gradient (1b's qkv, 3 d): both layouts' scales, 8 bytes per 128 values; the weights' scales;
  // the norms' bf16 scratch.
  auto dense_extra = [&](const JobSpec& s) {
    const ModelConfig& m = s.model;
    const int64_t d = m.d_model, H = m.n_heads, f = m.ffn_dim, T = s.seq_len;
    const MlaConfig& a = m.mla;
    int64_t inputs = 0;
    for (int64_t i = 0; i < m.n_layers; ++i)
      inputs +=
          (m.LayerKind(i) == 'L' ? 2 * d : d + a.q_lora_rank + a.kv_lora_rank + H * a.v_head_dim) +
          (m.IsMoeLayer(i) ? 0 : d + f);
    int64_t weights = 0;
    for (const LinearWeight& w : Fp8LinearWeights(m))
      weights += padded(4 * square(w.out, w.in)) + padded(4 * square(w.in, w.out));
    return (T * inputs + T * 3 * d) / 16 + weights + 2 * T * d;
  };
  auto extra = [](JobSpec s) {
    s.train.fp8_recipe = TrainFp8Recipe::kTensorwise;
    const CpPlan tensorwise = CpPlanner().Plan(s, 0);
    s.train.fp8_recipe = TrainFp8Recipe::kBlockwise;
    const CpPlan blockwise = CpPlanner().Plan(s, 0);
    EXPECT_TRUE(tensorwise.ok()) << tensorwise.problems.front();
    EXPECT_TRUE(blockwise.ok()) << blockwise.problems.front();
    EXPECT_EQ(blockwise.memory.total_bytes - tensorwise.memory.total_bytes,
              blockwise.memory.precision_bytes - tensorwise.memory.precision_bytes);
    return blockwise.memory.precision_bytes - tensorwise.memory.precision_bytes;
  };

  JobSpec s;
  s.model = *ModelPreset("1b");
  s.seq_len = 32768;
  s.resources = "cuda";
  s.train.recompute_layers = 0;
  s.train.precision = TrainPrecision::kFp8;
  const int64_t dense = extra(s);
  EXPECT_EQ(dense, dense_extra(s));
  // Small beside the codes: under a tenth of the kept inputs' bytes.
  EXPECT_LT(dense, s.seq_len * 16 * (3 * s.model.d_model + s.model.ffn_dim) / 10);

  JobSpec moe = Spec(1, 1, 16384);
  moe.model = *ModelPreset("moe");
  moe.resources = "cuda";
  moe.train.precision = TrainPrecision::kFp8;
  moe.train.recompute_layers = 0;
  const ModelConfig& m = moe.model;
  const int64_t d = m.d_model, E = m.moe.experts, fe = m.moe.expert_ffn, T = moe.seq_len;
  const int64_t rows = T * m.moe.top_k;  // ep = 1: top_k rows a token
  // One [rows, cols] rows tensor's scales: a row block per 128 columns of each row, and per
  // column a block per 128 rows of each expert's segment (at most rows / 128 + E of them).
  auto rows_scales = [&](int64_t cols) {
    return 4 * rows * blocks(cols) + 4 * cols * (blocks(rows) + E);
  };
  const int64_t layers = m.NumMoeLayers();
  ASSERT_GT(layers, 0);
  const int64_t experts =
      layers * 3 * (padded(4 * E * square(fe, d)) + padded(4 * E * square(d, fe)));
  const int64_t kept_rows = layers * (rows_scales(d) + rows_scales(fe));
  const int64_t grads = rows_scales(d) + 2 * rows_scales(fe);
  EXPECT_EQ(extra(moe), dense_extra(moe) + experts + kept_rows + grads);
  // The CPU emulation runs it too.
  moe.resources = "cpu";
  moe.train.fp8_recipe = TrainFp8Recipe::kBlockwise;
  EXPECT_TRUE(CpPlanner().Plan(moe, 0).ok());
}

// FP8 with MoE experts: the engines quantize the experts' rows, SwiGLU outputs and output
// gradients (top_k rows a token), so the precision term grows with top_k on both engines; the CPU
// emulation copies every parameter (the experts too), and its blockwise recipe keeps column-block
// copies of the activations and gradients; under ep > 1 the GPU keeps the received bf16 rows
// beside their codes.
TEST(CpPlannerTest, Fp8CountsTheExpertsCopies) {
  auto precision = [](JobSpec s) { return CpPlanner().Plan(s, 0).memory.precision_bytes; };
  JobSpec c = Spec(1, 1, 1024);
  c.model = *ModelPreset("tiny-moe");
  c.train.precision = TrainPrecision::kFp8;
  const int64_t k2 = precision(c);
  EXPECT_GE(k2, 8 * c.model.NumParams());  // a working copy and an FP8 copy, experts included
  JobSpec more = c;
  more.model.moe.top_k = 2 * c.model.moe.top_k;
  EXPECT_GT(precision(more), k2);
  JobSpec blockwise = c;
  blockwise.train.fp8_recipe = TrainFp8Recipe::kBlockwise;
  EXPECT_GT(precision(blockwise), k2);

  JobSpec g = Spec(1, 1, 16384);
  g.model = *ModelPreset("moe");
  g.resources = "cuda";
  g.train.precision = TrainPrecision::kFp8;
  const int64_t gpu = precision(g);
  JobSpec wider = g;
  wider.model.moe.top_k = 2 * g.model.moe.top_k;
  // Each extra row a token brings: the experts' three output gradients in both layouts.
  const MoeConfig& moe = g.model.moe;
  EXPECT_EQ(precision(wider) - gpu,
            2 * g.seq_len * moe.top_k * (g.model.d_model + 2 * moe.expert_ffn));
  JobSpec ep2 = g;
  ep2.parallel.dp = 2;
  ep2.parallel.ep = 2;
  JobSpec ep2_bf16 = ep2;
  ep2_bf16.train.precision = TrainPrecision::kBf16;
  EXPECT_EQ(precision(ep2_bf16), 0);
  // The worst load's rows (ep min(top_k, E / ep) a token), and their codes beside the received
  // bf16 rows.
  EXPECT_GT(precision(ep2), gpu);
}

// Mixture of experts: every ep dividing the experts and the world is estimated; with ep left out
// the plan takes the smallest whose estimate fits the device (1 without a device), writes it into
// the planned spec, and an impossible ep is a problem naming the field. The token exchange grows
// with ep ((ep - 1) / ep of the rows); a rank's memory holds 1 / ep of the experts but plans for
// the worst load the router allows (ep T min(K, E / ep) rows), so it does not shrink forever.
TEST(CpPlannerTest, MoeExpertParallelismIsChosenToFit) {
  JobSpec s = Spec(1, 16, 8192);
  s.model = *ModelPreset("moe");
  s.parallel.dp = 8;
  s.train.recompute_layers = s.model.n_layers;
  EXPECT_FALSE(IsPlanned(s));  // ep undecided
  const CpPlan free = CpPlanner().Plan(s, 0);
  ASSERT_TRUE(free.ok()) << free.problems[0];
  EXPECT_EQ(free.ep, 1);
  EXPECT_EQ(free.ep_reason, "no device known: the smallest (memory not checked)");
  ASSERT_EQ(free.ep_estimates.size(), 4u);  // 1, 2, 4, 8
  for (size_t i = 1; i < free.ep_estimates.size(); ++i)
    EXPECT_GT(free.ep_estimates[i].dispatch_bytes, free.ep_estimates[i - 1].dispatch_bytes);
  EXPECT_EQ(free.ep_estimates[0].dispatch_bytes, 0);
  // A device between the ep 2 and ep 1 estimates: ep 2, the smallest that fits.
  const int64_t device =
      (free.ep_estimates[0].memory_bytes + free.ep_estimates[1].memory_bytes) / 2;
  const CpPlan fit = CpPlanner().Plan(s, device);
  ASSERT_TRUE(fit.ok()) << fit.problems[0];
  EXPECT_EQ(fit.ep, 2);
  EXPECT_EQ(fit.ep_reason, "the smallest whose estimate fits the device");
  EXPECT_FALSE(fit.ep_estimates[0].fits);
  EXPECT_TRUE(fit.ep_estimates[1].chosen);
  EXPECT_LE(fit.memory.total_bytes, device);
  const JobSpec run = PlannedSpec(s, fit);
  EXPECT_EQ(run.parallel.ep, 2);
  EXPECT_TRUE(IsPlanned(run));
  // ep 2 holds half the experts' weights, gradients and AdamW moments (16 bytes each) of ep 1,
  // less the larger worst-case dispatch.
  const int64_t experts = s.model.NumMoeLayers() * 64 * 3 * 2048 * 256;
  EXPECT_GT(free.ep_estimates[0].memory_bytes - free.ep_estimates[1].memory_bytes,
            16 * experts / 4);
  // Given: kept, and checked.
  s.parallel.ep = 4;
  EXPECT_EQ(CpPlanner().Plan(s, device).ep, 4);
  s.parallel.ep = 3;
  const CpPlan bad = CpPlanner().Plan(s, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.problems.back(), "job spec: parallel.ep: 3 must divide model.moe.experts = 64");
  // The CUDA engine runs the MoE FFN in bf16 and in fp8 (its experts a scale each).
  s.resources = "cuda";
  s.parallel.ep = 2;
  EXPECT_TRUE(CpPlanner().Plan(s, 0).ok());
  s.train.precision = TrainPrecision::kFp8;
  const CpPlan fp8 = CpPlanner().Plan(s, 0);
  EXPECT_TRUE(fp8.ok()) << fp8.problems.front();
  EXPECT_EQ(fp8.ep, 2);
}

}  // namespace
}  // namespace spindle
