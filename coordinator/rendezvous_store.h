// RendezvousStore: the in-memory key-value namespaces behind RendezvousService, one per live
// (job_id, attempt). The job manager opens a namespace when it places an attempt and closes it
// when the attempt ends; ranks Set and (blocking) Get keys in it with the attempt's token.
// Not persisted: ranks re-adopted after a coordinator restart have already bootstrapped.
//
// Bounded: an attempt holds at most max_keys_per_attempt keys (a new key past it is
// ResourceExhausted naming the limit) and kMaxBytesPerAttempt bytes of keys and values, keys at
// most kMaxKeyBytes, values at most kMaxValueBytes. Keys are written once per
// attempt: a second Set of a key with another value is AlreadyExists (with the same value it is
// a retry and succeeds). Only holders of the attempt's token (its ranks) set or read its keys.
//
// Thread-safety: thread-safe. Get() may block its caller up to its timeout (on a condition
// variable, releasing the mutex); Close() wakes blocked Gets, which then fail.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace spindle {

class RendezvousStore {
 public:
  static constexpr size_t kMaxValueBytes = 4 << 20;
  static constexpr size_t kMaxKeyBytes = 1024;
  static constexpr size_t kMaxBytesPerAttempt = 64 << 20;
  static constexpr size_t kDefaultMaxKeysPerAttempt = 4096;

  explicit RendezvousStore(size_t max_keys_per_attempt = kDefaultMaxKeysPerAttempt)
      : max_keys_per_attempt_(max_keys_per_attempt) {}

  void Open(const std::string& job_id, int64_t attempt, const std::string& token)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Close(const std::string& job_id, int64_t attempt) ABSL_LOCKS_EXCLUDED(mu_);

  // FailedPrecondition when the attempt is not open; PermissionDenied for a wrong token;
  // InvalidArgument for an empty key, a key over kMaxKeyBytes or a value over kMaxValueBytes;
  // AlreadyExists for a key already set to another value; ResourceExhausted for a new key when
  // the attempt holds max_keys_per_attempt keys or would pass kMaxBytesPerAttempt.
  absl::Status Set(const std::string& job_id, int64_t attempt, const std::string& token,
                   const std::string& key, std::string value) ABSL_LOCKS_EXCLUDED(mu_);
  // As Set; NotFound when absent and timeout is zero; DeadlineExceeded naming the key when it
  // does not appear within `timeout`; Cancelled as soon as `cancelled` (polled while waiting,
  // every 50 ms at most) returns true.
  absl::StatusOr<std::string> Get(const std::string& job_id, int64_t attempt,
                                  const std::string& token, const std::string& key,
                                  absl::Duration timeout,
                                  const std::function<bool()>& cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t NumOpen() const ABSL_LOCKS_EXCLUDED(mu_);
  // Gets blocked waiting for a key now.
  size_t NumWaiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Space {
    std::string token;
    std::map<std::string, std::string> kv;
    size_t bytes = 0;  // of every key and value in kv
  };
  using Key = std::pair<std::string, int64_t>;
  absl::Status CheckScope(const Key& k, const std::string& token) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_keys_per_attempt_;
  mutable absl::Mutex mu_;
  std::map<Key, Space> spaces_ ABSL_GUARDED_BY(mu_);
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace spindle
