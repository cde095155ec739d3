// RankRunner with fake trainers (/bin/sh scripts): the trainer command line and environment, the
// job spec file, progress and checkpoint lines relayed as coordinator messages, exits reported
// with their stderr tail, stops, launch failures, and the per-rank metrics taken from step lines;
// the GPU a "cuda" rank is given, through the daemon's own CUDA_VISIBLE_DEVICES; the real trainer's
// first pulse; parity lines become rank 0's job event (a RankNote) and every rank's
// spindle_parity_max_rel_error; the job's spec parsed once in the worker's assignment path and
// once in the trainer's (the PlannedJob file it reads).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/planned_job_util.h"
#include "tests/integration/worker_test_util.h"
#include "worker/parity_note.h"
#include "worker/path_roots.h"
#include "worker/rank_runner.h"
#include "worker/replica_dirs.h"
#include "worker/trainer_event.h"
#include "worker/trainer_job.h"
#include "worker/worker_metrics.h"

namespace spindle {
namespace {

using ::spindle::testing::PlannedJobFor;
using ::spindle::testing::ProcessAlive;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RecordingSink : public MessageSink {
 public:
  void Send(v1::WorkerMessage message) override {
    absl::MutexLock lock(&mu_);
    messages_.push_back(std::move(message));
  }
  std::vector<v1::WorkerMessage> Messages() {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  std::vector<v1::WorkerMessage> Of(v1::WorkerMessage::KindCase kind) {
    std::vector<v1::WorkerMessage> out;
    for (auto& m : Messages()) {
      if (m.kind_case() == kind) out.push_back(m);
    }
    return out;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::WorkerMessage> messages_ ABSL_GUARDED_BY(mu_);
};

v1::Assignment MakeAssignment(const std::string& job, int64_t attempt, int64_t rank,
                              int64_t world) {
  v1::Assignment a;
  a.mutable_ref()->set_job_id(job);
  a.mutable_ref()->set_attempt(attempt);
  a.mutable_ref()->set_rank(rank);
  *a.mutable_job() = PlannedJobFor(absl::StrCat(
      R"({"name":"t","model":{"preset":"tiny"},"seq_len":1024,"resources":"cpu","data":{"source":"synthetic:recall"},
          "parallel":{"cp":)",
      world,
      R"(,"lightning_mode":"allgather","mla_mode":"all2all"},"train":{"recompute":3},
          "checkpoint":{"dir":"/tmp/ckpt-dir"}})"));
  a.set_rendezvous_address("127.0.0.1:7071");
  a.set_rendezvous_token("secret-token");
  a.set_device_index(0);
  return a;
}

class RankRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = WorkerMetrics::Create(&registry_);
    ASSERT_TRUE(m.ok()) << m.status();
    metrics_ = *std::move(m);
  }
  RankRunnerOptions Options(const std::string& trainer) {
    RankRunnerOptions o;
    o.work_dir = dir_.File("work");
    o.trainer_binary = trainer;
    o.token_file = "/etc/spindle/token";
    o.gloo_host = "10.1.2.3";
    o.cpu_threads_per_rank = 1;
    o.supervisor.kill_grace = absl::Milliseconds(500);
    o.roots.checkpoint_root = "/tmp";  // MakeAssignment's /tmp/ckpt-dir
    o.roots.data_root = dir_.path();
    return o;
  }

  ScratchDir dir_;
  MetricsRegistry registry_;
  std::unique_ptr<WorkerMetrics> metrics_;
  RecordingSink sink_;
};

TEST_F(RankRunnerTest, RunsTheTrainerAndRelaysProgressCheckpointsAndExit) {
  // Records its argv and environment, then prints progress like spindle-train.
  const std::string trainer = WriteScript(
      dir_, "trainer.sh",
      "for a in \"$@\"; do echo \"$a\"; done > args.txt\n"
      "echo \"$SPINDLE_RENDEZVOUS_TOKEN $OMP_NUM_THREADS\" > env.txt\n"
      "echo '{\"event\":\"start\",\"step\":0,\"total_steps\":2,\"elapsed_s\":0.0}'\n"
      "echo 'some log text'\n"
      "echo '{\"event\":\"step\",\"step\":1,\"total_steps\":2,\"loss\":5.5,\"tokens_per_s\":1000,"
      "\"lr\":0.001,\"grad_norm\":1.5,\"elapsed_s\":1.0,\"mfu\":0.25,\"mem_allocated_bytes\":1000,"
      "\"mem_reserved_bytes\":2000,\"mem_peak_bytes\":1500,"
      "\"comm\":[{\"collective\":\"all_gather\",\"layer_type\":\"lightning\",\"seconds\":0.5,"
      "\"bytes\":4096}]}'\n"
      "echo '{\"event\":\"step\",\"step\":2,\"total_steps\":2,\"loss\":4.25,\"tokens_per_s\":1200,"
      "\"elapsed_s\":1.75,\"host_rss_bytes\":3000,\"host_pinned_bytes\":4096,\"comm\":[{"
      "\"collective\":\"all_gather\",\"layer_"
      "type\":\"lightning\","
      "\"seconds\":0.25,\"bytes\":4096},{\"collective\":\"all_to_all\",\"layer_type\":\"moe\","
      "\"seconds\":0.125,\"bytes\":2048}],\"moe\":{\"layers\":[1,3],"
      "\"load_max_over_mean\":[1.5,1.25],\"bias_min\":[-0.25,-0.5],\"bias_max\":[0.75,0.5],"
      "\"router_lse_sq\":[4,6]}}'\n"
      "echo '{\"event\":\"checkpoint\",\"step\":2,\"path\":\"/tmp/ckpt-dir/step-2\"}'\n"
      "echo '{\"event\":\"done\",\"step\":2,\"loss\":4.25}'\n"
      "echo 'finished fine' >&2\n");
  RankRunner runner(Options(trainer), metrics_.get(), &sink_);
  v1::Assignment assignment = MakeAssignment("j-1", 1, 1, 2);
  assignment.set_resume_step(40);  // the coordinator's record of the job's last checkpoint
  ASSERT_TRUE(runner.Start(assignment).ok());
  ASSERT_TRUE(WaitFor([&] { return !sink_.Of(v1::WorkerMessage::kRankExit).empty(); }));

  const std::vector<v1::WorkerMessage> all = sink_.Messages();
  ASSERT_GE(all.size(), 5u);
  EXPECT_TRUE(all.front().has_rank_started());
  EXPECT_EQ(all.front().rank_started().ref().job_id(), "j-1");
  EXPECT_EQ(all.front().rank_started().ref().rank(), 1);
  EXPECT_GT(all.front().rank_started().pid(), 0);
  EXPECT_TRUE(all.back().has_rank_exit());

  auto progress = sink_.Of(v1::WorkerMessage::kRankProgress);
  ASSERT_EQ(progress.size(), 2u);
  const v1::RankProgress& p1 = progress[0].rank_progress();
  EXPECT_EQ(p1.ref().attempt(), 1);
  EXPECT_EQ(p1.step(), 1);
  EXPECT_EQ(p1.total_steps(), 2);
  EXPECT_DOUBLE_EQ(p1.loss(), 5.5);
  EXPECT_DOUBLE_EQ(p1.tokens_per_s(), 1000);
  EXPECT_DOUBLE_EQ(p1.lr(), 0.001);
  EXPECT_DOUBLE_EQ(p1.grad_norm(), 1.5);
  EXPECT_DOUBLE_EQ(p1.elapsed_s(), 1.0);
  EXPECT_DOUBLE_EQ(p1.mfu(), 0.25);
  EXPECT_DOUBLE_EQ(p1.memory_bytes(), 1500);  // the device peak
  EXPECT_EQ(progress[1].rank_progress().step(), 2);
  EXPECT_DOUBLE_EQ(progress[1].rank_progress().memory_bytes(), 3000);  // else the host's
  EXPECT_FALSE(p1.has_moe());  // a dense step
  // A MoE step: the worst layer's load, the biases' range over the layers, the layers' mean
  // lse^2, and the token exchange of the step.
  const v1::MoeStatus& moe = progress[1].rank_progress().moe();
  EXPECT_DOUBLE_EQ(moe.load_max_over_mean(), 1.5);
  EXPECT_DOUBLE_EQ(moe.bias_min(), -0.5);
  EXPECT_DOUBLE_EQ(moe.bias_max(), 0.75);
  EXPECT_DOUBLE_EQ(moe.router_z_loss(), 5.0);
  EXPECT_DOUBLE_EQ(moe.dispatch_bytes(), 2048);
  EXPECT_DOUBLE_EQ(moe.dispatch_s(), 0.125);

  auto ckpt = sink_.Of(v1::WorkerMessage::kCheckpointDone);
  ASSERT_EQ(ckpt.size(), 1u);
  EXPECT_EQ(ckpt[0].checkpoint_done().step(), 2);
  EXPECT_EQ(ckpt[0].checkpoint_done().path(), "/tmp/ckpt-dir/step-2");

  const v1::RankExit exit = sink_.Of(v1::WorkerMessage::kRankExit)[0].rank_exit();
  EXPECT_EQ(exit.exit_code(), 0);
  EXPECT_EQ(exit.signal(), 0);
  EXPECT_FALSE(exit.stopped());
  EXPECT_THAT(exit.stderr_tail(), ElementsAre("finished fine"));

  // The command line and environment of the trainer, and the spec file it was given.
  const std::string attempt_dir = dir_.File("work/j-1/1");
  const std::vector<std::string> args =
      absl::StrSplit(ReadFile(attempt_dir + "/args.txt"), '\n', absl::SkipEmpty());
  EXPECT_THAT(args, ElementsAre("--planned-job", attempt_dir + "/planned_job.pb", "--rank", "1",
                                "--rendezvous", "127.0.0.1:7071", "--job-id", "j-1", "--attempt",
                                "1", "--resume-step", "40", "--token-file", "/etc/spindle/token",
                                "--gloo-host", "10.1.2.3", "--pulse-ms", "1000"));
  // The job as planned, byte for byte the assignment's: nothing is copied out of it into flags.
  const v1::Assignment sent = MakeAssignment("j-1", 1, 1, 2);
  EXPECT_EQ(ReadFile(attempt_dir + "/planned_job.pb"), sent.job().SerializeAsString());
  EXPECT_EQ(ReadFile(attempt_dir + "/env.txt"), "secret-token 1\n");
  EXPECT_EQ(ReadFile(attempt_dir + "/rank-1.stderr.log"), "finished fine\n");

  // Metrics from the step lines.
  const std::string text = registry_.Serialize();
  EXPECT_THAT(text, HasSubstr("spindle_loss{job_id=\"j-1\",rank=\"1\"} 4.25\n"));
  EXPECT_THAT(text, HasSubstr("spindle_tokens_per_second{job_id=\"j-1\",rank=\"1\"} 1200\n"));
  EXPECT_THAT(text, HasSubstr("spindle_mfu{job_id=\"j-1\",rank=\"1\"} 0.25\n"));
  EXPECT_THAT(text, HasSubstr("spindle_training_step{job_id=\"j-1\",rank=\"1\"} 2\n"));
  EXPECT_THAT(
      text,
      HasSubstr("spindle_device_memory_bytes{job_id=\"j-1\",rank=\"1\",kind=\"peak\"} 1500\n"));
  EXPECT_THAT(text, HasSubstr("spindle_host_pinned_bytes{job_id=\"j-1\",rank=\"1\"} 4096\n"));
  EXPECT_THAT(text, HasSubstr("spindle_comm_seconds_total{job_id=\"j-1\",rank=\"1\","
                              "collective=\"all_gather\",layer_type=\"lightning\"} 0.75\n"));
  EXPECT_THAT(text, HasSubstr("spindle_comm_bytes_total{job_id=\"j-1\",rank=\"1\","
                              "collective=\"all_gather\",layer_type=\"lightning\"} 8192\n"));
  EXPECT_THAT(text, HasSubstr("spindle_moe_expert_load_ratio{job_id=\"j-1\",rank=\"1\","
                              "layer=\"3\"} 1.25\n"));
  EXPECT_THAT(text, HasSubstr("spindle_moe_router_bias{job_id=\"j-1\",rank=\"1\",layer=\"1\","
                              "bound=\"min\"} -0.25\n"));
  EXPECT_THAT(text, HasSubstr("spindle_moe_router_z_loss{job_id=\"j-1\",rank=\"1\","
                              "layer=\"3\"} 6\n"));
  // Step times derived from elapsed_s: 1.0 and 0.75 seconds.
  EXPECT_THAT(text, HasSubstr("spindle_step_seconds_count{job_id=\"j-1\",rank=\"1\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("spindle_step_seconds_sum{job_id=\"j-1\",rank=\"1\"} 1.75\n"));
  EXPECT_THAT(text, HasSubstr("spindle_worker_trainer_exits_total{reason=\"success\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("spindle_worker_running_ranks 0\n"));
  EXPECT_THAT(text, HasSubstr("spindle_restarts_total{job_id=\"j-1\",rank=\"1\"} 0\n"));
  EXPECT_EQ(runner.running_count(), 0u);
}

// checkpoint.replicas: the trainer gets the job's directory in the daemon's replica directory and
// the worker's id; the daemon keeps the replicas of a bounded number of jobs (the oldest other
// jobs' go), keeps a job's through a failed attempt and drops them once a rank exits 0; the start
// line's resumed step travels with the progress reports.
TEST_F(RankRunnerTest, ReplicaJobsGetADirectoryThatGoesOnceTheJobSucceeds) {
  const std::string replicas = dir_.File("replicas");
  for (int i = 0; i < kMaxReplicaJobs + 1; ++i) {
    std::filesystem::create_directories(absl::StrCat(replicas, "/old-", i));
    std::filesystem::last_write_time(
        absl::StrCat(replicas, "/old-", i),
        std::filesystem::file_time_type::clock::now() - std::chrono::hours(10 - i));
  }
  // Records its argv, fills its replica directory, resumes from step 12, and exits with the code
  // in code.txt (1 when it is missing).
  const std::string trainer = WriteScript(
      dir_, "trainer.sh",
      "for a in \"$@\"; do echo \"$a\"; done > args.txt\n"
      "while [ \"$1\" != --replica-dir ]; do shift; done; mkdir -p \"$2/step_00000012\"\n"
      "echo '{\"event\":\"start\",\"resumed_from_step\":12,\"total_steps\":20}'\n"
      "echo '{\"event\":\"step\",\"step\":13,\"total_steps\":20,\"elapsed_s\":1.0}'\n"
      "exit $(cat " + dir_.File("code.txt") + " 2>/dev/null || echo 1)\n");
  RankRunnerOptions o = Options(trainer);
  o.replica_dir = replicas;
  o.worker_id = "w7";
  RankRunner runner(o, metrics_.get(), &sink_);
  auto assignment = [](int64_t attempt) {
    v1::Assignment a = MakeAssignment("j-r", attempt, 0, 1);
    *a.mutable_job() = PlannedJobFor(
        R"({"name":"t","model":{"preset":"tiny"},"seq_len":256,"resources":"cpu",
            "data":{"source":"synthetic:recall"},"train":{"steps":20},
            "checkpoint":{"dir":"/tmp/ckpt-dir","replicas":{"every":4}}})");
    return a;
  };
  ASSERT_TRUE(runner.Start(assignment(1)).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == 1; }));
  const std::vector<std::string> args =
      absl::StrSplit(ReadFile(dir_.File("work/j-r/1/args.txt")), '\n', absl::SkipEmpty());
  ASSERT_GE(args.size(), 4u);
  EXPECT_THAT(std::vector<std::string>(args.end() - 4, args.end()),
              ElementsAre("--replica-dir", replicas + "/j-r", "--replica-host", "w7"));
  auto progress = sink_.Of(v1::WorkerMessage::kRankProgress);
  ASSERT_EQ(progress.size(), 1u);
  EXPECT_EQ(progress[0].rank_progress().resumed_from_step(), 12);
  // The failed attempt's replicas stay (the next attempt resumes from them); of the other jobs'
  // only the newest kMaxReplicaJobs - 1 are kept.
  EXPECT_TRUE(std::filesystem::exists(replicas + "/j-r/step_00000012"));
  std::vector<std::string> kept;
  for (const auto& e : std::filesystem::directory_iterator(replicas))
    kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_THAT(kept, ElementsAre("j-r", "old-2", "old-3", "old-4"));
  // The job's next attempt succeeds: its replicas go.
  std::ofstream(dir_.File("code.txt")) << "0\n";
  ASSERT_TRUE(runner.Start(assignment(2)).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == 2; }));
  EXPECT_EQ(sink_.Of(v1::WorkerMessage::kRankExit)[1].rank_exit().exit_code(), 0);
  EXPECT_FALSE(std::filesystem::exists(replicas + "/j-r"));
  EXPECT_TRUE(std::filesystem::exists(replicas + "/old-4"));
}

// Each process parses the job's spec once: the worker when an assignment arrives (its PlannedJob,
// for the paths and the world), the trainer when it reads the PlannedJob file the worker wrote
// (spindle-train --planned-job: ReadPlannedJob, then the engine takes the parsed spec). A second
// parse anywhere on either path moves a count.
// CPU ranks whose threads are more than the cores wait passively (common/host_cores.h); others
// keep the OpenMP default; a policy the daemon itself was given is left as it is.
TEST_F(RankRunnerTest, OverSubscribedCpuRanksWaitPassively) {
  const std::string trainer =
      WriteScript(dir_, "trainer.sh", "echo \"[$OMP_WAIT_POLICY]\" > wait.txt\n");
  const char* own = std::getenv("OMP_WAIT_POLICY");
  for (bool passive : {false, true}) {
    RankRunnerOptions o = Options(trainer);
    o.cpu_passive_wait = passive;
    RankRunner runner(o, metrics_.get(), &sink_);
    const std::string job = passive ? "j-p" : "j-a";
    ASSERT_TRUE(runner.Start(MakeAssignment(job, 1, 0, 1)).ok());
    ASSERT_TRUE(WaitFor(
        [&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == (passive ? 2u : 1u); }));
    const std::string expected = own != nullptr ? own : (passive ? "passive" : "");
    EXPECT_EQ(ReadFile(dir_.File(absl::StrCat("work/", job, "/1/wait.txt"))),
              absl::StrCat("[", expected, "]\n"))
        << passive;
  }
}

TEST_F(RankRunnerTest, TheSpecIsParsedOnceInTheWorkerAndOnceInTheTrainer) {
  const std::string trainer =
      WriteScript(dir_, "trainer.sh", "echo '{\"event\":\"done\",\"step\":0,\"loss\":1.0}'\n");
  RankRunner runner(Options(trainer), metrics_.get(), &sink_);
  const v1::Assignment assignment = MakeAssignment("j-1", 1, 0, 2);
  const int64_t before = JobSpecParsesForTesting();
  ASSERT_TRUE(runner.Start(assignment).ok());
  ASSERT_TRUE(WaitFor([&] { return !sink_.Of(v1::WorkerMessage::kRankExit).empty(); }));
  EXPECT_EQ(JobSpecParsesForTesting() - before, 1);

  const int64_t trainer_before = JobSpecParsesForTesting();
  absl::StatusOr<PlannedJob> job = ReadPlannedJob(dir_.File("work") + "/j-1/1/planned_job.pb");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(JobSpecParsesForTesting() - trainer_before, 1);
  EXPECT_EQ(job->spec.ToJson().dump(), assignment.job().spec_json());
  // A standalone run parses its file once (LoadJobSpec) and plans the parsed spec.
  const int64_t standalone_before = JobSpecParsesForTesting();
  absl::StatusOr<PlannedJob> planned = PlanStandalone(job->spec);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(JobSpecParsesForTesting() - standalone_before, 0);
}

TEST_F(RankRunnerTest, StopKillsOnlyTheNamedAttemptAndReportsStopped) {
  const std::string trainer = WriteScript(dir_, "trainer.sh",
                                          "echo '{\"event\":\"step\",\"step\":7,\"loss\":1.0}'\n"
                                          "echo 'working' >&2\n"
                                          "exec sleep 1000\n");
  RankRunner runner(Options(trainer), metrics_.get(), &sink_);
  ASSERT_TRUE(runner.Start(MakeAssignment("j-a", 1, 0, 2)).ok());
  ASSERT_TRUE(runner.Start(MakeAssignment("j-a", 1, 1, 2)).ok());
  ASSERT_TRUE(runner.Start(MakeAssignment("j-b", 3, 0, 1)).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankProgress).size() == 3; }));
  std::vector<v1::RunningRank> running = runner.Running();
  ASSERT_EQ(running.size(), 3u);
  for (const auto& r : running) EXPECT_EQ(r.step(), 7);
  EXPECT_THAT(registry_.Serialize(), HasSubstr("spindle_worker_running_ranks 3\n"));
  EXPECT_THAT(registry_.Serialize(),
              HasSubstr("spindle_restarts_total{job_id=\"j-b\",rank=\"0\"} 1\n"));
  // The trainer's RSS, read from /proc while it runs.
  EXPECT_THAT(
      registry_.Serialize(),
      ::testing::ContainsRegex("spindle_host_rss_bytes\\{job_id=\"j-a\",rank=\"0\"\\} [1-9]"));

  // A repeated assignment of a running rank only confirms it.
  ASSERT_TRUE(runner.Start(MakeAssignment("j-a", 1, 0, 2)).ok());
  EXPECT_EQ(runner.running_count(), 3u);
  EXPECT_EQ(sink_.Of(v1::WorkerMessage::kRankStarted).size(), 4u);

  EXPECT_EQ(runner.Stop("j-a", 1, absl::Seconds(5)), 2);
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == 2; }));
  for (const auto& m : sink_.Of(v1::WorkerMessage::kRankExit)) {
    EXPECT_EQ(m.rank_exit().ref().job_id(), "j-a");
    EXPECT_TRUE(m.rank_exit().stopped());
    EXPECT_EQ(m.rank_exit().signal(), SIGTERM);
    EXPECT_EQ(m.rank_exit().exit_code(), -1);
    EXPECT_THAT(m.rank_exit().stderr_tail(), ElementsAre("working"));
  }
  ASSERT_EQ(runner.Running().size(), 1u);
  EXPECT_EQ(runner.Running()[0].ref().job_id(), "j-b");
  EXPECT_EQ(runner.Stop("j-a", 1, absl::Seconds(5)), 0);

  // A newer attempt of j-b replaces the old one right away.
  ASSERT_TRUE(runner.Start(MakeAssignment("j-b", 4, 0, 1)).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == 3; }));
  EXPECT_EQ(sink_.Of(v1::WorkerMessage::kRankExit)[2].rank_exit().ref().attempt(), 3);
  ASSERT_EQ(runner.Running().size(), 1u);
  EXPECT_EQ(runner.Running()[0].ref().attempt(), 4);
  EXPECT_EQ(runner.StopAll(absl::Seconds(1)), 1);
  ASSERT_TRUE(WaitFor([&] { return runner.running_count() == 0; }));
}

// The real trainer pulses as soon as it starts, not one pulse period later: a rank stopped within
// its first period (a fast job is several steps in by then) is reported pulsing, with a silence
// that grows, so that the coordinator finds it in seconds.
TEST_F(RankRunnerTest, ARealTrainerStoppedWithinItsFirstPulsePeriodIsPulsingAndSilent) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train not built";
  RankRunnerOptions o = Options(SPINDLE_TRAIN_BINARY);
  o.token_file = "";
  o.pulse_ms = 60000;  // a period the test never waits for
  RankRunner runner(o, metrics_.get(), &sink_);
  // Rank 1 of 2 waits for a rendezvous that nobody serves: alive, and printing nothing but pulses.
  v1::Assignment a = MakeAssignment("j-p", 1, 1, 2);
  *a.mutable_job() = PlannedJobFor(R"({"name": "p", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:recall"}, "seq_len": 256, "parallel": {"cp": 2},
      "train": {"steps": 10}, "resources": "cpu"})");
  a.set_rendezvous_address("127.0.0.1:1");
  ASSERT_TRUE(runner.Start(a).ok());
  auto running = [&](const std::function<bool(const v1::RunningRank&)>& pred) {
    const std::vector<v1::RunningRank> r = runner.Running();
    return r.size() == 1 && pred(r[0]);
  };
  ASSERT_TRUE(WaitFor([&] { return running([](const auto& r) { return r.pulsing(); }); },
                      std::chrono::seconds(20)))
      << "no pulse from the trainer";
  const pid_t pid = static_cast<pid_t>(runner.Running()[0].pid());
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  EXPECT_TRUE(WaitFor([&] { return running([](const auto& r) { return r.silent_ms() >= 1500; }); },
                      std::chrono::seconds(10)));
  ::kill(pid, SIGCONT);
  EXPECT_EQ(runner.StopAll(absl::Seconds(1)), 1);
  ASSERT_TRUE(WaitFor([&] { return runner.running_count() == 0; }));
}

TEST_F(RankRunnerTest, CrashIsReportedWithSignalAndStderrTail) {
  const std::string trainer = WriteScript(dir_, "trainer.sh",
                                          "echo '{\"event\":\"step\",\"step\":1}'\n"
                                          "echo 'CUDA error: an illegal memory access' >&2\n"
                                          "kill -SEGV $$\n");
  RankRunner runner(Options(trainer), metrics_.get(), &sink_);
  ASSERT_TRUE(runner.Start(MakeAssignment("j-c", 2, 0, 1)).ok());
  ASSERT_TRUE(WaitFor([&] { return !sink_.Of(v1::WorkerMessage::kRankExit).empty(); }));
  const v1::RankExit exit = sink_.Of(v1::WorkerMessage::kRankExit)[0].rank_exit();
  EXPECT_EQ(exit.signal(), SIGSEGV);
  EXPECT_EQ(exit.exit_code(), -1);
  EXPECT_FALSE(exit.stopped());
  EXPECT_THAT(exit.stderr_tail(), ElementsAre("CUDA error: an illegal memory access"));
  EXPECT_THAT(registry_.Serialize(),
              HasSubstr("spindle_worker_trainer_exits_total{reason=\"signal\"} 1\n"));
}

TEST_F(RankRunnerTest, LaunchFailureIsReportedAsExit127) {
  RankRunner runner(Options(dir_.File("missing-spindle-train")), metrics_.get(), &sink_);
  absl::Status s = runner.Start(MakeAssignment("j-d", 1, 0, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  auto exits = sink_.Of(v1::WorkerMessage::kRankExit);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].rank_exit().exit_code(), 127);
  ASSERT_EQ(exits[0].rank_exit().stderr_tail_size(), 1);
  EXPECT_THAT(exits[0].rank_exit().stderr_tail(0), HasSubstr("missing-spindle-train"));
  EXPECT_THAT(registry_.Serialize(),
              HasSubstr("spindle_worker_trainer_exits_total{reason=\"launch_failed\"} 1\n"));

  // Job ids are path components: anything else is refused before touching the disk.
  EXPECT_EQ(runner.Start(MakeAssignment("../etc", 1, 0, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runner.Start(MakeAssignment("j-e", 1, 3, 2)).code(),
            absl::StatusCode::kInvalidArgument);
}

// A daemon started with CUDA_VISIBLE_DEVICES=4,5 sees those GPUs as 0 and 1: its rank on GPU 1
// must get CUDA_VISIBLE_DEVICES=5, not 1 (another daemon's GPU).
TEST(TrainerVisibleDeviceTest, MapsThroughTheDaemonsOwnVisibleDevices) {
  EXPECT_EQ(TrainerVisibleDevice(1, nullptr), "1");
  EXPECT_EQ(TrainerVisibleDevice(1, ""), "1");
  EXPECT_EQ(TrainerVisibleDevice(0, "4,5"), "4");
  EXPECT_EQ(TrainerVisibleDevice(1, "4,5"), "5");
  EXPECT_EQ(TrainerVisibleDevice(1, "GPU-aaaa, GPU-bbbb"), "GPU-bbbb");
  EXPECT_EQ(TrainerVisibleDevice(2, "4,5"), "2");  // out of range: the index as is
}

TEST(TrainerEventTest, ParsesKnownFieldsAndRejectsBadTypes) {
  absl::StatusOr<TrainerEvent> e = ParseTrainerEvent(
      R"({"event":"step","step":3,"total_steps":10,"loss":2.5,"step_time_s":0.5,)"
      R"("comm":[{"collective":"all_reduce","seconds":0.1,"bytes":10}],"extra":"ignored"})");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->kind, TrainerEventKind::kStep);
  EXPECT_EQ(*e->step, 3);
  EXPECT_EQ(*e->total_steps, 10);
  EXPECT_DOUBLE_EQ(*e->loss, 2.5);
  EXPECT_DOUBLE_EQ(*e->step_time_s, 0.5);
  EXPECT_FALSE(e->mfu.has_value());
  ASSERT_EQ(e->comm.size(), 1u);
  EXPECT_EQ(e->comm[0].layer_type, "other");
  EXPECT_EQ(ParseTrainerEvent("plain text").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTrainerEvent(R"({"step":1})").status().message(),
            "trainer event: event: missing or not a string");
  EXPECT_EQ(ParseTrainerEvent(R"({"event":"step","loss":"high"})").status().message(),
            "trainer event: loss: not a number");
  EXPECT_EQ(ParseTrainerEvent(R"({"event":"eval"})")->kind, TrainerEventKind::kOther);
  // A line nesting 100,000 arrays is refused before it is parsed.
  EXPECT_EQ(ParseTrainerEvent("{\"a\":" + std::string(100000, '[')).status().message(),
            "trainer event: nesting deeper than 64 levels");
}

// The parity canary's lines: every rank's largest error becomes its gauge; rank 0's verdict
// becomes a note (a job event), a failing one naming the tensors above their bound; the trainer's
// exit code 2 is relayed as is.
TEST_F(RankRunnerTest, ParityLinesBecomeRankZerosJobEventAndEveryRanksGauge) {
  const std::string trainer = WriteScript(
      dir_, "trainer.sh",
      "echo '{\"event\":\"parity\",\"step\":1,\"passed\":false,\"max_rel_error\":2.5,"
      "\"max_excess\":25,\"tolerance\":0.001,\"layout\":\"cp=2 dp=1 ep=1 lightning=allgather "
      "mla=all2all\",\"reference\":\"cp=1 ep=1 on one rank\",\"tokens\":128,\"worst\":["
      "{\"tensor\":\"layers.0.la.qkv.weight\",\"rel_error\":2.5,\"noise\":0.01,\"excess\":25},"
      "{\"tensor\":\"layers.1.la.out.weight\",\"rel_error\":0.4,\"noise\":0.01,\"excess\":4},"
      "{\"tensor\":\"layers.3.mla.q.weight\",\"rel_error\":1e-4,\"noise\":0.01,\"excess\":0.1}]}'\n"
      "echo 'spindle-train: parity: the layout does not compute what cp=1 computes' >&2\n"
      "exit 2\n");
  RankRunner runner(Options(trainer), metrics_.get(), &sink_);
  for (int rank : {0, 1}) ASSERT_TRUE(runner.Start(MakeAssignment("j-p", 1, rank, 2)).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_.Of(v1::WorkerMessage::kRankExit).size() == 2; }));
  auto notes = sink_.Of(v1::WorkerMessage::kNote);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].note().ref().rank(), 0);
  EXPECT_EQ(notes[0].note().text(),
            "parity: FAILED before step 1: cp=2 dp=1 ep=1 lightning=allgather mla=all2all does "
            "not compute what cp=1 ep=1 on one rank computes (max relative gradient error 2.5, "
            "25 times its bound); worst tensors: layers.0.la.qkv.weight 2.5, "
            "layers.1.la.out.weight 0.4");
  for (const v1::WorkerMessage& m : sink_.Of(v1::WorkerMessage::kRankExit))
    EXPECT_EQ(m.rank_exit().exit_code(), 2);
  const std::string text = registry_.Serialize();
  EXPECT_THAT(text, HasSubstr("spindle_parity_max_rel_error{job_id=\"j-p\",rank=\"0\"} 2.5\n"));
  EXPECT_THAT(text, HasSubstr("spindle_parity_max_rel_error{job_id=\"j-p\",rank=\"1\"} 2.5\n"));
}

TEST(TrainerEventTest, ParsesParityLines) {
  absl::StatusOr<TrainerEvent> e = ParseTrainerEvent(
      R"({"event":"parity","step":4,"passed":true,"max_rel_error":3e-7,"max_excess":2e-4,)"
      R"("tolerance":0.001,"layout":"cp=2 dp=1 ep=1 lightning=all2all mla=all2all",)"
      R"("reference":"cp=1 ep=1 on one rank","worst":[{"tensor":"final_norm.weight",)"
      R"("rel_error":3e-7,"noise":1e-4,"excess":2e-4}]})");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->kind, TrainerEventKind::kParity);
  EXPECT_TRUE(*e->passed);
  EXPECT_FALSE(e->skipped);
  EXPECT_DOUBLE_EQ(*e->max_rel_error, 3e-7);
  ASSERT_EQ(e->worst.size(), 1u);
  EXPECT_EQ(e->worst[0].tensor, "final_norm.weight");
  EXPECT_EQ(*ParityNoteText(*e, 0),
            "parity: passed before step 4: cp=2 dp=1 ep=1 lightning=all2all mla=all2all computes "
            "what cp=1 ep=1 on one rank computes (max relative gradient error 3e-07, 0.0002 of its "
            "bound)");
  EXPECT_FALSE(ParityNoteText(*e, 1).has_value());
  absl::StatusOr<TrainerEvent> skipped = ParseTrainerEvent(
      R"({"event":"parity","step":1,"skipped":true,"layout":"cp=1 dp=2 ep=1",)"
      R"("reason":"cp = 1 and ep = 1: the layout is the reference; nothing to verify"})");
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(*ParityNoteText(*skipped, 0),
            "parity: skipped before step 1: cp=1 dp=2 ep=1: cp = 1 and ep = 1: the layout is the "
            "reference; nothing to verify");
  EXPECT_EQ(ParseTrainerEvent(R"({"event":"parity","passed":"yes"})").status().message(),
            "trainer event: passed: not a boolean");
  EXPECT_EQ(ParseTrainerEvent(R"({"event":"parity","worst":[{"tensor":1}]})").status().message(),
            "trainer event: worst[0]: bad field type");
}

// A checkpoint directory or data file outside the worker's roots ends the rank with exit code 2
// naming the path and the root, before anything is written or started.
TEST_F(RankRunnerTest, PathOutsideTheRootsIsExit2BeforeTheTrainerStarts) {
  const std::string trainer = WriteScript(dir_, "trainer.sh", "touch started\n");
  RankRunnerOptions o = Options(trainer);
  o.roots.checkpoint_root = dir_.File("ck");
  RankRunner runner(o, metrics_.get(), &sink_);
  v1::Assignment a = MakeAssignment("j-p", 1, 0, 1);  // checkpoint_dir /tmp/ckpt-dir
  absl::Status s = runner.Start(a);
  const std::string message =
      "checkpoint.dir /tmp/ckpt-dir is outside the worker's "
      "--checkpoint_root " +
      dir_.File("ck");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), message);
  auto exits = sink_.Of(v1::WorkerMessage::kRankExit);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].rank_exit().exit_code(), 2);
  ASSERT_EQ(exits[0].rank_exit().stderr_tail_size(), 1);
  EXPECT_EQ(exits[0].rank_exit().stderr_tail(0), "worker: cannot start trainer: " + message);
  EXPECT_TRUE(sink_.Of(v1::WorkerMessage::kRankStarted).empty());
  EXPECT_FALSE(std::filesystem::exists(dir_.File("work/j-p")));

  *a.mutable_job() = testing::PlannedJobFor(absl::StrCat(
      R"({"name":"t","model":{"preset":"tiny"},"data":{"source":"text:/etc/passwd"},)",
      R"("seq_len":64,"checkpoint":{"dir":")", dir_.File("ck/run"), R"("}})"));
  s = runner.Start(a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "data.source file /etc/passwd is outside the worker's --data_root " + dir_.path());
  EXPECT_FALSE(std::filesystem::exists(dir_.File("work/j-p")));
}

TEST(PathRootsTest, DotDotRelativeAndSymbolicLinksOut) {
  ScratchDir dir;
  const std::string root = dir.File("root");
  std::filesystem::create_directories(root + "/sub");
  std::filesystem::create_directories(dir.File("outside"));
  std::filesystem::create_directory_symlink(dir.File("outside"), root + "/out");
  std::filesystem::create_directory_symlink(root + "/sub", root + "/in");
  std::filesystem::create_symlink(dir.File("nowhere/x"), root + "/dangling");
  auto check = [&](const std::string& path) {
    return CheckPathUnderRoot("checkpoint.dir", path, "--checkpoint_root", root);
  };
  const std::string where = " the worker's --checkpoint_root " + root;
  EXPECT_TRUE(check(root).ok());
  EXPECT_TRUE(check(root + "/new/deeper").ok());
  EXPECT_TRUE(check(root + "/in/ck").ok());  // a link that stays inside
  EXPECT_EQ(check(dir.File("root2/ck")).message(),
            "checkpoint.dir " + dir.File("root2/ck") + " is outside" + where);
  EXPECT_EQ(check(root + "/sub/../../outside").message(),
            "checkpoint.dir " + root + "/sub/../../outside" +
                " has a \"..\" component; it must lie under" + where);
  EXPECT_EQ(check("ck").message(), "checkpoint.dir ck is not an absolute path under" + where);
  EXPECT_EQ(check(root + "/out/ck").message(),
            "checkpoint.dir " + root + "/out/ck resolves to " +
                std::filesystem::canonical(dir.File("outside")).string() + "/ck, outside" + where);
  EXPECT_EQ(check(root + "/dangling/ck").message(),
            "checkpoint.dir " + root +
                "/dangling/ck leads through a dangling symbolic link; it must lie under" + where);
  EXPECT_EQ(check(root + "/out/ck").code(), absl::StatusCode::kInvalidArgument);

  PathRoots roots{root, root};
  JobSpec spec;
  spec.data.source = "synthetic:recall";
  EXPECT_TRUE(CheckJobPaths(spec, roots).ok());
  spec.data.source = "tokens:/etc/shadow";
  EXPECT_EQ(CheckJobPaths(spec, roots).message(),
            "data.source file /etc/shadow is outside the worker's --data_root " + root);
  spec.data.source = "synthetic:recall";
  spec.checkpoint.dir = root + "/../ck";
  EXPECT_EQ(CheckJobPaths(spec, roots).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRootFlag("--data-root", "rel").message(),
            "--data-root must be an absolute directory without \"..\" components, got \"rel\"");
}

}  // namespace
}  // namespace spindle
