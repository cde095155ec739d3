// In-memory checkpoint replicas on the whole system: spindle-coordinator, two spindle-worker
// daemons (one CPU slot each, each with its own --replica_dir) and spindle-train on 127.0.0.1
// run a cp = 2 job whose only file checkpoint is its last (checkpoint.every 0) and which takes
// replicas every 4 steps. Rank 0's trainer is killed with SIGKILL mid-job: the restarted gang
// resumes from the newest replica (a step after the last file checkpoint, of which there is
// none), says so among the job's events, and ends with bitwise the final loss of an uninterrupted
// standalone run of the same job; the job's replicas are gone from both workers once it succeeded.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_harness.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ProcessesWithArgs;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;

constexpr int kSteps = 160;

std::string Spec(const std::string& ckpt) {
  return absl::StrCat(
      R"({"name":"replicas","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
      R"("seq_len":256,"parallel":{"cp":2,"lightning_mode":"allgather","mla_mode":"allgather"},)",
      R"("train":{"steps":)", kSteps, R"(},"checkpoint":{"dir":")", ckpt,
      R"(","every":0,"replicas":{"every":4}},"resources":"cpu","max_restarts":2})");
}

class ClusterReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle-train not built";
    }
    ASSERT_TRUE(cluster_.StartCoordinator(
        {"--heartbeat_interval=0.2", "--heartbeat_timeout=2", "--stop_grace=1"}))
        << cluster_.Logs();
    for (const char* id : {"w0", "w1"})
      ASSERT_TRUE(cluster_.StartWorker(id, 1, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  }

  // The worker's --replica_dir (the harness's).
  std::string Replicas(const std::string& worker) { return dir_.File("replicas-" + worker); }

  // The final loss of the job run uninterrupted: spindle-train standalone, one process per rank
  // through a file store, one thread each (as the workers run their ranks).
  double ReferenceLoss() {
    const std::string file = dir_.File("reference.json");
    std::ofstream(file) << Spec(dir_.File("reference-ckpt"));
    const std::string store = dir_.File("reference-store");
    std::filesystem::create_directories(store);
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = 1; r >= 0; --r) {
      SubprocessOptions o;
      o.stdout_path = dir_.File(absl::StrCat("reference-rank", r, ".out"));
      o.stderr_path = dir_.File(absl::StrCat("reference-rank", r, ".log"));
      auto p = Subprocess::Spawn({SPINDLE_TRAIN_BINARY, "--job", file, "--rank", absl::StrCat(r),
                                  "--world", "2", "--file-store", store, "--threads", "1"},
                                 o);
      if (!p.ok()) return -1;
      ranks.push_back(*std::move(p));
    }
    for (auto& p : ranks)
      if (!p->Wait().ok()) return -1;
    double loss = -1;
    for (absl::string_view line :
         absl::StrSplit(ReadFile(dir_.File("reference-rank0.out")), '\n')) {
      nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
      if (!e.is_discarded() && e.value("event", "") == "step") loss = e["loss"].get<double>();
    }
    return loss;
  }

  ScratchDir dir_{"spindle-replicas"};
  ClusterHarness cluster_{&dir_};
};

TEST_F(ClusterReplicasTest, AKilledRankResumesFromTheNewestReplicaWithTheUninterruptedLoss) {
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(dir_.File("ckpt")));
  ASSERT_TRUE(id.ok()) << id.status();
  auto mid = cluster_.WaitJob(
      *id, [](const v1::Job& j) { return j.step() >= 14; }, std::chrono::seconds(120));
  ASSERT_TRUE(mid.has_value());
  ASSERT_GE(mid->step(), 14) << ClusterHarness::Events(*mid) << cluster_.Logs();
  if (mid->state() == v1::JOB_STATE_SUCCEEDED) GTEST_SKIP() << "job finished before the kill";
  std::vector<pid_t> trainers = ProcessesWithArgs({"--job-id", *id, "--rank", "0"}, dir_.path());
  ASSERT_EQ(trainers.size(), 1u);
  ASSERT_EQ(::kill(trainers[0], SIGKILL), 0);
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(180));
  ASSERT_TRUE(job.has_value());
  const std::string events = ClusterHarness::Events(*job);
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << events << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_EQ(job->attempt(), 2);
  // A replica of a step of at least 8, with no file checkpoint before the last step: the kill came
  // after step 14, and a replica is complete at the latest when the next one starts (that of step
  // 12 may still have been in flight).
  std::smatch m;
  ASSERT_TRUE(std::regex_search(events, m,
                                std::regex("resumed from in-memory replicas at step ([0-9]+) "
                                           "\\(the copy on worker \"w[01]\", rank [01]'s; the "
                                           "newest checkpoint is step 0\\)")))
      << events;
  const int resumed = std::stoi(m[1]);
  EXPECT_GE(resumed, 8);
  EXPECT_EQ(resumed % 4, 0);
  // Token-exact: the final loss of the uninterrupted run, bitwise.
  EXPECT_EQ(job->loss(), ReferenceLoss()) << events;
  // The job succeeded: neither worker holds its replicas any more.
  for (const char* w : {"w0", "w1"})
    EXPECT_FALSE(std::filesystem::exists(Replicas(w) + "/" + *id)) << w;
}

}  // namespace
}  // namespace spindle
