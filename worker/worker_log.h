// One-line log messages of the worker daemon on stderr: "<UTC time> spindle-worker: <message>".
// Thread-safety: safe from any thread (one fwrite per line).
#pragma once

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace spindle {

template <typename... Args>
void WorkerLog(const absl::FormatSpec<Args...>& format, const Args&... args) {
  const std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
                   " spindle-worker: ", absl::StrFormat(format, args...), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace spindle
