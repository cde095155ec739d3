// spindle-coordinator: the control-plane daemon. Serves the job API to `spindle` clients and the
// cluster + rendezvous APIs to worker daemons; state lives in one SQLite file.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/daemon_flags.h"
#include "common/host_port.h"
#include "common/pem.h"
#include "coordinator/certificate_authority.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/exposure.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "host:port for clients (JobService)");
ABSL_FLAG(std::string, worker_listen, "",
          "host:port for workers (ClusterService, RendezvousService); empty: same as --listen");
ABSL_FLAG(std::string, advertise, "",
          "host:port workers use to reach the rendezvous service; empty: the address each worker "
          "reaches the worker port at (its --coordinator)");
ABSL_FLAG(std::string, db, "spindle.db", "SQLite database file (created if missing)");
ABSL_FLAG(int, metrics_port, 9400, "port of the Prometheus /metrics endpoint; -1 disables it");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "bind address of the /metrics endpoint (default loopback only; 0.0.0.0 or the pod IP to "
          "let Prometheus on another host scrape it)");
ABSL_FLAG(bool, insecure, false,
          "serve a non-loopback --listen/--worker-listen without users' credentials "
          "(--users-file or --token-file; TLS alone names no one): without it the coordinator "
          "refuses to start");
ABSL_FLAG(std::string, users_file, "",
          "file of the users' bearer tokens, one a line: TOKEN NAME, or TOKEN NAME admin; a job "
          "belongs to the user who submitted it, and only its owner or an admin cancels it");
ABSL_FLAG(std::string, token_file, "",
          "file holding one users' bearer token (its holder is the admin user \"admin\"); with "
          "neither this nor --users-file users are not authenticated");
ABSL_FLAG(bool, plaintext, false,
          "no CA: plaintext gRPC (unless --tls-cert) and workers with bearer tokens; by default "
          "every port speaks TLS and workers are who their client certificates say (mutual TLS)");
ABSL_FLAG(std::string, ca_cert, "",
          "PEM certificate of the coordinator's CA, which signs the workers' certificates and the "
          "server's (default: <db>.ca.pem, created with its key at the first start)");
ABSL_FLAG(std::string, ca_key, "", "PEM private key of the CA (default: <db>.ca-key.pem)");
ABSL_FLAG(std::string, bootstrap_token_file, "",
          "file of bootstrap tokens new workers join with (they send one with a certificate "
          "request for their id), one a line: TOKEN EXPIRES [MAX_JOINS], EXPIRES an RFC 3339 "
          "time, MAX_JOINS how many workers may join with it (absent or 0: no limit)");
ABSL_FLAG(int, worker_cert_days, 365, "days a worker certificate signed at join is valid");
ABSL_FLAG(std::vector<std::string>, tls_names, {},
          "extra DNS names or IP addresses of the server certificate the CA issues at start "
          "(beside localhost, this host's names and addresses and spindle-coordinator)");
ABSL_FLAG(std::string, worker_token_file, "",
          "file of the workers' bearer tokens, one a line: TOKEN (any worker) or WORKER_ID TOKEN "
          "(that worker only); workers and their trainers then need one of them for "
          "ClusterService and RendezvousService, and the --token-file token no longer opens "
          "those (nor a worker token JobService); empty: workers use the --token-file token");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM server certificate chain with --tls-key: TLS with it instead of the certificate "
          "the CA issues (with --plaintext: TLS on every port)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(double, heartbeat_interval, 1.0, "seconds between worker heartbeats");
ABSL_FLAG(double, heartbeat_timeout, 10.0, "seconds without a worker message before it is lost");
ABSL_FLAG(double, hang_timeout, 120.0,
          "seconds without step progress before a rank is declared hung and its gang restarts "
          "(or 3 times the rank's last step time, when longer)");
ABSL_FLAG(double, silence_timeout, 5.0,
          "seconds a rank's trainer may print nothing (it pulses every second) before the rank is "
          "declared stopped and its gang restarts: a frozen rank is found in seconds, while its "
          "peers wait for it in a collective");
ABSL_FLAG(double, start_timeout, 600.0, "seconds from placement to a rank's first step");
ABSL_FLAG(double, stop_grace, 10.0, "seconds a stopped rank gets between SIGTERM and SIGKILL");
ABSL_FLAG(double, recovery_grace, 20.0,
          "after a restart, seconds placed ranks wait for their worker to reconnect");
ABSL_FLAG(double, keep_finished_days, 14.0,
          "days a finished (succeeded, failed, cancelled) job is kept before it and its events are "
          "deleted; 0: no age limit");
ABSL_FLAG(int64_t, keep_finished_jobs, 10000,
          "at most this many finished jobs are kept (the most recently finished); older ones are "
          "deleted with their events; 0: no count limit");
ABSL_FLAG(int, max_watch_streams, 256,
          "concurrent `spindle watch` streams (JobService.Watch); one more is refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_rendezvous_keys, 4096,
          "keys one job attempt may set in the rendezvous service; one more is refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_rendezvous_waits, 4096,
          "concurrent rendezvous Gets that wait for a key; one more is refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_sessions, 2048,
          "concurrent worker sessions (ClusterService.Session); one more is refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_workers, 1024,
          "workers the coordinator holds; a new worker id beyond it replaces the longest-silent "
          "lost worker that holds no rank, or is refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_worker_slots, 1024,
          "devices (GPUs or CPU slots) one worker may offer; a registration offering more is "
          "refused");
ABSL_FLAG(double, stream_write_timeout, 30.0,
          "seconds a watch update or a message to a worker may wait for a client that does not "
          "read before its stream is ended");
ABSL_FLAG(double, store_stall, 5.0,
          "seconds a store write may run before health reports NOT_SERVING");

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", what, " file ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int64_t Ms(double seconds) { return static_cast<int64_t>(seconds * 1000.0); }

}  // namespace

int main(int argc, char** argv) {
  // The coordinator reports every failure it acts on in its own words (a port it cannot bind
  // included); gRPC's own log, a nested status dump per error, is off unless GRPC_VERBOSITY asks
  // for it. Set before gRPC first initialises, which reads it.
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);
  spindle::ParseDaemonFlags(argc, argv, "schedules Spindle training jobs onto worker daemons.",
                            "spindle-coordinator --listen 0.0.0.0:7070 --db "
                            "/var/lib/spindle/spindle.db [flags]\n"
                            "(gRPC's own log: GRPC_VERBOSITY=ERROR)",
                            "coordinator/main.cc");

  spindle::CoordinatorConfig cfg;
  std::string ca_path;  // the CA certificate's file, for the start line
  cfg.listen = absl::GetFlag(FLAGS_listen);
  cfg.worker_listen = absl::GetFlag(FLAGS_worker_listen);
  cfg.advertise_address = absl::GetFlag(FLAGS_advertise);
  cfg.db_path = absl::GetFlag(FLAGS_db);
  cfg.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  cfg.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  cfg.insecure = absl::GetFlag(FLAGS_insecure);
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    auto token = ReadFile(absl::GetFlag(FLAGS_token_file), "token");
    if (!token.ok()) {
      std::fprintf(stderr, "spindle-coordinator: %s\n",
                   std::string(token.status().message()).c_str());
      return 2;
    }
    cfg.token = std::string(absl::StripAsciiWhitespace(*token));
    if (cfg.token.empty()) {
      std::fprintf(stderr, "spindle-coordinator: token file %s is empty\n",
                   absl::GetFlag(FLAGS_token_file).c_str());
      return 2;
    }
  }
  if (!absl::GetFlag(FLAGS_worker_token_file).empty()) {
    const std::string file = absl::GetFlag(FLAGS_worker_token_file);
    auto text = ReadFile(file, "worker token");
    absl::StatusOr<std::vector<spindle::WorkerToken>> tokens =
        text.ok() ? spindle::ParseWorkerTokens(*text) : text.status();
    if (!tokens.ok()) {
      std::fprintf(stderr, "spindle-coordinator: --worker-token-file %s: %s\n", file.c_str(),
                   std::string(tokens.status().message()).c_str());
      return 2;
    }
    for (const spindle::WorkerToken& t : *tokens) {
      if (t.token == cfg.token) {
        std::fprintf(stderr,
                     "spindle-coordinator: --worker-token-file %s holds the users' token "
                     "(--token-file); give workers tokens of their own\n",
                     file.c_str());
        return 2;
      }
    }
    cfg.worker_tokens = *std::move(tokens);
  } else if (!cfg.token.empty() && absl::GetFlag(FLAGS_plaintext)) {
    std::fprintf(stderr,
                 "spindle-coordinator: warning: users and workers share the --token-file token, "
                 "so any user can act as a worker; give workers their own with "
                 "--worker-token-file\n");
  }
  if (!absl::GetFlag(FLAGS_users_file).empty()) {
    const std::string file = absl::GetFlag(FLAGS_users_file);
    auto text = ReadFile(file, "users");
    absl::StatusOr<std::vector<spindle::UserToken>> users =
        text.ok() ? spindle::ParseUsersFile(*text) : text.status();
    if (!users.ok()) {
      std::fprintf(stderr, "spindle-coordinator: --users-file %s: %s\n", file.c_str(),
                   std::string(users.status().message()).c_str());
      return 2;
    }
    for (const spindle::UserToken& u : *users) {
      if (!cfg.token.empty() && u.token == cfg.token) {
        std::fprintf(stderr,
                     "spindle-coordinator: --users-file %s gives user %s the --token-file token\n",
                     file.c_str(), u.user.name.c_str());
        return 2;
      }
      for (const spindle::WorkerToken& w : cfg.worker_tokens) {
        if (w.token == u.token) {
          std::fprintf(stderr,
                       "spindle-coordinator: --users-file %s gives user %s a worker's token\n",
                       file.c_str(), u.user.name.c_str());
          return 2;
        }
      }
    }
    cfg.users = *std::move(users);
  }
  if (!absl::GetFlag(FLAGS_plaintext)) {
    if (!cfg.worker_tokens.empty()) {
      std::fprintf(stderr,
                   "spindle-coordinator: --worker-token-file goes with --plaintext: by default "
                   "workers are who their certificates say (they join with "
                   "--bootstrap-token-file)\n");
      return 2;
    }
    if (absl::GetFlag(FLAGS_worker_cert_days) < 1) {
      std::fprintf(stderr, "spindle-coordinator: --worker-cert-days must be at least 1, got %d\n",
                   absl::GetFlag(FLAGS_worker_cert_days));
      return 2;
    }
    cfg.worker_certificate_validity = absl::Hours(24) * absl::GetFlag(FLAGS_worker_cert_days);
    cfg.tls_names = absl::GetFlag(FLAGS_tls_names);
    if (!absl::GetFlag(FLAGS_bootstrap_token_file).empty()) {
      const std::string file = absl::GetFlag(FLAGS_bootstrap_token_file);
      auto text = ReadFile(file, "bootstrap token");
      absl::StatusOr<std::vector<spindle::BootstrapToken>> tokens =
          text.ok() ? spindle::ParseBootstrapTokens(*text) : text.status();
      if (!tokens.ok()) {
        std::fprintf(stderr, "spindle-coordinator: --bootstrap-token-file %s: %s\n", file.c_str(),
                     std::string(tokens.status().message()).c_str());
        return 2;
      }
      cfg.bootstrap_tokens = *std::move(tokens);
    }
  } else if (!absl::GetFlag(FLAGS_bootstrap_token_file).empty()) {
    std::fprintf(stderr,
                 "spindle-coordinator: --bootstrap-token-file needs the CA: drop --plaintext\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_tls_cert).empty() != absl::GetFlag(FLAGS_tls_key).empty()) {
    std::fprintf(stderr, "spindle-coordinator: --tls-cert and --tls-key go together\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
    auto cert = spindle::ReadPemFile(absl::GetFlag(FLAGS_tls_cert), spindle::PemKind::kCertificate,
                                     "--tls-cert");
    auto key = spindle::ReadPemFile(absl::GetFlag(FLAGS_tls_key), spindle::PemKind::kPrivateKey,
                                    "--tls-key");
    if (!cert.ok() || !key.ok()) {
      std::fprintf(stderr, "spindle-coordinator: %s\n",
                   std::string((cert.ok() ? key.status() : cert.status()).message()).c_str());
      return 2;
    }
    cfg.tls_cert_pem = *cert;
    cfg.tls_key_pem = *key;
  }
  // Durations in seconds: the timeouts must be positive, the graces may be zero.
  const struct {
    const char* flag;
    double seconds;
    bool zero_ok;
  } durations[] = {
      {"--heartbeat-interval", absl::GetFlag(FLAGS_heartbeat_interval), false},
      {"--heartbeat-timeout", absl::GetFlag(FLAGS_heartbeat_timeout), false},
      {"--hang-timeout", absl::GetFlag(FLAGS_hang_timeout), false},
      {"--start-timeout", absl::GetFlag(FLAGS_start_timeout), false},
      {"--silence-timeout", absl::GetFlag(FLAGS_silence_timeout), false},
      {"--stop-grace", absl::GetFlag(FLAGS_stop_grace), true},
      {"--recovery-grace", absl::GetFlag(FLAGS_recovery_grace), true},
  };
  for (const auto& d : durations) {
    if (!(d.seconds > 0 || (d.zero_ok && d.seconds == 0))) {
      std::fprintf(stderr, "spindle-coordinator: %s must be %s number of seconds, got %g\n", d.flag,
                   d.zero_ok ? "a non-negative" : "a positive", d.seconds);
      return 2;
    }
  }
  absl::Status address = spindle::CheckHostPort("--listen", cfg.listen);
  if (address.ok() && !cfg.worker_listen.empty())  // empty: as --listen
    address = spindle::CheckHostPort("--worker-listen", cfg.worker_listen);
  if (!address.ok()) {
    std::fprintf(stderr, "spindle-coordinator: %s\n", std::string(address.message()).c_str());
    return 2;
  }
  if (absl::Status port = spindle::CheckMetricsPortFlag(cfg.metrics_port); !port.ok()) {
    std::fprintf(stderr, "spindle-coordinator: %s\n", std::string(port.message()).c_str());
    return 2;
  }
  cfg.manager.heartbeat_interval_ms = Ms(absl::GetFlag(FLAGS_heartbeat_interval));
  cfg.manager.heartbeat_timeout_ms = Ms(absl::GetFlag(FLAGS_heartbeat_timeout));
  cfg.manager.hang_timeout_ms = Ms(absl::GetFlag(FLAGS_hang_timeout));
  cfg.manager.start_timeout_ms = Ms(absl::GetFlag(FLAGS_start_timeout));
  cfg.manager.silence_timeout_ms = Ms(absl::GetFlag(FLAGS_silence_timeout));
  cfg.manager.stop_grace_ms = Ms(absl::GetFlag(FLAGS_stop_grace));
  cfg.manager.recovery_grace_ms = Ms(absl::GetFlag(FLAGS_recovery_grace));
  const double keep_days = absl::GetFlag(FLAGS_keep_finished_days);
  if (!(keep_days >= 0) || absl::GetFlag(FLAGS_keep_finished_jobs) < 0) {
    std::fprintf(stderr,
                 "spindle-coordinator: --keep-finished-days and --keep-finished-jobs must not be "
                 "negative (0: no limit)\n");
    return 2;
  }
  cfg.manager.retention.max_age_ms = Ms(keep_days * 24 * 3600);
  cfg.manager.retention.max_finished_jobs = absl::GetFlag(FLAGS_keep_finished_jobs);
  cfg.limits.max_watch_streams = absl::GetFlag(FLAGS_max_watch_streams);
  cfg.limits.max_rendezvous_keys = absl::GetFlag(FLAGS_max_rendezvous_keys);
  cfg.limits.max_rendezvous_waits = absl::GetFlag(FLAGS_max_rendezvous_waits);
  cfg.limits.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  cfg.manager.registry.max_workers = absl::GetFlag(FLAGS_max_workers);
  cfg.manager.registry.max_slots_per_worker = absl::GetFlag(FLAGS_max_worker_slots);
  cfg.limits.stream_write_timeout_ms = Ms(absl::GetFlag(FLAGS_stream_write_timeout));
  cfg.store_stall_ms = Ms(absl::GetFlag(FLAGS_store_stall));
  if (cfg.limits.max_watch_streams < 1 || cfg.limits.max_rendezvous_keys < 1 ||
      cfg.limits.max_rendezvous_waits < 1 || cfg.limits.max_sessions < 1 ||
      cfg.manager.registry.max_workers < 1 || cfg.manager.registry.max_slots_per_worker < 1) {
    std::fprintf(stderr,
                 "spindle-coordinator: --max-watch-streams, --max-rendezvous-keys, "
                 "--max-rendezvous-waits, --max-sessions, --max-workers and --max-worker-slots "
                 "must be at least 1\n");
    return 2;
  }
  if (cfg.limits.stream_write_timeout_ms < 100 || cfg.store_stall_ms < 100) {
    std::fprintf(stderr,
                 "spindle-coordinator: --stream-write-timeout and --store-stall must be at least "
                 "0.1 s\n");
    return 2;
  }
  if (cfg.manager.heartbeat_timeout_ms <= cfg.manager.heartbeat_interval_ms) {
    std::fprintf(stderr,
                 "spindle-coordinator: --heartbeat-timeout must exceed --heartbeat-interval\n");
    return 2;
  }

  // Checked here too (Start checks it as well) so that the refusal is a configuration error.
  if (absl::Status exposed = spindle::CheckCoordinatorExposure(
          cfg.listen, cfg.worker_listen, !cfg.token.empty() || !cfg.users.empty(),
          !absl::GetFlag(FLAGS_plaintext) || !cfg.worker_tokens.empty(), cfg.insecure);
      !exposed.ok()) {
    std::fprintf(stderr, "spindle-coordinator: %s\n", std::string(exposed.message()).c_str());
    return 2;
  }

  // The CA: generated at the first start beside the database (or given as files). One made now
  // is removed again when the coordinator cannot start, with the store it would have created.
  std::vector<std::string> new_ca_files;
  if (!absl::GetFlag(FLAGS_plaintext)) {
    const std::string db = absl::GetFlag(FLAGS_db);
    std::string ca_cert = absl::GetFlag(FLAGS_ca_cert), ca_key = absl::GetFlag(FLAGS_ca_key);
    if (ca_cert.empty()) ca_cert = db + ".ca.pem";
    if (ca_key.empty()) ca_key = db + ".ca-key.pem";
    if (::access(ca_cert.c_str(), F_OK) != 0 && ::access(ca_key.c_str(), F_OK) != 0)
      new_ca_files = {ca_cert, ca_key};
    absl::StatusOr<spindle::CertificateAuthority> ca =
        spindle::CertificateAuthority::LoadOrCreate(ca_cert, ca_key);
    if (!ca.ok()) {
      std::fprintf(stderr, "spindle-coordinator: CA: %s\n",
                   std::string(ca.status().message()).c_str());
      return 2;
    }
    cfg.ca_cert_pem = ca->cert_pem();
    cfg.ca_key_pem = ca->key_pem();
    ca_path = ca_cert;
  }

  // Block SIGINT/SIGTERM in every thread; a dedicated thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = spindle::CoordinatorServer::Start(cfg);
  if (!server.ok()) {
    for (const std::string& f : new_ca_files) ::unlink(f.c_str());
    std::fprintf(stderr, "spindle-coordinator: %s\n",
                 std::string(server.status().message()).c_str());
    return 1;
  }
  std::fprintf(
      stderr,
      "spindle-coordinator: serving clients on port %d, workers on port %d, metrics on "
      "port %d%s%s%s%s%s\n",
      (*server)->client_port(), (*server)->worker_port(), (*server)->metrics_port(),
      cfg.token.empty() ? "" : ", token auth",
      cfg.users.empty() ? "" : absl::StrCat(", ", cfg.users.size(), " users").c_str(),
      cfg.worker_tokens.empty() ? "" : ", worker tokens",
      (*server)->server_certificate_pem().empty() ? "" : ", TLS",
      ca_path.empty() ? "" : absl::StrCat(", worker certificates (CA ", ca_path, ")").c_str());
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "spindle-coordinator: signal %d, shutting down\n", sig);
  (*server)->Shutdown();
  return 0;
}
