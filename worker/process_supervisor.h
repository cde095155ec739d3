// ProcessSupervisor: runs child processes (one trainer per rank) without a shell, each in its own
// process group, and watches them from one supervisor thread: it reads their stdout line by line,
// keeps the last lines of their stderr, reaps them with waitpid, and stops them with SIGTERM to
// the whole group followed by SIGKILL after a grace period. A child that crashes, hangs or ignores
// SIGTERM never affects the daemon. Children get PR_SET_PDEATHSIG=SIGKILL tied to the supervisor
// thread, so a daemon that dies (even by SIGKILL) takes its trainers with it.
//
// Thread-safety: all public methods are thread-safe. Observer callbacks run on the supervisor
// thread, one at a time, with no supervisor lock held; they may call Stop()/StopAll() but must not
// call Launch() (it waits for the supervisor thread) nor block for long.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace spindle {

using ProcessId = uint64_t;  // supervisor-assigned, never reused within one supervisor

struct ProcessSpec {
  // argv[0] is the executable's path; it is executed as given (no PATH search, no shell).
  std::vector<std::string> argv;
  // Working directory of the child; empty keeps the daemon's.
  std::string working_dir;
  // "NAME=value" entries added to (or replacing in) the daemon's environment.
  std::vector<std::string> extra_env;
  // When set, every stderr byte is also appended to this file (created if needed).
  std::string stderr_log_path;
};

struct ProcessExit {
  pid_t pid = 0;
  int exit_code = -1;         // >= 0 when the process exited normally
  int term_signal = 0;        // > 0 when it was killed by a signal
  bool stop_requested = false;  // Stop()/StopAll() was called before it exited
  bool killed_after_grace = false;  // it outlived the grace period and got SIGKILL
  absl::Duration run_time;
  std::vector<std::string> stderr_tail;  // last lines of stderr, oldest first

  bool succeeded() const { return exit_code == 0 && term_signal == 0; }
  // "exit code 3", "killed by signal 9 (Killed)".
  std::string Describe() const;
};

class ProcessObserver {
 public:
  virtual ~ProcessObserver() = default;
  // One complete line of the child's stdout (newline removed).
  virtual void OnStdoutLine(ProcessId id, std::string_view line) = 0;
  // The child exited and was reaped; every stdout line was delivered before this call.
  virtual void OnExit(ProcessId id, const ProcessExit& exit) = 0;
};

struct ProcessSupervisorOptions {
  absl::Duration kill_grace = absl::Seconds(10);  // SIGTERM -> SIGKILL
  size_t stderr_tail_lines = 20;
  size_t max_line_bytes = 64 * 1024;
};

struct LaunchedProcess {
  ProcessId id = 0;
  pid_t pid = 0;
};

class ProcessSupervisor {
 public:
  // `observer` must outlive the supervisor.
  ProcessSupervisor(ProcessSupervisorOptions options, ProcessObserver* observer);
  // Stops every child (SIGTERM, SIGKILL after the grace period), waits for them, then returns.
  ~ProcessSupervisor();
  ProcessSupervisor(const ProcessSupervisor&) = delete;
  ProcessSupervisor& operator=(const ProcessSupervisor&) = delete;

  // Starts a child and returns once it has exec'd. `on_launched`, when given, runs on the
  // supervisor thread right after the exec and before any output or exit of the child is
  // delivered (so the caller can register the child before its callbacks arrive). Errors:
  // InvalidArgument (empty argv), NotFound / PermissionDenied / FailedPrecondition when the
  // executable cannot be run (the message names the path and the errno text), Unavailable after
  // Shutdown().
  absl::StatusOr<LaunchedProcess> Launch(
      const ProcessSpec& spec,
      std::function<void(const LaunchedProcess&)> on_launched = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // Asks child `id` to stop: SIGTERM to its process group now, SIGKILL after the grace period
  // (or after `grace` when given). Returns at once; OnExit reports the end. NotFound if `id` is
  // not running.
  absl::Status Stop(ProcessId id, std::optional<absl::Duration> grace = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stop() for every running child.
  void StopAll(std::optional<absl::Duration> grace = std::nullopt) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops every child, waits until all have been reaped and reported, and ends the thread.
  // Later Launch() calls fail. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // Children launched and not yet reported by OnExit.
  size_t running() const ABSL_LOCKS_EXCLUDED(mu_);
  bool IsRunning(ProcessId id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Child;
  struct Request;

  void Loop();
  void HandleRequests();
  void DoLaunch(Request& request);
  void DoStop(ProcessId id, absl::Duration grace);
  void ReadPipe(Child& child, bool is_stdout);
  bool TryReap(Child& child);
  void Wake();

  const ProcessSupervisorOptions options_;
  ProcessObserver* const observer_;
  int wake_fd_ = -1;  // eventfd that wakes the supervisor thread
  int null_fd_ = -1;  // /dev/null, the children's stdin

  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Request>> requests_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<ProcessId> live_ ABSL_GUARDED_BY(mu_);
  ProcessId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  // Confined to the supervisor thread.
  std::vector<std::unique_ptr<Child>> children_;

  std::thread thread_;
};

}  // namespace spindle
