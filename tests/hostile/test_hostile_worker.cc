// Attacks on the worker daemon (the spindle-worker binary against a fake coordinator on
// 127.0.0.1, with /bin/sh fake trainers): a coordinator that accepts every registration but
// breaks every session before acknowledging a heartbeat does not keep the worker's trainers
// running past the fence; a trainer that prints any bytes (invalid UTF-8, escape sequences,
// 50 KB notes) leaves the daemon and its session up, and what reaches the coordinator is
// bounded, valid UTF-8.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "common/text_bounds.h"
#include "gtest/gtest.h"
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

// The fake trainer's behaviour is the name of the job it is given: "hang" or "garbage".
constexpr char kTrainer[] =
    "mode=$(grep -ao '\"name\":\"[a-z0-9]*\"' \"$2\" | head -n 1 | cut -d '\"' -f 4)\n"
    "echo '{\"event\":\"start\",\"step\":0}'\n"
    "case $mode in\n"
    "  hang) exec sleep 1000 ;;\n"
    "  garbage)\n"
    "    printf '\\377\\376 not UTF-8\\n'\n"
    "    printf '{\"event\":\"note\",\"message\":\"bad \\377 byte\"}\\n'\n"
    "    printf '{\"event\":\"note\",\"message\":\"%s\"}\\n' \"$(head -c 50000 /dev/zero | tr "
    "'\\0' 'a')\"\n"
    "    printf '{\"event\":\"note\",\"message\":\"\\\\u001b[2J cleared\"}\\n'\n"
    "    printf 'half a character \\303\\n\\033[31mred\\033[0m \\377\\n' >&2\n"
    "    head -c 300000 /dev/zero | tr '\\0' '\\377' >&2\n"
    "    exit 3 ;;\n"
    "esac\n";

class HostileWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_WORKER_BINARY).empty()) GTEST_SKIP() << "spindle-worker not built";
    server_ = std::make_unique<LoopbackServer>(std::vector<grpc::Service*>{&coordinator_});
    ASSERT_TRUE(server_->ok());
    trainer_ = WriteScript(dir_, "trainer.sh", kTrainer);
  }
  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Kill().IgnoreError();
  }

  void StartDaemon(const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {SPINDLE_WORKER_BINARY,
                                     "--coordinator=" + server_->address(),
                                     "--worker_id=w1",
                                     "--slots=1",
                                     "--work_dir=" + dir_.File("work"),
                                     "--metrics_port=-1",
                                     "--advertise_host=127.0.0.1",
                                     "--kill_grace=1s",
                                     "--trainer_binary=" + trainer_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    SubprocessOptions options;
    options.stderr_path = dir_.File("worker.log");
    auto daemon = Subprocess::Spawn(argv, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ASSERT_TRUE(WaitFor([&] { return coordinator_.HasSession(); })) << Log();
  }
  std::string Log() { return ReadFile(dir_.File("worker.log")); }

  bool Assign(const std::string& job, const std::string& mode) {
    v1::CoordinatorMessage m;
    v1::Assignment* a = m.mutable_assignment();
    a->mutable_ref()->set_job_id(job);
    a->mutable_ref()->set_attempt(1);
    *a->mutable_job() = testing::PlannedJobFor(absl::StrCat(
        R"({"name":")", mode, R"(","model":{"preset":"tiny"},"seq_len":1024,"resources":"cpu","data":{"source":"synthetic:recall"}})"));
    a->set_rendezvous_address(server_->address());
    a->set_rendezvous_token("tok");
    return coordinator_.Send(m);
  }
  pid_t StartedPid(FakeCoordinator& c, const std::string& job) {
    for (auto& m : c.Of(v1::WorkerMessage::kRankStarted))
      if (m.rank_started().ref().job_id() == job) return static_cast<pid_t>(m.rank_started().pid());
    return 0;
  }

  ScratchDir dir_{"spindle-hostile-worker"};
  FakeCoordinator coordinator_;
  std::unique_ptr<LoopbackServer> server_;
  std::string trainer_;
  std::unique_ptr<Subprocess> daemon_;
};

TEST_F(HostileWorkerTest, SessionsDroppedBeforeAnyAckStillFenceOnTime) {
  // Registrations come back within 2 s (the daemon's longest backoff), more often than the 5 s
  // fence: only acknowledged heartbeats may hold the fence off.
  StartDaemon({"--coordinator_loss_timeout=5s"});
  ASSERT_TRUE(Assign("j-1", "hang"));
  ASSERT_TRUE(WaitFor([&] { return StartedPid(coordinator_, "j-1") > 0; })) << Log();
  const pid_t pid = StartedPid(coordinator_, "j-1");
  const int port = server_->port();
  server_->Shutdown();
  FakeCoordinator dropping;
  dropping.DropSessions(true);
  dropping.AckHeartbeats(false);
  LoopbackServer server2({&dropping}, port);
  ASSERT_TRUE(server2.ok());
  const auto cut = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] { return !ProcessAlive(pid); }, std::chrono::seconds(15))) << Log();
  const auto took = std::chrono::steady_clock::now() - cut;
  EXPECT_GE(took, std::chrono::milliseconds(4000));
  EXPECT_LT(took, std::chrono::milliseconds(9000));
  // It kept registering and opening sessions meanwhile.
  EXPECT_GE(dropping.Registers().size(), 2u);
  EXPECT_GE(dropping.sessions(), 2);
  EXPECT_NE(Log().find("no heartbeat acknowledged by the coordinator"), std::string::npos) << Log();
}

TEST_F(HostileWorkerTest, AnyBytesFromATrainerReachTheCoordinatorBoundedAndValid) {
  StartDaemon({});
  ASSERT_TRUE(Assign("j-2", "garbage"));
  ASSERT_TRUE(WaitFor([&] { return !coordinator_.Of(v1::WorkerMessage::kRankExit).empty(); }))
      << Log();
  const v1::RankExit e = coordinator_.Of(v1::WorkerMessage::kRankExit)[0].rank_exit();
  EXPECT_EQ(e.exit_code(), 3);
  ASSERT_GT(e.stderr_tail_size(), 0);
  for (const std::string& line : e.stderr_tail()) {
    EXPECT_TRUE(IsValidUtf8(line));
    EXPECT_LE(line.size(), kMaxNoteBytes);
  }
  // Notes: the one with an invalid byte is not an event at all (not JSON); the long one is cut.
  std::vector<std::string> notes;
  for (auto& m : coordinator_.Of(v1::WorkerMessage::kNote)) notes.push_back(m.note().text());
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes[0].size(), kMaxNoteBytes);
  EXPECT_EQ(notes[1], "\x1b[2J cleared");  // relayed as text; the CLI prints it without the ESC
  // The daemon is up and its session still works.
  ASSERT_TRUE(daemon_->Poll().ok());
  EXPECT_FALSE(daemon_->Poll()->has_value());
  EXPECT_EQ(coordinator_.sessions(), 1);
  const size_t beats = coordinator_.Of(v1::WorkerMessage::kHeartbeat).size();
  EXPECT_TRUE(
      WaitFor([&] { return coordinator_.Of(v1::WorkerMessage::kHeartbeat).size() > beats + 2; }));
}

}  // namespace
}  // namespace spindle
