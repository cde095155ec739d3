// The parity canary catches a broken layout. This executable is built with the Lightning AllGather
// losing rank 1's chunk states (SPINDLE_TEST_FAULT_DROP_LIGHTNING_STATE, tests/CMakeLists.txt):
// the canary of a cp = 2 job in Lightning AllGather mode fails, in fp32 and in the bf16
// emulation, naming Lightning tensors among the worst; a spindle-train-like run of the same job
// ends before its first step with FailedPrecondition (exit code 2) naming them; the layouts that
// do not use the broken path (Lightning All2All) still pass. Fresh random parameters and data
// (the seed is printed).
#include <omp.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "tests/engine/parity_test_util.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/parity_local.h"
#include "worker/engine/trainer.h"

#ifndef SPINDLE_TEST_FAULT_DROP_LIGHTNING_STATE
#error "parity_fault_test is built with the Lightning AllGather fault"
#endif

namespace spindle {
namespace {

using testing::ParityJob;
using testing::ParityLayout;

constexpr CpMode AG = CpMode::kAllGather, A2A = CpMode::kAll2All;

absl::StatusOr<ParityResult> Verify(const JobSpec& spec) {
  LocalParityOptions o;
  o.threads = spec.parallel.world();
  return VerifyLayoutInProcess(spec, o);
}

bool NamesLightning(const std::vector<ParityTensorError>& worst, double above) {
  for (const ParityTensorError& e : worst)
    if (e.name.find(".la.") != std::string::npos && e.excess > above) return true;
  return false;
}

TEST(ParityFaultTest, DroppedLightningStateFailsNamingLightningTensors) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    ParityLayout l{"tiny", 2, 1, 0, AG, AG};
    l.precision = precision;
    absl::StatusOr<ParityResult> r = Verify(ParityJob(l, testing::FreshSeed()));
    ASSERT_TRUE(r.ok()) << r.status();
    std::printf("%s: %s\n", precision, r->FailureMessage().c_str());
    EXPECT_FALSE(r->passed);
    EXPECT_GT(r->max_excess, 1.0);
    EXPECT_GT(r->max_rel_error, r->tolerance);
    EXPECT_TRUE(NamesLightning(r->worst, 1.0)) << r->FailureMessage();
    const nlohmann::json e = r->ToEvent(1);
    EXPECT_EQ(e["passed"], false);
    EXPECT_EQ(e["worst"].size(), 5u);
  }
}

TEST(ParityFaultTest, TheRunFailsBeforeItsFirstStep) {
  const JobSpec spec = ParityJob({"tiny", 2, 1, 0, AG, A2A}, testing::FreshSeed(), 3);
  MemoryKvStore store;
  std::vector<std::vector<nlohmann::json>> events(2);
  absl::Status s = testing::RunRanks(2, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = 2;
    o.store = &store;
    o.gloo = testing::TestGloo();
    o.on_event = [&, rank](const nlohmann::json& e) { events[rank].push_back(e); };
    auto t = Trainer::Create(std::move(o));
    if (!t.ok()) return t.status();
    return (*t)->Run();
  });
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("parity: the layout cp=2 dp=1 ep=1 lightning=allgather mla=all2all "
                             "does not compute what cp=1 ep=1 on one rank computes"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find(".la."), std::string::npos) << s;
  for (const auto& rank_events : events) {
    bool parity = false;
    for (const nlohmann::json& e : rank_events) {
      EXPECT_NE(e["event"], "step") << e.dump();
      if (e["event"] != "parity") continue;
      parity = true;
      EXPECT_EQ(e["passed"], false);
    }
    EXPECT_TRUE(parity);
  }
}

TEST(ParityFaultTest, LayoutsAroundTheFaultStillPass) {
  absl::StatusOr<ParityResult> r =
      Verify(ParityJob({"tiny", 2, 1, 0, A2A, AG}, testing::FreshSeed()));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed) << r->FailureMessage();
}

}  // namespace
}  // namespace spindle
