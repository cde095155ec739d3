// Child processes: Subprocess (posix_spawn, killed and reaped by its destructor) and RunCommand
// (run to completion with stdin fed from a string and stdout/stderr captured).
// Thread-safety: a Subprocess belongs to one thread at a time; RunCommand is safe to call from
// any thread. Neither touches process-wide signal dispositions.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace spindle {

struct SubprocessOptions {
  // Files for the child's standard streams. Empty: stdin from /dev/null, stdout and stderr
  // inherited. Output files are created or truncated.
  std::string stdin_path;
  std::string stdout_path;
  std::string stderr_path;
  // Variables set (or overridden) on top of this process's environment.
  std::vector<std::pair<std::string, std::string>> env;
};

struct CommandResult;

// Exit codes follow the shell: the status passed to exit(), or 128 + N when killed by signal N.
class Subprocess {
 public:
  // Starts argv[0] (looked up on PATH when it has no '/'). NotFound if the program does not
  // exist, InvalidArgument for an empty argv, Internal for other spawn failures.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           const SubprocessOptions& options = {});

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();  // SIGKILLs the child if it is still running, then reaps it.

  pid_t pid() const { return pid_; }

  // The exit code if the child has exited, std::nullopt if it is still running. Non-blocking.
  absl::StatusOr<std::optional<int>> Poll();
  // Blocks until the child exits; returns its exit code.
  absl::StatusOr<int> Wait();
  // Sends `signal` unless the child was already reaped.
  absl::Status Signal(int signal);
  // SIGKILL and reap; returns the exit code (128 + SIGKILL unless it had exited already).
  absl::StatusOr<int> Kill();

 private:
  friend absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>&,
                                                  const std::string&, absl::Duration);

  explicit Subprocess(pid_t pid) : pid_(pid) {}
  absl::StatusOr<std::optional<int>> Reap(bool block);

  const pid_t pid_;
  std::optional<int> exit_code_;  // set once reaped
};

struct CommandResult {
  int exit_code = 0;  // as Subprocess
  std::string stdout_text;
  std::string stderr_text;
};

// Runs argv to completion, writing `stdin_data` to its stdin and capturing stdout and stderr.
// DeadlineExceeded (after killing the child) if it runs longer than `timeout`.
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         const std::string& stdin_data,
                                         absl::Duration timeout = absl::Seconds(60));

}  // namespace spindle
