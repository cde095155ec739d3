// The whole system on GPUs: spindle-coordinator and two spindle-worker daemons on 127.0.0.1, each
// offering one GPU (GPU 0 and GPU 1 when there are two, so the ranks' collectives run on NCCL;
// both GPU 0 on a one-GPU machine, where the ranks share it through Gloo), and a cp = 2 job with
// "resources": "cuda" placed across them. The job trains to success with a falling loss; a rank
// killed with SIGKILL mid-job, and a rank stopped with SIGSTOP (a frozen rank: its peer waits in a
// collective), each make the coordinator restart the gang from the last checkpoint, and the job
// still ends at its final step. Skips without a GPU or without the cluster binaries.
#include <cuda_runtime.h>
#include <signal.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_harness.h"

namespace spindle {
namespace {

using ::spindle::testing::BinaryPath;
using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ProcessesWithArgs;
using ::spindle::testing::ScratchDir;

int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// The tiny model on synthetic recall as in examples/recall-tiny.json (its loss falls from ~5.6),
// 4096-token sequences, cp = 2 on the GPU.
std::string GpuCpSpec(const std::string& ckpt, int steps, int every) {
  return absl::StrCat(R"({"name":"gpu-cp","model":{"preset":"tiny"},)",
                      R"("data":{"source":"synthetic:recall","recall_pairs":8,"recall_gap":512},)",
                      R"("seq_len":4096,"parallel":{"cp":2,"dp":1},"train":{"steps":)", steps,
                      R"(,"lr":3e-3,"warmup_steps":10,"grad_clip":1.0,"seed":11},)",
                      R"("checkpoint":{"dir":")", ckpt, R"(","every":)", every,
                      R"(},"resources":"cuda","max_restarts":2})");
}

class GpuClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpus_ = GpuCount();
    if (gpus_ == 0) GTEST_SKIP() << "no GPU";
    train_ = BinaryPath("SPINDLE_TRAIN_BINARY", SPINDLE_TRAIN_BINARY);
    if (BinaryPath("SPINDLE_COORDINATOR_BINARY", SPINDLE_COORDINATOR_BINARY).empty() ||
        BinaryPath("SPINDLE_WORKER_BINARY", SPINDLE_WORKER_BINARY).empty() || train_.empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle-train not built";
    }
  }

  // The coordinator (with `extra` flags) and the two GPU workers.
  void StartCluster(const std::vector<std::string>& extra) {
    std::vector<std::string> flags = {"--heartbeat_interval=0.2", "--heartbeat_timeout=3",
                                      "--stop_grace=1"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ASSERT_TRUE(cluster_.StartCoordinator(flags)) << cluster_.Logs();
    for (int i = 0; i < 2; ++i) {
      const std::string gpu = absl::StrCat(gpus_ >= 2 ? i : 0);
      ASSERT_TRUE(cluster_.StartWorker(absl::StrCat("g", i), /*slots=*/0, train_,
                                       {{"CUDA_VISIBLE_DEVICES", gpu}}));
    }
    ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  }

  // Submits the job, waits for its first checkpoint, sends `signal` to the trainer of `rank` and
  // expects the job to end SUCCEEDED at its final step in a second attempt that resumed from a
  // checkpoint; returns the job's events.
  std::string RunAndDisturb(int rank, int signal) {
    constexpr int kSteps = 240;
    absl::StatusOr<std::string> id = cluster_.Submit(GpuCpSpec(dir_.File("ckpt"), kSteps, 20));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    auto mid = cluster_.WaitJob(
        *id,
        [](const v1::Job& j) { return j.last_checkpoint_step() >= 20 || ClusterHarness::Ended(j); },
        std::chrono::seconds(180));
    EXPECT_TRUE(mid.has_value() && mid->last_checkpoint_step() >= 20)
        << (mid ? ClusterHarness::Events(*mid) : "") << cluster_.Logs();
    if (!mid.has_value() || mid->last_checkpoint_step() < 20) return "";
    if (mid->state() == v1::JOB_STATE_SUCCEEDED) {
      ADD_FAILURE() << "the job finished before it could be disturbed";
      return "";
    }
    std::vector<pid_t> trainers =
        ProcessesWithArgs({"--job-id", *id, "--rank", absl::StrCat(rank)}, dir_.path());
    EXPECT_EQ(trainers.size(), 1u) << cluster_.Logs();
    if (trainers.size() != 1u) return "";
    EXPECT_EQ(::kill(trainers[0], signal), 0);
    auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(240));
    EXPECT_TRUE(job.has_value());
    if (!job.has_value()) return "";
    const std::string events = ClusterHarness::Events(*job);
    EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << events << cluster_.Logs();
    EXPECT_EQ(job->step(), kSteps) << events;
    EXPECT_EQ(job->attempt(), 2) << events;
    EXPECT_EQ(job->last_checkpoint_step(), kSteps) << events;
    EXPECT_LT(job->loss(), 3.0) << events;  // from ~5.6: the resumed run kept learning
    EXPECT_THAT(events, ::testing::HasSubstr("from checkpoint"));
    return events;
  }

  int gpus_ = 0;
  std::string train_;
  ScratchDir dir_{"spindle-gpu-cluster"};
  ClusterHarness cluster_{&dir_};
};

TEST_F(GpuClusterTest, CpJobOnTwoGpuWorkersTrainsToSuccess) {
  StartCluster({});
  absl::StatusOr<std::string> id = cluster_.Submit(GpuCpSpec(dir_.File("ckpt"), 120, 60));
  ASSERT_TRUE(id.ok()) << id.status();
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(240));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED)
      << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), 120);
  EXPECT_EQ(job->attempt(), 1);
  EXPECT_EQ(job->last_checkpoint_step(), 120);
  EXPECT_GT(job->loss(), 0.0);
  EXPECT_LT(job->loss(), 4.0) << ClusterHarness::Events(*job);  // from ~5.6
  // Each rank's device peak (weights, optimizer state, activations of the tiny model's 2048
  // tokens a rank): reported, and far below a GPU's size.
  ASSERT_EQ(job->ranks_size(), 2);
  for (const v1::RankStatus& r : job->ranks()) {
    EXPECT_GT(r.memory_bytes(), 1 << 20) << r.rank();
    EXPECT_LT(r.memory_bytes(), double(int64_t{8} << 30)) << r.rank();
  }
  std::cout << "[ gpu cluster ] " << gpus_ << " GPU(s); events:\n" << ClusterHarness::Events(*job);
}

TEST_F(GpuClusterTest, KilledGpuRankIsRestartedFromTheCheckpoint) {
  StartCluster({});
  std::cout << "[ gpu cluster ] events:\n" << RunAndDisturb(0, SIGKILL);
}

TEST_F(GpuClusterTest, StoppedGpuRankIsDetectedAsHungAndRestarted) {
  StartCluster({"--hang_timeout=15"});
  const std::string events = RunAndDisturb(1, SIGSTOP);
  // Its pulses stop: found at the silence timeout, before the hang timeout.
  EXPECT_THAT(events, ::testing::HasSubstr("stopped responding"));
  std::cout << "[ gpu cluster ] events:\n" << events;
}

}  // namespace
}  // namespace spindle
