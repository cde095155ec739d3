// The real control plane (spindle-coordinator + spindle-worker daemons, gRPC on 127.0.0.1, a
// SQLite file) with a scripted trainer that behaves like spindle-train: it resumes from the
// latest checkpoint in --checkpoint-dir, prints start/step/checkpoint/done lines and can be made
// to hang. Covers submit -> placement -> run -> success, cancel, kill -9 of a trainer and of a
// worker mid-job (restart from the checkpoint, same final step), kill -9 and restart of the
// coordinator mid-job (no job lost) and a hung rank restarted within seconds.
#include <httplib.h>
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ProcessesWithArgs;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;

constexpr int kSteps = 20;

// Environment (inherited from the worker): FAKE_STEP_S seconds per step; FAKE_HANG_FILE: while
// that file exists, rank 1 of attempt 1 hangs after step 8 (and the other ranks wait for it at
// the next step's barrier, as they would in a collective).
constexpr char kScriptedTrainer[] = R"(
job=""; rank=0; attempt=0
while [ $# -gt 0 ]; do
  case $1 in
    --planned-job) job=$2; shift ;;
    --rank) rank=$2; shift ;;
    --attempt) attempt=$2; shift ;;
  esac
  shift
done
# The planned spec's checkpoint.dir and dp x cp (its canonical JSON inside the PlannedJob).
ckpt=$(grep -ao '"checkpoint":{"dir":"[^"]*"' "$job" | head -n 1 | sed 's/.*"dir":"//; s/"$//')
cp=$(grep -ao '"cp":[0-9]*' "$job" | head -n 1 | cut -d : -f 2)
dp=$(grep -ao '"dp":[0-9]*' "$job" | head -n 1 | cut -d : -f 2)
world=$((cp * dp))
mkdir -p "$ckpt"
step=0
if [ -f "$ckpt/latest" ]; then step=$(cat "$ckpt/latest"); fi
echo "attempt $attempt rank $rank start $step" >> "$ckpt/starts.log"
echo "{\"event\":\"start\",\"step\":$step,\"total_steps\":20}"
# Every step ends with a barrier over the ranks of this attempt, like a gradient all-reduce.
barrier() {
  echo $1 > "$ckpt/a$attempt.r$rank"
  r=0
  while [ $r -lt $world ]; do
    s=$(cat "$ckpt/a$attempt.r$r" 2>/dev/null || echo -1)
    if [ "${s:--1}" -ge $1 ]; then r=$((r+1)); else sleep 0.01; fi
  done
}
while [ $step -lt 20 ]; do
  sleep ${FAKE_STEP_S:-0.05}
  step=$((step+1))
  if [ -n "$FAKE_HANG_FILE" ] && [ -f "$FAKE_HANG_FILE" ] && [ "$rank" = 1 ] && [ "$attempt" = 1 ] && [ $step -eq 9 ]; then
    echo "rank 1 hanging" >&2
    exec sleep 1000
  fi
  barrier $step
  echo "{\"event\":\"step\",\"step\":$step,\"total_steps\":20,\"loss\":$((100-step)).5,\"tokens_per_s\":1000,\"elapsed_s\":$step}"
  if [ $((step % 5)) -eq 0 ]; then
    if [ "$rank" = 0 ]; then echo $step > "$ckpt/latest.tmp"; mv "$ckpt/latest.tmp" "$ckpt/latest"; fi
    echo "{\"event\":\"checkpoint\",\"step\":$step,\"path\":\"$ckpt/step-$step\"}"
  fi
done
echo "{\"event\":\"done\",\"step\":$step}"
)";

std::string Spec(const std::string& ckpt_dir, int cp) {
  return absl::StrCat(
      R"({"name":"fake","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
      R"("seq_len":256,"parallel":{"cp":)", cp,
      R"(,"dp":1},"train":{"steps":20},"checkpoint":{"dir":")", ckpt_dir,
      R"(","every":5},"resources":"cpu","max_restarts":3})");
}

class ClusterControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator or spindle-worker not built";
    }
    trainer_ = WriteScript(dir_, "fake-train.sh", kScriptedTrainer);
  }

  void StartCluster(int workers, double step_s, std::vector<std::string> coordinator_flags = {}) {
    std::vector<std::string> flags = {"--heartbeat_interval=0.2", "--heartbeat_timeout=2",
                                      "--stop_grace=1", "--recovery_grace=10"};
    flags.insert(flags.end(), coordinator_flags.begin(), coordinator_flags.end());
    ASSERT_TRUE(cluster_.StartCoordinator(flags)) << cluster_.Logs();
    for (int i = 0; i < workers; ++i) {
      ASSERT_TRUE(cluster_.StartWorker(
          absl::StrCat("w", i), 1, trainer_,
          {{"FAKE_STEP_S", absl::StrCat(step_s)}, {"FAKE_HANG_FILE", dir_.File("hang")}}));
    }
    ASSERT_TRUE(cluster_.WaitForWorkers(workers)) << cluster_.Logs();
  }

  std::vector<std::string> Starts(const std::string& ckpt) {
    return absl::StrSplit(ReadFile(ckpt + "/starts.log"), '\n', absl::SkipEmpty());
  }

  ScratchDir dir_{"spindle-cluster"};
  ClusterHarness cluster_{&dir_};
  std::string trainer_;
};

TEST_F(ClusterControlPlaneTest, SubmitPlaceRunSucceed) {
  StartCluster(2, 0.02);
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(30));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_EQ(job->attempt(), 1);
  EXPECT_EQ(job->last_checkpoint_step(), 20);
  ASSERT_EQ(job->ranks_size(), 2);
  EXPECT_NE(job->ranks(0).worker_id(), job->ranks(1).worker_id());
  EXPECT_THAT(Starts(ckpt), ::testing::UnorderedElementsAre("attempt 1 rank 0 start 0",
                                                             "attempt 1 rank 1 start 0"));
}

TEST_F(ClusterControlPlaneTest, CancelStopsEveryRank) {
  StartCluster(2, 0.5);
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(dir_.File("ckpt"), 2));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(cluster_.WaitJob(*id, [](const v1::Job& j) { return j.step() >= 1; },
                               std::chrono::seconds(20)).has_value());
  ASSERT_EQ(ProcessesWithArgs({"--job-id", *id}, dir_.path()).size(), 2u);
  ASSERT_TRUE(cluster_.Cancel(*id));
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(10));
  ASSERT_TRUE(job.has_value());
  EXPECT_EQ(job->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return ProcessesWithArgs({"--job-id", *id}, dir_.path()).empty(); },
                      std::chrono::seconds(5)))
      << cluster_.Logs();
}

TEST_F(ClusterControlPlaneTest, KilledTrainerRestartsFromCheckpointAndFinishes) {
  StartCluster(2, 0.15);
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(cluster_.WaitJob(*id, [](const v1::Job& j) { return j.last_checkpoint_step() >= 5; },
                               std::chrono::seconds(30)).has_value()) << cluster_.Logs();
  std::vector<pid_t> rank1 = ProcessesWithArgs({"--job-id", *id, "--rank", "1"}, dir_.path());
  std::string seen;
  for (pid_t p : rank1) {
    absl::StrAppend(&seen, p, " ppid ", testing::ParentPid(p), ": ",
                    ReadFile(absl::StrCat("/proc/", p, "/cmdline")), "\n");
  }
  ASSERT_EQ(rank1.size(), 1u) << seen;
  ASSERT_EQ(::kill(rank1[0], SIGKILL), 0);
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_EQ(job->attempt(), 2);
  EXPECT_EQ(job->restarts(), 1);
  // Attempt 2 resumed from a checkpoint, not from scratch.
  int resumed = 0;
  for (const std::string& line : Starts(ckpt)) {
    if (absl::StartsWith(line, "attempt 2 ")) {
      EXPECT_THAT(line, ::testing::Not(::testing::EndsWith(" start 0"))) << line;
      ++resumed;
    }
  }
  EXPECT_EQ(resumed, 2);
}

TEST_F(ClusterControlPlaneTest, KilledWorkerIsReplacedAndTheJobFinishes) {
  StartCluster(3, 0.15);
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  auto running = cluster_.WaitJob(*id, [](const v1::Job& j) { return j.last_checkpoint_step() >= 5; },
                                  std::chrono::seconds(30));
  ASSERT_TRUE(running.has_value());
  const std::string victim = running->ranks(1).worker_id();
  const std::vector<pid_t> victim_trainers = ProcessesWithArgs({"--job-id", *id, "--rank", "1"}, dir_.path());
  cluster_.KillWorker(victim);
  // The killed daemon's trainer dies with it.
  EXPECT_TRUE(WaitFor([&] { return ProcessesWithArgs({"--job-id", *id, "--rank", "1", "--attempt", "1"}, dir_.path()).empty(); },
                      std::chrono::seconds(5)));
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_GE(job->attempt(), 2);
  for (const auto& r : job->ranks()) EXPECT_NE(r.worker_id(), victim);
  // The first attempt's end names the killed worker as its cause.
  bool named = false;
  for (const auto& e : job->events())
    named |= e.attempt() == 1 && absl::StartsWith(e.message(), "worker " + victim + " ");
  EXPECT_TRUE(named) << ClusterHarness::Events(*job);
}

// A worker stopped with SIGTERM (a node drained) tells the coordinator first: the gang restarts
// once, elsewhere, with the shutdown named as the cause, and the worker is listed as "left".
TEST_F(ClusterControlPlaneTest, StoppedWorkerLeavesAndItsGangRestartsOnceElsewhere) {
  const int metrics_port = ::spindle::testing::FreePort();
  cluster_.UseCoordinatorMetricsPort(metrics_port);
  StartCluster(3, 0.15);
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  auto running = cluster_.WaitJob(
      *id, [](const v1::Job& j) { return j.last_checkpoint_step() >= 5; },
      std::chrono::seconds(30));
  ASSERT_TRUE(running.has_value());
  const std::string victim = running->ranks(1).worker_id();
  cluster_.SignalWorker(victim, SIGTERM);
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED)
      << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->attempt(), 2) << ClusterHarness::Events(*job);
  EXPECT_EQ(job->restarts(), 1);
  for (const auto& r : job->ranks()) EXPECT_NE(r.worker_id(), victim);
  bool named = false;
  for (const auto& e : job->events())
    named |= absl::StartsWith(
        e.message(), absl::StrCat("worker ", victim, " is shutting down (received signal 15)"));
  EXPECT_TRUE(named) << ClusterHarness::Events(*job);
  EXPECT_TRUE(
      WaitFor([&] { return cluster_.WorkerState(victim) == "left"; }, std::chrono::seconds(10)))
      << cluster_.WorkerState(victim);
  // The restart is counted as a worker that left, not one that was lost (which alerts).
  httplib::Client client("127.0.0.1", metrics_port);
  httplib::Result res = client.Get("/metrics");
  ASSERT_TRUE(res && res->status == 200);
  EXPECT_THAT(res->body,
              ::testing::HasSubstr("spindle_restarts_total{reason=\"worker_left\"} 1\n"));
  EXPECT_THAT(res->body,
              ::testing::HasSubstr("spindle_restarts_total{reason=\"worker_lost\"} 0\n"));
}

TEST_F(ClusterControlPlaneTest, CoordinatorKilledAndRestartedLosesNoJob) {
  // Workers fence their ranks a heartbeat timeout after their last acknowledged heartbeat: the
  // restart below (half a second down, then the coordinator's start) stays well within 5 s.
  StartCluster(2, 0.15, {"--heartbeat_timeout=5"});
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(cluster_.WaitJob(*id, [](const v1::Job& j) { return j.step() >= 3; },
                               std::chrono::seconds(30)).has_value());
  // A user watching the job across the restart: `spindle watch` keeps going.
  SubprocessOptions watch_io;
  watch_io.stdout_path = dir_.File("watch.out");
  watch_io.stderr_path = dir_.File("watch.err");
  auto watch = Subprocess::Spawn({SPINDLE_CLI_BINARY, "watch", *id, "--coordinator",
                                  cluster_.address(), "--tls-ca", cluster_.client_ca_file()},
                                 watch_io);
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(ReadFile(dir_.File("watch.out")), "step"); },
                      std::chrono::seconds(10)));
  cluster_.KillCoordinator();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=5",
                                         "--stop_grace=1", "--recovery_grace=10"}))
      << cluster_.Logs();
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
  ASSERT_TRUE(job.has_value()) << cluster_.Logs();
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps) << ClusterHarness::Events(*job) << ReadFile(ckpt + "/starts.log");
  // The running gang was re-adopted, not restarted.
  EXPECT_EQ(job->attempt(), 1) << ClusterHarness::Events(*job);
  // The watch said it lost the coordinator and got it back, showed each event once and ended
  // with the job.
  absl::StatusOr<int> watch_code = (*watch)->Wait();
  ASSERT_TRUE(watch_code.ok()) << watch_code.status();
  const std::string out = ReadFile(dir_.File("watch.out")), err = ReadFile(dir_.File("watch.err"));
  EXPECT_EQ(*watch_code, 0) << out << err;
  EXPECT_THAT(err, ::testing::HasSubstr("spindle: watch: cannot reach the coordinator at " +
                                        cluster_.address() + "; retrying for up to 30 s\n"));
  EXPECT_THAT(err, ::testing::HasSubstr("spindle: watch: reconnected to " + cluster_.address()));
  const std::vector<std::string> lines = absl::StrSplit(out, '\n');
  for (const auto& e : job->events()) {
    // An event line is "HH:MM:SS <state>: <message>".
    int n = 0;
    for (const std::string& l : lines)
      n += l.size() > 9 && l[2] == ':' && l[5] == ':' && absl::EndsWith(l, ": " + e.message());
    EXPECT_EQ(n, 1) << e.message() << "\n" << out;
  }
  EXPECT_THAT(out, ::testing::EndsWith(absl::StrCat(*id, " succeeded: ", job->message(), "\n")));
}

TEST_F(ClusterControlPlaneTest, HungRankIsDetectedAndRestartedWithinSeconds) {
  { std::ofstream(dir_.File("hang")) << "1"; }
  StartCluster(2, 0.05, {"--hang_timeout=2"});
  const std::string ckpt = dir_.File("ckpt");
  absl::StatusOr<std::string> id = cluster_.Submit(Spec(ckpt, 2));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(cluster_.WaitJob(*id, [](const v1::Job& j) { return j.step() >= 8; },
                               std::chrono::seconds(30)).has_value());
  const auto hung_at = std::chrono::steady_clock::now();
  auto restarted = cluster_.WaitJob(*id, [](const v1::Job& j) { return j.attempt() >= 2; },
                                    std::chrono::seconds(20));
  ASSERT_TRUE(restarted.has_value());
  ASSERT_GE(restarted->attempt(), 2) << ClusterHarness::Events(*restarted) << cluster_.Logs();
  EXPECT_LT(std::chrono::steady_clock::now() - hung_at, std::chrono::seconds(8));
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), kSteps);
  EXPECT_THAT(ClusterHarness::Events(*job), ::testing::HasSubstr("made no progress"));
}

}  // namespace
}  // namespace spindle
