// KvStore: the key-value rendezvous the engine's communicators bootstrap from (Gloo's store, the
// NCCL unique id). The engine sees only this interface; implementations live elsewhere: a file
// store for standalone multi-process runs, and a gRPC client of the coordinator's rendezvous
// service (worker/) for cluster runs, scoped there to one attempt of one job.
// Implementations must be thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace spindle {

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Sets key to value (overwrites).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Returns the value of key, waiting up to `timeout` for it to be set.
  // DeadlineExceeded names the key when it never appears.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

}  // namespace spindle
