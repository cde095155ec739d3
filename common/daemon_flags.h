// Command lines of the daemons (spindle-coordinator, spindle-worker): absl flags with two things
// a user expects. A flag may be spelled with hyphens (--work-dir) as well as with absl's
// underscores (--work_dir), and --help lists the daemon's own flags with their defaults (absl's
// --help lists only the flags of a file named after the binary, which would be none).
// Also the check of --metrics-port, which both daemons take. Header-only, so that common/ itself
// does not link absl's flags libraries; call ParseDaemonFlags once from main.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace spindle {

// A daemon's --metrics-port: a port, 0 (any free one) or -1 (no /metrics endpoint).
inline absl::Status CheckMetricsPortFlag(int port) {
  if (port >= -1 && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--metrics-port must be a port, 0 (any) or -1 (off), got ", port));
}

// `what` says what the daemon does ("schedules Spindle training jobs onto worker daemons.");
// `usage` is its usage line; `main_file` is the end of the path of the file that defines its
// flags ("coordinator/main.cc"). Exits, as absl does, on --help and on an unknown flag, and
// with code 2 on an argument that is not a flag.
inline void ParseDaemonFlags(int argc, char** argv, const std::string& what,
                             const std::string& usage, const std::string& main_file) {
  absl::SetProgramUsageMessage(what + "\nusage: " + usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [main_file](absl::string_view file) {
    return absl::EndsWith(file, main_file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.normalize_filename = [main_file](absl::string_view file) {
    return absl::EndsWith(file, main_file) ? main_file : std::string(file);
  };
  absl::SetFlagsUsageConfig(config);

  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    for (size_t k = 2; k < end; ++k) {
      if (a[k] == '-') a[k] = '_';
    }
  }
  std::vector<char*> argp;
  for (std::string& a : args) argp.push_back(a.data());
  const std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  if (rest.size() > 1) {  // a daemon takes flags only: a stray word is a typo, not to be ignored
    const std::string name = std::string(argv[0]).substr(std::string(argv[0]).rfind('/') + 1);
    std::fprintf(stderr, "%s: unexpected argument \"%s\" (every option is a --flag)\n",
                 name.c_str(), rest[1]);
    std::exit(2);
  }
}

}  // namespace spindle
