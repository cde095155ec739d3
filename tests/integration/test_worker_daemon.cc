// The spindle-worker binary against a fake coordinator on 127.0.0.1, with /bin/sh fake trainers:
// registration and heartbeats, assignments run and relayed, stops, a coordinator restart that
// re-adopts the running ranks, coordinator loss that kills the trainers, SIGTERM shutdown, a
// daemon killed by SIGKILL taking its trainers with it, and the /metrics endpoint.
#include <signal.h>

#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "tests/integration/fake_coordinator.h"
#include "tests/integration/planned_job_util.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::FakeCoordinator;
using ::spindle::testing::LoopbackServer;
using ::spindle::testing::ProcessAlive;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The fake trainer's behaviour is the name of the job it is given: "exit3", "hang", "steps".
constexpr char kTrainer[] =
    "mode=$(grep -ao '\"name\":\"[a-z0-9]*\"' \"$2\" | head -n 1 | cut -d '\"' -f 4)\n"
    "echo \"{\\\"event\\\":\\\"start\\\",\\\"step\\\":0}\"\n"
    "echo \"{\\\"event\\\":\\\"step\\\",\\\"step\\\":5,\\\"total_steps\\\":10,\\\"loss\\\":3.5,"
    "\\\"tokens_per_s\\\":100}\"\n"
    "echo \"rank $4 running\" >&2\n"
    "case $mode in\n"
    "  exit3) echo 'fatal: bad things' >&2; exit 3 ;;\n"
    "  hang) exec sleep 1000 ;;\n"
    "esac\n";

class WorkerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_WORKER_BINARY).empty()) GTEST_SKIP() << "spindle-worker not built";
    server_ = std::make_unique<LoopbackServer>(std::vector<grpc::Service*>{&coordinator_});
    ASSERT_TRUE(server_->ok());
    trainer_ = WriteScript(dir_, "trainer.sh", kTrainer);
    token_file_ = dir_.File("token");
    { std::ofstream(token_file_) << "s3cret\n"; }
  }
  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Kill().IgnoreError();
  }

  void StartDaemon(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {SPINDLE_WORKER_BINARY,
                                     "--coordinator=" + server_->address(),
                                     "--worker_id=w1",
                                     "--slots=2",
                                     "--work_dir=" + dir_.File("work"),
                                     "--metrics_port=0",
                                     "--metrics_host=127.0.0.1",
                                     "--advertise_host=127.0.0.1",
                                     "--token_file=" + token_file_,
                                     "--kill_grace=2s",
                                     "--trainer_binary=" + trainer_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    SubprocessOptions options;
    options.stderr_path = dir_.File("worker.log");
    auto daemon = Subprocess::Spawn(argv, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ASSERT_TRUE(WaitFor([&] { return coordinator_.HasSession(); })) << WorkerLog();
  }

  std::string WorkerLog() { return ReadFile(dir_.File("worker.log")); }

  int MetricsPort() {
    std::smatch m;
    const std::string log = WorkerLog();
    static const std::regex re("metrics on 127.0.0.1:([0-9]+)/metrics");
    int port = 0;
    if (std::regex_search(log, m, re)) absl::SimpleAtoi(m[1].str(), &port);
    return port;
  }

  bool Assign(const std::string& job, int64_t attempt, int64_t rank, const std::string& mode) {
    v1::CoordinatorMessage m;
    v1::Assignment* a = m.mutable_assignment();
    a->mutable_ref()->set_job_id(job);
    a->mutable_ref()->set_attempt(attempt);
    a->mutable_ref()->set_rank(rank);
    *a->mutable_job() = testing::PlannedJobFor(absl::StrCat(
        R"({"name":")", mode,
        R"(","model":{"preset":"tiny"},"seq_len":1024,"resources":"cpu","data":{"source":"synthetic:recall"},"parallel":{"cp":2}})"));
    a->set_rendezvous_address(server_->address());
    a->set_rendezvous_token("tok");
    return coordinator_.Send(m);
  }

  std::vector<v1::RankExit> Exits() {
    std::vector<v1::RankExit> out;
    for (auto& m : coordinator_.Of(v1::WorkerMessage::kRankExit)) out.push_back(m.rank_exit());
    return out;
  }

  pid_t StartedPid(const std::string& job, int64_t rank) {
    for (auto& m : coordinator_.Of(v1::WorkerMessage::kRankStarted)) {
      if (m.rank_started().ref().job_id() == job && m.rank_started().ref().rank() == rank) {
        return static_cast<pid_t>(m.rank_started().pid());
      }
    }
    return 0;
  }

  ScratchDir dir_{"spindle-worker-test"};
  FakeCoordinator coordinator_;
  std::unique_ptr<LoopbackServer> server_;
  std::string trainer_;
  std::string token_file_;
  std::unique_ptr<Subprocess> daemon_;
};

TEST_F(WorkerDaemonTest, RegistersHeartbeatsRunsAssignmentsAndServesMetrics) {
  StartDaemon();
  ASSERT_EQ(coordinator_.Registers().size(), 1u);
  const v1::RegisterRequest reg = coordinator_.Registers()[0];
  EXPECT_EQ(reg.worker_id(), "w1");
  ASSERT_EQ(reg.devices_size(), 1);
  EXPECT_EQ(reg.devices(0).kind(), "cpu");
  EXPECT_EQ(reg.devices(0).count(), 2);
  EXPECT_GT(reg.devices(0).memory_bytes(), 0);
  EXPECT_THAT(reg.metrics_address(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_EQ(coordinator_.LastAuthorization(), "Bearer s3cret");
  auto hellos = coordinator_.Of(v1::WorkerMessage::kHello);
  ASSERT_EQ(hellos.size(), 1u);
  EXPECT_EQ(hellos[0].hello().worker_id(), "w1");
  EXPECT_EQ(hellos[0].hello().running_size(), 0);
  // Heartbeats every 100 ms, as the coordinator asked.
  ASSERT_TRUE(WaitFor([&] { return coordinator_.Of(v1::WorkerMessage::kHeartbeat).size() >= 5; },
                      std::chrono::seconds(3)));

  ASSERT_TRUE(Assign("j-1", 1, 0, "exit3"));
  ASSERT_TRUE(WaitFor([&] { return Exits().size() == 1; })) << WorkerLog();
  const v1::RankExit exit = Exits()[0];
  EXPECT_EQ(exit.ref().job_id(), "j-1");
  EXPECT_EQ(exit.exit_code(), 3);
  EXPECT_FALSE(exit.stopped());
  EXPECT_THAT(exit.stderr_tail(), ElementsAre("rank 0 running", "fatal: bad things"));
  auto progress = coordinator_.Of(v1::WorkerMessage::kRankProgress);
  ASSERT_EQ(progress.size(), 1u);
  EXPECT_EQ(progress[0].rank_progress().step(), 5);
  EXPECT_DOUBLE_EQ(progress[0].rank_progress().loss(), 3.5);
  EXPECT_GT(StartedPid("j-1", 0), 0);

  const int port = MetricsPort();
  ASSERT_GT(port, 0) << WorkerLog();
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res) << "no /metrics response";
  EXPECT_EQ(res->status, 200);
  EXPECT_THAT(res->body, HasSubstr("spindle_loss{job_id=\"j-1\",rank=\"0\"} 3.5\n"));
  EXPECT_THAT(res->body, HasSubstr("spindle_worker_slots 2\n"));
  EXPECT_THAT(res->body, HasSubstr("spindle_worker_coordinator_connected 1\n"));
  EXPECT_THAT(res->body, HasSubstr("spindle_worker_trainer_exits_total{reason=\"error\"} 1\n"));
  EXPECT_THAT(res->body, ::testing::ContainsRegex("spindle_worker_heartbeats_total [1-9]"));
  EXPECT_THAT(res->body, ::testing::ContainsRegex("spindle_worker_resident_memory_bytes [1-9]"));
  // One CPU slot's share of host memory (two slots): the device-memory alert's denominator.
  EXPECT_THAT(res->body, ::testing::ContainsRegex("spindle_worker_device_memory_bytes [1-9]"));
}

TEST_F(WorkerDaemonTest, StopFromTheCoordinatorKillsTheRank) {
  StartDaemon();
  ASSERT_TRUE(Assign("j-2", 1, 0, "hang"));
  ASSERT_TRUE(Assign("j-2", 1, 1, "hang"));
  ASSERT_TRUE(WaitFor([&] { return StartedPid("j-2", 1) > 0; }));
  const pid_t p0 = StartedPid("j-2", 0);
  const pid_t p1 = StartedPid("j-2", 1);
  // Heartbeats list both ranks.
  ASSERT_TRUE(WaitFor([&] {
    auto hb = coordinator_.Of(v1::WorkerMessage::kHeartbeat);
    return !hb.empty() && hb.back().heartbeat().running_size() == 2;
  }));
  v1::CoordinatorMessage stop;
  stop.mutable_stop()->set_job_id("j-2");
  stop.mutable_stop()->set_attempt(1);
  stop.mutable_stop()->set_reason("cancelled by user");
  stop.mutable_stop()->set_grace_period_ms(1000);
  ASSERT_TRUE(coordinator_.Send(stop));
  ASSERT_TRUE(WaitFor([&] { return Exits().size() == 2; }, std::chrono::seconds(5)));
  for (const v1::RankExit& e : Exits()) {
    EXPECT_TRUE(e.stopped());
    EXPECT_EQ(e.signal(), SIGTERM);
  }
  EXPECT_FALSE(ProcessAlive(p0));
  EXPECT_FALSE(ProcessAlive(p1));
}

TEST_F(WorkerDaemonTest, CoordinatorRestartReadoptsRunningRanks) {
  StartDaemon({"--coordinator_loss_timeout=30s"});
  ASSERT_TRUE(Assign("j-3", 2, 1, "hang"));
  ASSERT_TRUE(WaitFor([&] { return !coordinator_.Of(v1::WorkerMessage::kRankProgress).empty(); }));
  const pid_t pid = StartedPid("j-3", 1);
  const int port = server_->port();
  server_->Shutdown();
  coordinator_.Clear();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  // A new coordinator process on the same address.
  FakeCoordinator restarted;
  LoopbackServer server2({&restarted}, port);
  ASSERT_TRUE(server2.ok());
  ASSERT_TRUE(WaitFor([&] { return restarted.HasSession(); })) << WorkerLog();
  auto hellos = restarted.Of(v1::WorkerMessage::kHello);
  ASSERT_EQ(hellos.size(), 1u);
  ASSERT_EQ(hellos[0].hello().running_size(), 1);
  const v1::RunningRank r = hellos[0].hello().running(0);
  EXPECT_EQ(r.ref().job_id(), "j-3");
  EXPECT_EQ(r.ref().attempt(), 2);
  EXPECT_EQ(r.ref().rank(), 1);
  EXPECT_EQ(r.step(), 5) << WorkerLog();
  EXPECT_EQ(r.pid(), pid);
  EXPECT_TRUE(ProcessAlive(pid));
  EXPECT_TRUE(restarted.Of(v1::WorkerMessage::kRankExit).empty());
}

TEST_F(WorkerDaemonTest, CoordinatorLossKillsTrainersAndTheExitIsReportedLater) {
  StartDaemon({"--coordinator_loss_timeout=1s"});
  ASSERT_TRUE(Assign("j-4", 1, 0, "hang"));
  ASSERT_TRUE(WaitFor([&] { return StartedPid("j-4", 0) > 0; }));
  const pid_t pid = StartedPid("j-4", 0);
  const int port = server_->port();
  server_->Shutdown();
  const auto lost_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] { return !ProcessAlive(pid); }, std::chrono::seconds(8))) << WorkerLog();
  const auto took = std::chrono::steady_clock::now() - lost_at;
  EXPECT_GE(took, std::chrono::milliseconds(900));
  // The daemon logs the loss once StopAll has returned, which may be just after the trainer died.
  EXPECT_TRUE(WaitFor([&] {
    return WorkerLog().find("no heartbeat acknowledged by the coordinator") != std::string::npos;
  })) << WorkerLog();
  // The daemon itself is fine and reports the exit once a coordinator is back.
  ASSERT_TRUE(daemon_->Poll().ok());
  EXPECT_FALSE(daemon_->Poll()->has_value());
  FakeCoordinator restarted;
  LoopbackServer server2({&restarted}, port);
  ASSERT_TRUE(server2.ok());
  ASSERT_TRUE(WaitFor([&] { return !restarted.Of(v1::WorkerMessage::kRankExit).empty(); }))
      << WorkerLog();
  // The hello lists the rank whose exit is still in flight (pid 0), then the exit follows.
  const v1::SessionHello hello = restarted.Of(v1::WorkerMessage::kHello)[0].hello();
  ASSERT_EQ(hello.running_size(), 1);
  EXPECT_EQ(hello.running(0).ref().job_id(), "j-4");
  EXPECT_EQ(hello.running(0).pid(), 0);
  const v1::RankExit e = restarted.Of(v1::WorkerMessage::kRankExit)[0].rank_exit();
  EXPECT_EQ(e.ref().job_id(), "j-4");
  EXPECT_TRUE(e.stopped());
}

TEST_F(WorkerDaemonTest, SigtermStopsTrainersReportsThemAndExitsCleanly) {
  StartDaemon();
  ASSERT_TRUE(Assign("j-5", 1, 0, "hang"));
  ASSERT_TRUE(WaitFor([&] { return StartedPid("j-5", 0) > 0; }));
  const pid_t pid = StartedPid("j-5", 0);
  ASSERT_TRUE(daemon_->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = daemon_->Wait();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << WorkerLog();
  EXPECT_FALSE(ProcessAlive(pid));
  ASSERT_TRUE(WaitFor([&] { return Exits().size() == 1; }));
  EXPECT_TRUE(Exits()[0].stopped());
}

TEST_F(WorkerDaemonTest, KilledDaemonTakesItsTrainersWithIt) {
  StartDaemon();
  ASSERT_TRUE(Assign("j-6", 1, 0, "hang"));
  ASSERT_TRUE(WaitFor([&] { return StartedPid("j-6", 0) > 0; }));
  const pid_t pid = StartedPid("j-6", 0);
  ASSERT_TRUE(ProcessAlive(pid));
  ASSERT_TRUE(daemon_->Kill().ok());
  EXPECT_TRUE(WaitFor([&] { return !ProcessAlive(pid); }, std::chrono::seconds(5)));
}

// A worker refuses to start without its trainer (test_daemon_flags); one removed afterwards (an
// upgrade in progress) fails each rank's launch with exit code 127 and the daemon serves on.
TEST_F(WorkerDaemonTest, MissingTrainerBinaryIsReportedNotFatal) {
  const std::string removed = dir_.File("no-such-spindle-train");
  std::filesystem::copy_file(trainer_, removed);
  trainer_ = removed;
  StartDaemon();
  std::filesystem::remove(removed);
  ASSERT_TRUE(Assign("j-7", 1, 0, "exit3"));
  ASSERT_TRUE(WaitFor([&] { return Exits().size() == 1; })) << WorkerLog();
  EXPECT_EQ(Exits()[0].exit_code(), 127);
  EXPECT_THAT(Exits()[0].stderr_tail(0), HasSubstr("no-such-spindle-train"));
  // Still serving: the next heartbeat arrives.
  const size_t before = coordinator_.Of(v1::WorkerMessage::kHeartbeat).size();
  EXPECT_TRUE(
      WaitFor([&] { return coordinator_.Of(v1::WorkerMessage::kHeartbeat).size() > before; }));
}

}  // namespace
}  // namespace spindle
