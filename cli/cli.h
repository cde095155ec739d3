// The `spindle` command: argument parsing, the RPCs and the human/JSON output. RunCli is the
// whole program (main.cc only forwards to it) so tests drive it with string streams.
//
// Exit codes (also printed by `spindle --help`):
//   0  success
//   1  the job failed or was cancelled (watch, submit --wait)
//   2  usage error or bad input: unknown command/flag, unreadable or invalid job spec, a plan
//      with problems, a job that can never fit the cluster
//   3  coordinator unreachable (connection refused, timeout)
//   4  not found, or not authenticated / not allowed
//   5  any other coordinator error
// Thread-safety: RunCli is reentrant (no global state).
#pragma once

#include <iosfwd>
#include <map>
#include <string>
#include <vector>

namespace spindle {

inline constexpr int kExitOk = 0;
inline constexpr int kExitJobFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitUnreachable = 3;
inline constexpr int kExitNotFound = 4;
inline constexpr int kExitServerError = 5;

// `args` excludes the program name. `env` supplies SPINDLE_COORDINATOR / SPINDLE_TOKEN.
int RunCli(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
           std::ostream& out, std::ostream& err, bool out_is_tty);

}  // namespace spindle
