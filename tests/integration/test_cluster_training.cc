// The whole system with the real trainer: spindle-coordinator, spindle-worker and spindle-train
// on 127.0.0.1 training the tiny preset on synthetic recall data: a job runs to success (its
// parity canary's skip, cp = 1, among its events), and a trainer killed with SIGKILL mid-job is
// restarted from its checkpoint and ends at the same final step.
#include <signal.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_harness.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ProcessesWithArgs;
using ::spindle::testing::ScratchDir;

std::string TinySpec(const std::string& ckpt, int steps, int every) {
  return absl::StrCat(
      R"({"name":"tiny","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
      R"("seq_len":256,"parallel":{"cp":1,"dp":1},"train":{"steps":)", steps,
      R"(},"checkpoint":{"dir":")", ckpt, R"(","every":)", every,
      R"(},"resources":"cpu","max_restarts":2})");
}

class ClusterTrainingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle-train not built";
    }
    ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2",
                                           "--stop_grace=1"}))
        << cluster_.Logs();
    ASSERT_TRUE(cluster_.StartWorker("w0", 1, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();
  }

  ScratchDir dir_{"spindle-training"};
  ClusterHarness cluster_{&dir_};
};

TEST_F(ClusterTrainingTest, TinyJobTrainsToSuccess) {
  absl::StatusOr<std::string> id = cluster_.Submit(TinySpec(dir_.File("ckpt"), 20, 10));
  ASSERT_TRUE(id.ok()) << id.status();
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(120));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), 20);
  EXPECT_EQ(job->total_steps(), 20);
  EXPECT_GT(job->loss(), 0.0);
  EXPECT_EQ(job->last_checkpoint_step(), 20);
  // The rank's peak memory (a CPU trainer's resident memory): more than its weights and AdamW
  // state alone (the tiny model: ~1 MiB), less than the machine.
  ASSERT_EQ(job->ranks_size(), 1);
  EXPECT_GT(job->ranks(0).memory_bytes(), 4 << 20);
  EXPECT_LT(job->ranks(0).memory_bytes(), double(int64_t{64} << 30));
  // parallel.verify "first" on a layout with nothing to verify (cp = 1, no EP): the canary says it
  // skipped and why, among the job's events, rather than nothing.
  int skipped = 0;
  for (const v1::JobEvent& e : job->events())
    skipped +=
        absl::StartsWith(e.message(), "rank 0: parity: skipped before step 1: cp=1 dp=1 ep=1") &&
        absl::StrContains(e.message(), "the layout is the reference; nothing to verify");
  EXPECT_EQ(skipped, 1) << ClusterHarness::Events(*job);
}

TEST_F(ClusterTrainingTest, KilledTrainerResumesFromCheckpointToTheSameFinalStep) {
  constexpr int kSteps = 400;
  absl::StatusOr<std::string> id = cluster_.Submit(TinySpec(dir_.File("ckpt"), kSteps, 25));
  ASSERT_TRUE(id.ok()) << id.status();
  auto mid = cluster_.WaitJob(*id, [](const v1::Job& j) { return j.last_checkpoint_step() >= 25; },
                              std::chrono::seconds(120));
  ASSERT_TRUE(mid.has_value());
  ASSERT_GE(mid->last_checkpoint_step(), 25) << ClusterHarness::Events(*mid) << cluster_.Logs();
  if (mid->state() == v1::JOB_STATE_SUCCEEDED) GTEST_SKIP() << "job finished before the kill";
  std::vector<pid_t> trainers = ProcessesWithArgs({"--job-id", *id, "--rank", "0"}, dir_.path());
  ASSERT_EQ(trainers.size(), 1u);
  ASSERT_EQ(::kill(trainers[0], SIGKILL), 0);
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(180));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_EQ(job->attempt(), 2);
  EXPECT_THAT(ClusterHarness::Events(*job), ::testing::HasSubstr("from checkpoint"));
}

}  // namespace
}  // namespace spindle
