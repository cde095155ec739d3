// Helpers shared by the control-plane tests: temporary directories, job spec JSON, a recording
// WorkerChannel. Test-only; not thread-safe unless stated.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/worker_channel.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle::testing {

// A fresh directory under TMPDIR, removed at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "spindle-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A valid tiny CPU job spec with the given world and priority.
inline std::string SpecJson(int64_t cp = 1, int64_t dp = 1, int64_t priority = 0,
                            int64_t max_restarts = 3, const std::string& extra_parallel = "") {
  return absl::StrCat(R"({"name": "t", "model": {"preset": "tiny"},
    "data": {"source": "synthetic:recall"}, "seq_len": 256,
    "parallel": {"cp": )", cp, R"(, "dp": )", dp, extra_parallel, R"(},
    "train": {"steps": 10}, "checkpoint": {"dir": "/tmp/ck", "every": 5},
    "resources": "cpu", "max_restarts": )", max_restarts, R"(, "priority": )", priority, "}");
}

// `spec` (from SpecJson) with its checkpoint directory changed to `dir`: unfinished jobs may not
// share one.
inline std::string WithCheckpointDir(std::string spec, const std::string& dir) {
  spec.replace(spec.find("\"/tmp/ck\""), 9, "\"" + dir + "\"");
  return spec;
}

// Records every message the manager sends. Thread-safe.
class FakeWorkerChannel : public WorkerChannel {
 public:
  bool Send(const std::string& worker_id, const v1::CoordinatorMessage& msg) override {
    absl::MutexLock l(&mu_);
    sent_.emplace_back(worker_id, msg);
    return true;
  }
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> Take() {
    absl::MutexLock l(&mu_);
    return std::exchange(sent_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> sent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace spindle::testing
