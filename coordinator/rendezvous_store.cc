// In-memory rendezvous namespaces (see rendezvous_store.h).
#include "coordinator/rendezvous_store.h"

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/text_bounds.h"

namespace spindle {
namespace {

// Constant-time comparison of secrets.
bool SecretEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// A client's string in an error message: bounded, so an error is never as large as a request.
std::string Short(const std::string& s) { return BoundedUtf8(s, kMaxIdBytes); }

}  // namespace

void RendezvousStore::Open(const std::string& job_id, int64_t attempt, const std::string& token) {
  absl::MutexLock l(&mu_);
  spaces_[{job_id, attempt}].token = token;
}

void RendezvousStore::Close(const std::string& job_id, int64_t attempt) {
  absl::MutexLock l(&mu_);
  spaces_.erase({job_id, attempt});
}

size_t RendezvousStore::NumWaiting() const {
  absl::MutexLock l(&mu_);
  return waiting_;
}

size_t RendezvousStore::NumOpen() const {
  absl::MutexLock l(&mu_);
  return spaces_.size();
}

absl::Status RendezvousStore::CheckScope(const Key& k, const std::string& token) const {
  auto it = spaces_.find(k);
  if (it == spaces_.end())
    return absl::FailedPreconditionError(
        absl::StrCat("rendezvous: job ", Short(k.first), " attempt ", k.second, " is not running"));
  if (!SecretEquals(it->second.token, token))
    return absl::PermissionDeniedError(
        absl::StrCat("rendezvous: wrong token for job ", Short(k.first), " attempt ", k.second));
  return absl::OkStatus();
}

absl::Status RendezvousStore::Set(const std::string& job_id, int64_t attempt,
                                  const std::string& token, const std::string& key,
                                  std::string value) {
  if (key.empty()) return absl::InvalidArgumentError("rendezvous: key must not be empty");
  if (key.size() > kMaxKeyBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: key must be at most ", kMaxKeyBytes, " bytes, got ", key.size()));
  if (value.size() > kMaxValueBytes)
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: value of key \"", key, "\" has ",
                                                   value.size(), " bytes; at most ",
                                                   kMaxValueBytes, " are allowed"));
  absl::MutexLock l(&mu_);
  Key k{job_id, attempt};
  RETURN_IF_ERROR(CheckScope(k, token));
  Space& space = spaces_[k];
  auto& kv = space.kv;
  // Written once: a rank cannot replace what another published (say, the NCCL id or a peer's
  // Gloo address) to pull the gang elsewhere. The same value again is a client's retry of a Set
  // whose reply it lost, and succeeds.
  if (auto it = kv.find(key); it != kv.end()) {
    if (SecretEquals(it->second, value)) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat("rendezvous: key \"", key, "\" of job ", job_id,
                                                 " attempt ", attempt,
                                                 " is already set; keys are written once"));
  }
  if (kv.size() >= max_keys_per_attempt_)
    return absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous: job ", job_id, " attempt ", attempt, " already holds ", max_keys_per_attempt_,
        " keys, the coordinator's limit per attempt (--max-rendezvous-keys)"));
  if (space.bytes + key.size() + value.size() > kMaxBytesPerAttempt)
    return absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous: job ", job_id, " attempt ", attempt, " would hold more than ",
        kMaxBytesPerAttempt >> 20, " MiB of keys and values, the coordinator's limit per attempt"));
  space.bytes += key.size() + value.size();
  kv[key] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousStore::Get(const std::string& job_id, int64_t attempt,
                                                 const std::string& token, const std::string& key,
                                                 absl::Duration timeout,
                                                 const std::function<bool()>& cancelled) {
  if (key.empty()) return absl::InvalidArgumentError("rendezvous: key must not be empty");
  if (key.size() > kMaxKeyBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: key must be at most ", kMaxKeyBytes, " bytes, got ", key.size()));
  const absl::Time deadline = absl::Now() + timeout;
  Key k{job_id, attempt};
  absl::MutexLock l(&mu_);
  RETURN_IF_ERROR(CheckScope(k, token));
  auto present_or_closed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = spaces_.find(k);
    return it == spaces_.end() || it->second.kv.count(key) > 0;
  };
  // Waits in slices so that a caller that went away stops waiting.
  constexpr absl::Duration kPoll = absl::Milliseconds(50);
  ++waiting_;
  absl::Cleanup done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { --waiting_; };
  while (timeout > absl::ZeroDuration() && !present_or_closed() && absl::Now() < deadline) {
    mu_.AwaitWithDeadline(absl::Condition(&present_or_closed),
                          cancelled ? std::min(deadline, absl::Now() + kPoll) : deadline);
    if (cancelled && !present_or_closed() && cancelled())
      return absl::CancelledError(
          absl::StrCat("rendezvous: the wait for key \"", key, "\" was cancelled"));
  }
  RETURN_IF_ERROR(CheckScope(k, token));
  auto& kv = spaces_[k].kv;
  auto it = kv.find(key);
  if (it != kv.end()) return it->second;
  if (timeout <= absl::ZeroDuration())
    return absl::NotFoundError(absl::StrCat("rendezvous: key \"", key, "\" is not set"));
  return absl::DeadlineExceededError(absl::StrCat("rendezvous: key \"", key,
                                                  "\" was not set within ",
                                                  absl::FormatDuration(timeout)));
}

}  // namespace spindle
