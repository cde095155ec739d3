// KvStore implementations the engine owns: an in-memory store shared by ranks that are threads of
// one process (tests, benchmarks) and a directory store for standalone multi-process runs on one
// host (spindle-train --file-store DIR). The cluster's store is worker/rendezvous_store.h.
//
// Thread-safety: both are thread-safe. FileKvStore is also safe across processes: a value is
// written to a temporary file and renamed into place, so a reader sees all of it or nothing.
#pragma once

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/engine/kv_store.h"

namespace spindle {

class MemoryKvStore : public KvStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// Keys map to files under `dir` (created if missing). A directory must serve one run: stale keys
// of an earlier run would be read as this run's.
class FileKvStore : public KvStore {
 public:
  explicit FileKvStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  std::string PathOf(const std::string& key) const;
  const std::string dir_;
};

}  // namespace spindle
