// ProcessSupervisor with real child processes: stdout lines relayed in order, stderr tail kept,
// exit codes and signals reported, SIGTERM then SIGKILL to the whole process group on Stop, and a
// supervisor that survives any number of crashing children.
#include "worker/process_supervisor.h"

#include <signal.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ProcessAlive;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records every callback; thread-safe (callbacks come from the supervisor thread).
class RecordingObserver : public ProcessObserver {
 public:
  void OnStdoutLine(ProcessId id, std::string_view line) override {
    absl::MutexLock lock(&mu_);
    lines_[id].emplace_back(line);
  }
  void OnExit(ProcessId id, const ProcessExit& exit) override {
    absl::MutexLock lock(&mu_);
    EXPECT_FALSE(exits_.contains(id)) << "two exits for one process";
    exits_[id] = exit;
  }
  bool Exited(ProcessId id) {
    absl::MutexLock lock(&mu_);
    return exits_.contains(id);
  }
  size_t ExitCount() {
    absl::MutexLock lock(&mu_);
    return exits_.size();
  }
  ProcessExit Exit(ProcessId id) {
    absl::MutexLock lock(&mu_);
    return exits_.at(id);
  }
  std::vector<std::string> Lines(ProcessId id) {
    absl::MutexLock lock(&mu_);
    return lines_[id];
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<ProcessId, std::vector<std::string>> lines_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ProcessId, ProcessExit> exits_ ABSL_GUARDED_BY(mu_);
};

ProcessSpec Script(const std::string& path) {
  ProcessSpec spec;
  spec.argv = {path};
  return spec;
}

TEST(ProcessSupervisorTest, RelaysStdoutLinesInOrderAndReportsExitCode) {
  ScratchDir dir;
  const std::string script = WriteScript(dir, "t.sh",
                                         "echo '{\"event\":\"start\",\"step\":0}'\n"
                                         "printf 'plain text\\r\\n'\n"
                                         "echo '{\"event\":\"step\",\"step\":1}'\n"
                                         "printf 'no newline at end'\n"
                                         "exit 0\n");
  RecordingObserver observer;
  ProcessSupervisor supervisor({}, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->pid, 0);
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }));
  EXPECT_THAT(observer.Lines(p->id),
              ElementsAre("{\"event\":\"start\",\"step\":0}", "plain text",
                          "{\"event\":\"step\",\"step\":1}", "no newline at end"));
  const ProcessExit exit = observer.Exit(p->id);
  EXPECT_TRUE(exit.succeeded());
  EXPECT_EQ(exit.exit_code, 0);
  EXPECT_EQ(exit.term_signal, 0);
  EXPECT_FALSE(exit.stop_requested);
  EXPECT_EQ(supervisor.running(), 0u);
}

TEST(ProcessSupervisorTest, KeepsTheLastStderrLinesAndTheExitCode) {
  ScratchDir dir;
  const std::string script = WriteScript(dir, "t.sh",
                                         "i=1\n"
                                         "while [ $i -le 30 ]; do echo \"err line $i\" >&2; "
                                         "i=$((i+1)); done\n"
                                         "exit 3\n");
  RecordingObserver observer;
  ProcessSupervisorOptions options;
  options.stderr_tail_lines = 20;
  ProcessSupervisor supervisor(options, &observer);
  ProcessSpec spec = Script(script);
  spec.stderr_log_path = dir.File("stderr.log");
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(spec);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }));
  const ProcessExit exit = observer.Exit(p->id);
  EXPECT_EQ(exit.exit_code, 3);
  EXPECT_EQ(exit.Describe(), "exit code 3");
  ASSERT_EQ(exit.stderr_tail.size(), 20u);
  EXPECT_EQ(exit.stderr_tail.front(), "err line 11");
  EXPECT_EQ(exit.stderr_tail.back(), "err line 30");
  // The log file has every line.
  const std::string log = testing::ReadFile(dir.File("stderr.log"));
  EXPECT_THAT(log, HasSubstr("err line 1\n"));
  EXPECT_THAT(log, HasSubstr("err line 30\n"));
}

TEST(ProcessSupervisorTest, ReportsACrashBySignal) {
  ScratchDir dir;
  const std::string script =
      WriteScript(dir, "t.sh", "echo 'about to crash' >&2\nkill -SEGV $$\nsleep 5\n");
  RecordingObserver observer;
  ProcessSupervisor supervisor({}, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }));
  const ProcessExit exit = observer.Exit(p->id);
  EXPECT_EQ(exit.term_signal, SIGSEGV);
  EXPECT_EQ(exit.Describe(), "killed by signal 11 (SIGSEGV)");
  EXPECT_THAT(exit.stderr_tail, ElementsAre("about to crash"));
  EXPECT_FALSE(exit.stop_requested);
}

TEST(ProcessSupervisorTest, StopTerminatesAHungProcessWithSigterm) {
  ScratchDir dir;
  const std::string script = WriteScript(dir, "t.sh", "echo ready\nexec sleep 1000\n");
  RecordingObserver observer;
  ProcessSupervisor supervisor({}, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return !observer.Lines(p->id).empty(); }));
  EXPECT_TRUE(supervisor.IsRunning(p->id));
  ASSERT_TRUE(supervisor.Stop(p->id).ok());
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }, std::chrono::seconds(5)));
  const ProcessExit exit = observer.Exit(p->id);
  EXPECT_EQ(exit.term_signal, SIGTERM);
  EXPECT_TRUE(exit.stop_requested);
  EXPECT_FALSE(exit.killed_after_grace);
  EXPECT_FALSE(ProcessAlive(p->pid));
  EXPECT_EQ(supervisor.Stop(p->id).code(), absl::StatusCode::kNotFound);
}

TEST(ProcessSupervisorTest, ProcessIgnoringSigtermIsKilledAfterTheGracePeriod) {
  ScratchDir dir;
  const std::string script = WriteScript(dir, "t.sh",
                                         "trap '' TERM\n"
                                         "echo ready\n"
                                         "while :; do sleep 0.05; done\n");
  RecordingObserver observer;
  ProcessSupervisorOptions options;
  options.kill_grace = absl::Milliseconds(400);
  ProcessSupervisor supervisor(options, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return !observer.Lines(p->id).empty(); }));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(supervisor.Stop(p->id).ok());
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }, std::chrono::seconds(5)));
  const auto took = std::chrono::steady_clock::now() - start;
  const ProcessExit exit = observer.Exit(p->id);
  EXPECT_EQ(exit.term_signal, SIGKILL);
  EXPECT_TRUE(exit.killed_after_grace);
  EXPECT_TRUE(exit.stop_requested);
  EXPECT_GE(took, std::chrono::milliseconds(350));
  EXPECT_LT(took, std::chrono::seconds(3));
}

TEST(ProcessSupervisorTest, StopKillsTheWholeProcessGroup) {
  ScratchDir dir;
  // The grandchild ignores SIGTERM too; SIGKILL to the group after the grace period must get it.
  const std::string script = WriteScript(dir, "t.sh",
                                         "sh -c 'trap \"\" TERM; exec sleep 1000' &\n"
                                         "echo $!\n"
                                         "wait\n");
  RecordingObserver observer;
  ProcessSupervisorOptions options;
  options.kill_grace = absl::Milliseconds(300);
  ProcessSupervisor supervisor(options, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return !observer.Lines(p->id).empty(); }));
  int grandchild = 0;
  ASSERT_TRUE(absl::SimpleAtoi(observer.Lines(p->id)[0], &grandchild));
  ASSERT_TRUE(ProcessAlive(grandchild));
  ASSERT_TRUE(supervisor.Stop(p->id).ok());
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }, std::chrono::seconds(5)));
  EXPECT_TRUE(WaitFor([&] { return !ProcessAlive(grandchild); }, std::chrono::seconds(3)));
}

TEST(ProcessSupervisorTest, LaunchFailuresNameThePath) {
  ScratchDir dir;
  RecordingObserver observer;
  ProcessSupervisor supervisor({}, &observer);
  absl::StatusOr<LaunchedProcess> missing = supervisor.Launch(Script(dir.File("no-such-trainer")));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("cannot execute " + dir.File("no-such-trainer")));
  const std::string not_exec = dir.File("not-executable");
  { std::ofstream(not_exec) << "#!/bin/sh\n"; }
  absl::StatusOr<LaunchedProcess> denied = supervisor.Launch(Script(not_exec));
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  ProcessSpec bad_dir = Script("/bin/true");
  bad_dir.working_dir = dir.File("missing-dir");
  EXPECT_EQ(supervisor.Launch(bad_dir).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(supervisor.Launch(ProcessSpec{}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(observer.ExitCount(), 0u);
  EXPECT_EQ(supervisor.running(), 0u);
}

TEST(ProcessSupervisorTest, SurvivesManyCrashingChildrenAndKeepsWorking) {
  ScratchDir dir;
  const std::string crash = WriteScript(dir, "crash.sh", "echo boom >&2\nkill -ABRT $$\n");
  const std::string fail = WriteScript(dir, "fail.sh", "exit 1\n");
  const std::string ok = WriteScript(dir, "ok.sh", "echo \"$1 $SPINDLE_TEST_VAR\"\n");
  RecordingObserver observer;
  ProcessSupervisor supervisor({}, &observer);
  std::vector<ProcessId> ids;
  for (int i = 0; i < 12; ++i) {
    absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(i % 2 ? crash : fail));
    ASSERT_TRUE(p.ok()) << p.status();
    ids.push_back(p->id);
  }
  ASSERT_TRUE(WaitFor([&] { return observer.ExitCount() == ids.size(); }));
  for (size_t i = 0; i < ids.size(); ++i) {
    const ProcessExit e = observer.Exit(ids[i]);
    if (i % 2) {
      EXPECT_EQ(e.term_signal, SIGABRT);
      EXPECT_THAT(e.stderr_tail, ElementsAre("boom"));
    } else {
      EXPECT_EQ(e.exit_code, 1);
    }
  }
  ProcessSpec spec = Script(ok);
  spec.argv.push_back("arg1");
  spec.extra_env = {"SPINDLE_TEST_VAR=value1"};
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(spec);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }));
  EXPECT_THAT(observer.Lines(p->id), ElementsAre("arg1 value1"));
}

TEST(ProcessSupervisorTest, ShutdownStopsEveryChild) {
  ScratchDir dir;
  const std::string hang = WriteScript(dir, "hang.sh", "echo up\nexec sleep 1000\n");
  RecordingObserver observer;
  std::vector<pid_t> pids;
  {
    ProcessSupervisorOptions options;
    options.kill_grace = absl::Milliseconds(500);
    ProcessSupervisor supervisor(options, &observer);
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(hang));
      ASSERT_TRUE(p.ok()) << p.status();
      pids.push_back(p->pid);
    }
    supervisor.Shutdown();
    EXPECT_EQ(supervisor.running(), 0u);
    EXPECT_EQ(supervisor.Launch(Script(hang)).status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(observer.ExitCount(), 3u);
  for (pid_t pid : pids) EXPECT_FALSE(ProcessAlive(pid));
}

TEST(ProcessSupervisorTest, LongLinesAreCut) {
  ScratchDir dir;
  const std::string script =
      WriteScript(dir, "t.sh", "head -c 5000 /dev/zero | tr '\\0' 'x'\necho\necho short\n");
  RecordingObserver observer;
  ProcessSupervisorOptions options;
  options.max_line_bytes = 1000;
  ProcessSupervisor supervisor(options, &observer);
  absl::StatusOr<LaunchedProcess> p = supervisor.Launch(Script(script));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(WaitFor([&] { return observer.Exited(p->id); }));
  EXPECT_THAT(observer.Lines(p->id), ElementsAre(std::string(1000, 'x'), "short"));
}

}  // namespace
}  // namespace spindle
