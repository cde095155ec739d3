// Helpers for the worker integration tests: scratch directories, executable fake-trainer scripts
// (plain /bin/sh), polling until a condition holds, process liveness checks.
// Thread-safety: ScratchDir is owned by one test; the free functions are thread-safe.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace spindle::testing {

// A fresh directory under $TMPDIR, removed at destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix = "spindle-test") {
    std::string templ = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    path_ = ::mkdtemp(templ.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes an executable /bin/sh script `body` (without the #! line) and returns its path.
inline std::string WriteScript(const ScratchDir& dir, const std::string& name,
                               const std::string& body) {
  const std::string path = dir.File(name);
  {
    std::ofstream out(path);
    out << "#!/bin/sh\n" << body;
  }
  ::chmod(path.c_str(), 0755);
  return path;
}

// The file's contents, or "" when it cannot be read. Plain read(2): a /proc file of a process
// that exits meanwhile fails with ESRCH, which std::filebuf turns into an exception.
// The binary at $`env` (binaries moved to another machine), else `built` (the path the build
// compiled in; empty when the target is not part of the build).
inline std::string BinaryPath(const char* env, const char* built) {
  const char* value = std::getenv(env);
  return value != nullptr && *value != '\0' ? value : built;
}

inline std::string ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

// Polls `cond` every 20 ms until it holds or `timeout` passes; returns its last value.
inline bool WaitFor(const std::function<bool()>& cond,
                    std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// True while `pid` exists and is not a zombie.
inline bool ProcessAlive(pid_t pid) {
  if (pid <= 0) return false;
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace spindle::testing
