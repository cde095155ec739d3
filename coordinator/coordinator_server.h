// CoordinatorServer: assembles the coordinator daemon: opens the JobStore, recovers the
// JobManager, serves JobService (client port) and ClusterService + RendezvousService (worker
// port; the same port unless a separate one is configured, in which case the client port still
// answers ClusterService.ListWorkers for `spindle workers`), grpc.health.v1 on both (NOT_SERVING
// while the store's writes fail or stall: a thread of its own watches the store, never waiting
// behind a write), optional credentials (credentials.h: users' tokens; workers' certificates
// from the coordinator's CA, or their tokens) and TLS, Prometheus /metrics, and the periodic
// Tick thread.
// Used by main.cc and by in-process tests.
// Thread-safety: Start/Shutdown from one owner thread; accessors are safe afterwards.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/credentials.h"
#include "coordinator/job_manager.h"
#include "coordinator/service_limits.h"
#include "coordinator/users.h"
#include "coordinator/worker_certificates.h"

namespace spindle {

struct CoordinatorConfig {
  std::string listen = "0.0.0.0:7070";  // client-facing (JobService)
  std::string worker_listen;            // empty: workers use `listen` too
  std::string db_path = "spindle.db";
  int metrics_port = -1;  // -1: no /metrics; 0: an ephemeral port
  std::string metrics_host = "127.0.0.1";
  std::string token;             // the users' one token (user "admin"); empty: none
  std::vector<UserToken> users;  // --users-file
  // Workers' tokens (credentials.h); empty: workers use `token` too. Not with a CA.
  std::vector<WorkerToken> worker_tokens;
  // Serve a non-loopback listen address without credentials (exposure.h); false: refuse.
  bool insecure = false;
  // The coordinator's CA (certificate_authority.h); both set: TLS on every port, and workers are
  // who their client certificates say (mutual TLS, worker_certificates.h).
  std::string ca_cert_pem;
  std::string ca_key_pem;
  std::vector<BootstrapToken> bootstrap_tokens;  // for Join
  absl::Duration worker_certificate_validity = absl::Hours(24 * 365);
  // Names (DNS or IP) the server certificate the CA issues at start holds beside localhost,
  // 127.0.0.1, ::1, this host's name and addresses, "spindle-coordinator" and the advertised
  // host.
  std::vector<std::string> tls_names;
  // The server certificate and key; both set: TLS on every port with it (with a CA: instead of
  // the one the CA issues).
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // Rendezvous address given to workers; empty: derived from the worker port and this host's
  // name (127.0.0.1 when listening on 127.0.0.1).
  std::string advertise_address;
  int64_t tick_ms = 100;
  // How often finished jobs are pruned (manager.retention says which); also once at start.
  int64_t prune_interval_ms = 60000;
  JobManagerOptions manager;
  ServiceLimits limits;
  // Health reports NOT_SERVING while a store write has run longer than this (or the last failed).
  int64_t store_stall_ms = 5000;
  // Tests: a store put between the SQLite store (`base`, which it must use) and the rest, e.g. to
  // inject faults. Empty: none.
  std::function<std::unique_ptr<JobStore>(JobStore* base)> wrap_store;
};

class CoordinatorServer {
 public:
  // Starts everything; `clock` (not owned; null: a real clock) must outlive the server.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(CoordinatorConfig config,
                                                                  const Clock* clock = nullptr);
  ~CoordinatorServer();  // Shutdown()s.
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // Stops serving, ends sessions and watches, stops the tick thread. Idempotent.
  void Shutdown();
  // Blocks until Shutdown() is called from another thread.
  void Wait();

  int client_port() const;
  int worker_port() const;
  int metrics_port() const;
  // The server certificate the ports present (PEM); "" when plaintext.
  std::string server_certificate_pem() const;
  JobManager* manager();
  RendezvousStore* rendezvous();

 private:
  struct Impl;
  explicit CoordinatorServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle
