// RendezvousStore: the KvStore (worker/engine/kv_store.h) of a trainer that runs under the worker
// daemon: a gRPC client of the coordinator's RendezvousService, scoped to one (job id, attempt)
// and carrying that attempt's rendezvous token plus the cluster's bearer token.
//
// How spindle-train builds it (the daemon passes these on the trainer's command line and
// environment, see worker/rank_runner.h):
//   RendezvousOptions o;
//   o.address = <--rendezvous>; o.job_id = <--job-id>; o.attempt = <--attempt>;
//   o.bearer_token_file = <--token-file>;               // may be empty
//   auto store = RendezvousStore::Connect(WithTrainerEnvironment(o));
// WithTrainerEnvironment fills the rendezvous token from $SPINDLE_RENDEZVOUS_TOKEN and the TLS
// CA file from $SPINDLE_TLS_CA_FILE when they are set.
//
// Calls ride out a coordinator restart: UNAVAILABLE is retried with backoff until the call's own
// deadline (Set: `set_timeout`; Get: its `timeout`). Long Gets are split into server-side waits of
// at most `max_wait_per_call`.
//
// Thread-safety: thread-safe (a gRPC stub and immutable options).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "worker/engine/kv_store.h"

namespace spindle {

struct RendezvousOptions {
  std::string address;  // host:port of the coordinator's rendezvous service
  std::string job_id;
  int64_t attempt = 0;
  std::string rendezvous_token;   // Assignment.rendezvous_token
  std::string bearer_token;       // cluster auth token (wins over bearer_token_file)
  std::string bearer_token_file;  // read when bearer_token is empty
  std::string tls_ca_file;        // empty: plaintext
  absl::Duration set_timeout = absl::Seconds(60);
  absl::Duration max_wait_per_call = absl::Seconds(10);
};

// `options` with rendezvous_token / tls_ca_file taken from $SPINDLE_RENDEZVOUS_TOKEN /
// $SPINDLE_TLS_CA_FILE where those fields are empty and the variables are set.
RendezvousOptions WithTrainerEnvironment(RendezvousOptions options);

class RendezvousStore : public KvStore {
 public:
  // InvalidArgument names the missing option (address, job_id, attempt); NotFound for an
  // unreadable token or CA file. Does not contact the coordinator.
  static absl::StatusOr<std::unique_ptr<RendezvousStore>> Connect(const RendezvousOptions& options);

  // Errors keep the server's code: FailedPrecondition (attempt not running), PermissionDenied
  // (bad token), Unauthenticated, InvalidArgument; Unavailable after retrying until set_timeout.
  absl::Status Set(const std::string& key, const std::string& value) override;
  // DeadlineExceeded naming the key when it is not set within `timeout` (NotFound when
  // `timeout` is zero and the key is absent).
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  RendezvousStore(RendezvousOptions options, std::string bearer_token,
                  std::unique_ptr<v1::RendezvousService::Stub> stub);
  void FillScope(v1::RendezvousScope* scope) const;

  const RendezvousOptions options_;
  const std::string bearer_token_;
  const std::unique_ptr<v1::RendezvousService::Stub> stub_;
};

}  // namespace spindle
