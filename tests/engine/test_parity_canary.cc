// The parity canary (worker/engine/parity_canary.h), ranks as threads with Gloo over 127.0.0.1:
//  - correct layouts pass: every CP mode at cp = 2 (Lightning AllGather and All2All, MLA
//    AllGather, All2All and Ring), dp = 2 x cp = 2, the hybrid modes at cp = 4 (Ulysses groups of
//    2), and ep = 2 on the tiny-moe preset (with and without CP), each in fp32 and in the bf16
//    emulation (and an fp8 job, whose layout is checked at bf16), on fresh random parameters and
//    data (the seed is printed; SPINDLE_PARITY_SEED
//    replays one). The verdict is the canary's own (every tensor within 1e-3 (fp32) or 1e-1 (bf16)
//    of its largest reference gradient plus 4 times the reference's rounding noise); fp32 runs
//    also stay within 1e-3 without the allowance. Measured and printed: fp32 errors at rounding
//    (about 1e-6), bf16 at its storage roundings (median about 1e-2, the worst correct run at a
//    quarter of its bound over 600 runs).
//  - the canary leaves the job's state as it was, bit for bit: parameters (balancing biases
//    included), AdamW moments, step counts and data position after a Verify() mid-run, and a run
//    verifying every step against one that never verifies (same losses, same parameters).
//  - on one rank over StepBackend directly: a reference that does not fit in memory skips the
//    check with the reason; another failure of the reference is the canary's error.
//  - when it runs: the first step at an unverified layout, every N steps with an integer N, never
//    with "off"; a restart at the verified layout does not verify again, a resume at another
//    layout does; cp = 1 with ep = 1 is skipped with a reason.
#include <omp.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "tests/engine/parity_test_util.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/cpu_step_backend.h"
#include "worker/engine/data.h"
#include "worker/engine/parity_local.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

using testing::ParityJob;
using testing::ParityLayout;

constexpr CpMode AG = CpMode::kAllGather, A2A = CpMode::kAll2All, RING = CpMode::kRing,
                 HYB = CpMode::kHybrid;

absl::StatusOr<ParityResult> Verify(const JobSpec& spec, std::vector<nlohmann::json>* events) {
  LocalParityOptions o;
  o.threads = spec.parallel.world();  // one thread a rank
  o.on_event = [events](const nlohmann::json& e) { events->push_back(e); };
  return VerifyLayoutInProcess(spec, o);
}

class ParityPassTest : public ::testing::TestWithParam<ParityLayout> {};

TEST_P(ParityPassTest, CorrectLayoutPasses) {
  const ParityLayout l = GetParam();
  const JobSpec spec = ParityJob(l, testing::FreshSeed());
  std::vector<nlohmann::json> events;
  absl::StatusOr<ParityResult> r = Verify(spec, &events);
  ASSERT_TRUE(r.ok()) << r.status();
  const double bound = std::string(l.precision) == "fp32" ? 1e-3 : 1e-1;
  // An fp8 job's layout is checked at bf16 (ParityPrecision).
  const std::string checked_at = std::string(l.precision) == "fp8" ? "bf16" : l.precision;
  std::printf("max relative error %.3g (tolerance %.3g), max excess %.3g, %.3f s; worst:",
              r->max_rel_error, bound, r->max_excess, r->seconds);
  for (const ParityTensorError& e : r->worst)
    std::printf(" %s %.3g (noise %.3g, excess %.3g)", e.name.c_str(), e.rel_error, e.noise,
                e.excess);
  std::printf("\n");
  EXPECT_FALSE(r->skipped);
  EXPECT_TRUE(r->passed) << r->FailureMessage();
  EXPECT_EQ(r->tolerance, bound);
  EXPECT_LE(r->max_excess, 1.0);
  // Exact arithmetic: within the tolerance itself (the rounding allowance is negligible there).
  if (std::string(l.precision) == "fp32") EXPECT_LE(r->max_rel_error, bound);
  EXPECT_EQ(r->tokens, 128);
  EXPECT_GT(r->tensors, 10);
  EXPECT_EQ(r->reference, "cp=1 ep=1 on one rank");
  EXPECT_NEAR(r->loss, r->reference_loss, bound * r->reference_loss);
  ASSERT_EQ(r->worst.size(), 5u);
  for (size_t i = 1; i < r->worst.size(); ++i)
    EXPECT_GE(r->worst[i - 1].excess, r->worst[i].excess);
  // Rank 0's one event carries the same.
  ASSERT_EQ(events.size(), 1u);
  const nlohmann::json& e = events[0];
  EXPECT_EQ(e["event"], "parity");
  EXPECT_EQ(e["step"], 1);
  EXPECT_EQ(e["passed"], true);
  EXPECT_EQ(e["max_rel_error"].get<double>(), r->max_rel_error);
  EXPECT_EQ(e["max_excess"].get<double>(), r->max_excess);
  EXPECT_EQ(e["layout"], r->layout);
  EXPECT_EQ(e["worst"].size(), 5u);
  EXPECT_GT(e["comm_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(e["precision"], checked_at);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ParityPassTest,
    ::testing::Values(
        ParityLayout{"tiny", 2, 1, 0, AG, AG}, ParityLayout{"tiny", 2, 1, 0, AG, AG, 1, "bf16"},
        ParityLayout{"tiny", 2, 1, 0, A2A, A2A}, ParityLayout{"tiny", 2, 1, 0, A2A, A2A, 1, "bf16"},
        ParityLayout{"tiny", 2, 1, 0, AG, RING}, ParityLayout{"tiny", 2, 1, 0, AG, RING, 1, "bf16"},
        ParityLayout{"tiny", 2, 2, 0, A2A, AG}, ParityLayout{"tiny", 4, 1, 0, HYB, HYB, 2},
        ParityLayout{"tiny", 4, 1, 0, HYB, HYB, 2, "bf16"},
        ParityLayout{"tiny-moe", 1, 2, 2, AG, AG},
        ParityLayout{"tiny-moe", 1, 2, 2, AG, AG, 1, "bf16"},
        ParityLayout{"tiny-moe", 2, 1, 2, A2A, A2A},
        ParityLayout{"tiny-moe", 2, 1, 2, A2A, A2A, 1, "bf16"},
        ParityLayout{"tiny", 2, 1, 0, AG, RING, 1, "fp8"}),
    [](const ::testing::TestParamInfo<ParityLayout>& i) {
      auto w = [](CpMode m) {
        return m == A2A ? "A2A" : m == AG ? "AG" : m == RING ? "Ring" : "Hybrid";
      };
      const ParityLayout& l = i.param;
      return absl::StrCat(std::string(l.preset) == "tiny" ? "dense" : "moe", "_cp", l.cp, "_dp",
                          l.dp, l.ep > 0 ? absl::StrCat("_ep", l.ep) : "", "_L", w(l.lightning),
                          "_M", w(l.mla), "_", l.precision);
    });

TEST(ParityCanaryTest, Cp1Ep1IsSkippedWithAReason) {
  JobSpec spec = ParityJob({"tiny", 1, 2, 0, AG, AG}, 3);
  std::vector<nlohmann::json> events;
  absl::StatusOr<ParityResult> r = Verify(spec, &events);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].dump(),
            R"({"event":"parity","layout":"cp=1 dp=2 ep=1","reason":"cp = 1 and ep = 1: the )"
            R"(layout is the reference; nothing to verify","skipped":true,"step":1})");
}

// The canary on one rank, straight over the StepBackend interface: a layout that is the reference
// matches it exactly; a reference that runs out of memory skips the check with the reason; any
// other failure of the reference is the canary's error.
TEST(ParityCanaryTest, OneRankAndAReferenceThatDoesNotFit) {
  omp_set_num_threads(1);
  const JobSpec spec = ParityJob({"tiny", 1, 1, 0, AG, AG}, 7);
  auto job = CpuStepBackend::Create(spec.model, spec.train.seed, spec.train);
  ASSERT_TRUE(job.ok()) << job.status();
  ParityGang gang;
  gang.layout = "cp=1 dp=1 ep=1";
  auto data = OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed);
  ASSERT_TRUE(data.ok()) << data.status();
  const std::vector<int32_t> sequence = (*data)->Sequence(0);
  ReferenceBackendFactory cpu = [&]() -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    return CpuStepBackend::Create(spec.model, 99, spec.train);  // other initial values: replaced
  };
  absl::StatusOr<ParityResult> r =
      RunParityCanary(**job, gang, sequence, (*data)->eos_id(), cpu, ParityOptions{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
  EXPECT_EQ(r->max_rel_error, 0.0);
  EXPECT_EQ(r->tokens, 128);
  ReferenceBackendFactory full = []() -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    return absl::ResourceExhaustedError("out of device memory: 2.00 GiB more");
  };
  r = RunParityCanary(**job, gang, sequence, (*data)->eos_id(), full, ParityOptions{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(r->reason,
            "the cp=1 ep=1 reference does not fit beside the job on rank 0 (out of device memory: "
            "2.00 GiB more); the layout was not verified");
  ReferenceBackendFactory broken = []() -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    return absl::InternalError("no such device");
  };
  EXPECT_EQ(RunParityCanary(**job, gang, sequence, (*data)->eos_id(), broken, ParityOptions{})
                .status()
                .message(),
            "no such device");
}

TEST(ParityCanaryTest, SliceAndTolerances) {
  EXPECT_EQ(ParitySliceTokens(128, 2), 128);      // the job's chunk (32) is shorter
  EXPECT_EQ(ParitySliceTokens(262144, 8), 1024);  // 2 x 8 chunks of 64
  EXPECT_EQ(ParitySliceTokens(4096, 1), 128);
  EXPECT_EQ(ParityTolerance(TrainPrecision::kAuto, "cpu"), 1e-3);
  EXPECT_EQ(ParityTolerance(TrainPrecision::kFp32, "cpu"), 1e-3);
  EXPECT_EQ(ParityTolerance(TrainPrecision::kAuto, "cuda"), 1e-1);
  EXPECT_EQ(ParityTolerance(TrainPrecision::kBf16, "cpu"), 1e-1);
  EXPECT_EQ(ParityTolerance(TrainPrecision::kFp8, "cuda"), 1e-1);
}

TEST(ParityCanaryTest, WhenItRuns) {
  ParallelSpec p;
  p.cp = 2;
  const std::string key = "k", other = "other";
  p.verify = ParallelSpec::kVerifyFirst;
  EXPECT_TRUE(ParityDue(p, 1, "", key));     // a fresh start
  EXPECT_TRUE(ParityDue(p, 7, other, key));  // a resume at another layout
  EXPECT_FALSE(ParityDue(p, 7, key, key));   // a restart at the verified one
  p.verify = ParallelSpec::kVerifyOff;
  EXPECT_FALSE(ParityDue(p, 1, "", key));
  p.verify = 3;
  EXPECT_TRUE(ParityDue(p, 1, "", key));
  EXPECT_FALSE(ParityDue(p, 2, key, key));
  EXPECT_TRUE(ParityDue(p, 3, key, key));
  EXPECT_TRUE(ParityDue(p, 6, key, key));
  p.cp = 1;  // nothing to verify: once (the skipped event), never again
  EXPECT_TRUE(ParityDue(p, 1, "", key));
  EXPECT_FALSE(ParityDue(p, 3, key, key));
}

// Every rank's parameters, optimizer moments and counters.
struct Snapshot {
  std::vector<float> params, m, v;
  int64_t steps_taken = 0, step = 0, data_position = 0;
  bool operator==(const Snapshot& o) const {
    return params == o.params && m == o.m && v == o.v && steps_taken == o.steps_taken &&
           step == o.step && data_position == o.data_position;
  }
};

Snapshot Take(Trainer& t) {
  Snapshot s;
  Tensor& p = t.backend().host_params().flat_data();
  s.params.assign(p.f32(), p.f32() + p.numel());
  Tensor& m = t.optimizer().state0();
  Tensor& v = t.optimizer().state1();
  s.m.assign(m.f32(), m.f32() + m.numel());
  s.v.assign(v.f32(), v.f32() + v.numel());
  s.steps_taken = t.backend().steps_taken();
  s.step = t.state().step;
  s.data_position = t.state().data_position;
  return s;
}

// Runs `spec`'s world to `stop_at_step` (-1: its end); `after(rank, trainer)` runs then.
absl::Status RunWorld(const JobSpec& spec, std::vector<Snapshot>* end,
                      std::vector<std::vector<double>>* losses,
                      std::vector<std::vector<nlohmann::json>>* events, int64_t stop_at_step = -1,
                      const std::string& checkpoint_dir = "",
                      const std::function<absl::Status(int, Trainer&)>& after = nullptr) {
  const int world = static_cast<int>(spec.parallel.world());
  MemoryKvStore store;
  end->assign(world, {});
  losses->assign(world, {});
  events->assign(world, {});
  return testing::RunRanks(world, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = world;
    o.store = &store;
    o.gloo = testing::TestGloo();
    o.grad_bucket_floats = 20000;
    o.checkpoint_dir = checkpoint_dir;
    o.stop_at_step = stop_at_step;
    o.on_event = [&, rank](const nlohmann::json& e) { (*events)[rank].push_back(e); };
    auto t = Trainer::Create(std::move(o));
    if (!t.ok()) return t.status();
    if (absl::Status s = (*t)->Run(); !s.ok()) return s;
    (*end)[rank] = Take(**t);
    (*losses)[rank] = (*t)->losses();
    if (after) return after(rank, **t);
    return absl::OkStatus();
  });
}

int CountParity(const std::vector<nlohmann::json>& events) {
  int n = 0;
  for (const nlohmann::json& e : events) n += e["event"] == "parity";
  return n;
}

// MoE (balancing biases, expert shards), dp x cp, and fp8 (checked at bf16, then back to fp8).
const ParityLayout kStateLayouts[] = {ParityLayout{"tiny-moe", 2, 1, 2, A2A, A2A},
                                      ParityLayout{"tiny", 2, 2, 0, AG, RING},
                                      ParityLayout{"tiny", 2, 1, 0, AG, A2A, 1, "fp8"}};

// Mid-run (after two AdamW steps have moved the parameters, the moments and the balancing
// biases), a Verify() on every rank leaves each rank's state exactly as it found it.
TEST(ParityStateTest, VerifyLeavesTheStateBitForBit) {
  for (const ParityLayout& l : kStateLayouts) {
    SCOPED_TRACE(::testing::PrintToString(l));
    const JobSpec spec = ParityJob(l, testing::FreshSeed(), /*steps=*/3, "\"off\"");
    std::vector<Snapshot> end;
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<nlohmann::json>> events;
    absl::Status s = RunWorld(spec, &end, &losses, &events, /*stop_at_step=*/2, "",
                              [](int, Trainer& t) -> absl::Status {
                                const Snapshot before = Take(t);
                                if (before.step != 2 || before.m.empty())
                                  return absl::InternalError("not two AdamW steps in");
                                absl::StatusOr<ParityResult> r = t.Verify();
                                if (!r.ok()) return r.status();
                                if (!r->passed) return absl::InternalError(r->FailureMessage());
                                if (!(Take(t) == before))
                                  return absl::InternalError("the canary changed the state");
                                return absl::OkStatus();
                              });
    ASSERT_TRUE(s.ok()) << s;
    for (const auto& e : events) EXPECT_EQ(CountParity(e), 1);
  }
}

// A run that verifies before every step trains exactly as one that never verifies.
TEST(ParityStateTest, VerifyingEveryStepChangesNoBit) {
  for (const ParityLayout& l : kStateLayouts) {
    SCOPED_TRACE(::testing::PrintToString(l));
    const uint64_t seed = testing::FreshSeed();
    std::vector<Snapshot> off_end, on_end;
    std::vector<std::vector<double>> off_losses, on_losses;
    std::vector<std::vector<nlohmann::json>> off_events, on_events;
    ASSERT_TRUE(
        RunWorld(ParityJob(l, seed, 3, "\"off\""), &off_end, &off_losses, &off_events).ok());
    ASSERT_TRUE(RunWorld(ParityJob(l, seed, 3, "1"), &on_end, &on_losses, &on_events).ok());
    for (size_t r = 0; r < on_end.size(); ++r) {
      EXPECT_EQ(CountParity(off_events[r]), 0);
      EXPECT_EQ(CountParity(on_events[r]), 3);
      EXPECT_EQ(on_losses[r], off_losses[r]) << "rank " << r;
      EXPECT_TRUE(on_end[r] == off_end[r]) << "rank " << r;
      EXPECT_EQ(on_end[r].data_position, 3 * l.dp);
    }
  }
}

// "first": a restart at the layout its checkpoint verified does not verify again; a resume at
// another layout does.
TEST(ParityStateTest, FirstVerifiesEachLayoutOnce) {
  char tmpl[] = "/tmp/spindle-parity-XXXXXX";
  const std::string dir = std::string(mkdtemp(tmpl)) + "/ckpt";
  const uint64_t seed = testing::FreshSeed();
  std::vector<Snapshot> end;
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<nlohmann::json>> events;
  JobSpec spec = ParityJob({"tiny", 2, 1, 0, AG, AG}, seed, 4);
  spec.checkpoint.every = 1;
  ASSERT_TRUE(RunWorld(spec, &end, &losses, &events, 2, dir).ok());
  EXPECT_EQ(CountParity(events[0]), 1);
  absl::StatusOr<nlohmann::json> st = ReadCheckpointState(dir + "/step_00000002");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ((*st)["verified_layout"],
            "cp=2 dp=1 ep=1 lightning=allgather mla=allgather resources=cpu precision=fp32");
  // The same layout: no canary.
  ASSERT_TRUE(RunWorld(spec, &end, &losses, &events, 3, dir).ok());
  EXPECT_EQ(CountParity(events[0]), 0);
  EXPECT_EQ(end[0].step, 3);
  // Another layout: the canary again, before step 4.
  spec.parallel.lightning_mode = A2A;
  spec.parallel.mla_mode = A2A;
  ASSERT_TRUE(RunWorld(spec, &end, &losses, &events, -1, dir).ok());
  ASSERT_EQ(CountParity(events[0]), 1);
  for (const nlohmann::json& e : events[0])
    if (e["event"] == "parity") {
      EXPECT_EQ(e["step"], 4);
      EXPECT_EQ(e["passed"], true);
      EXPECT_EQ(e["layout"], "cp=2 dp=1 ep=1 lightning=all2all mla=all2all");
    }
}

}  // namespace
}  // namespace spindle
