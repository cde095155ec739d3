// The worker's identity for a coordinator with a CA: its private key and the client certificate
// the coordinator's CA signed for its worker id, kept in its identity directory. A worker without
// a usable certificate there joins the way a kubelet does: it makes a new key and a certificate
// request for its id and sends the request with a bootstrap token (ClusterService.Join); the key
// never leaves the worker, and its trainers are never given it.
//
// Thread-safety: a free function without shared state.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace spindle {

struct WorkerIdentityOptions {
  std::string coordinator_address;  // host:port of the worker port
  std::string tls_ca_file;          // the coordinator's CA certificate (PEM file)
  std::string worker_id;
  std::string identity_dir;          // holds key.pem (mode 0600) and cert.pem
  std::string bootstrap_token_file;  // "": no token (a stored certificate must do)
  // How long Join is retried while the coordinator cannot be reached.
  absl::Duration join_timeout = absl::Seconds(60);
};

struct WorkerIdentity {
  std::string key_pem;
  std::string cert_pem;
  bool joined = false;  // true: obtained by Join now; false: read from identity_dir
};

// The certificate in identity_dir when it is for `worker_id`, verifies against the CA and has not
// expired; otherwise a new one by Join (stored in identity_dir). FailedPrecondition when there is
// no usable certificate and no bootstrap token; Join's status (its message prefixed with
// "coordinator: ") when the coordinator refuses; Unavailable when it cannot be reached within
// join_timeout.
absl::StatusOr<WorkerIdentity> ObtainWorkerIdentity(const WorkerIdentityOptions& options);

}  // namespace spindle
