// Coordinator daemon assembly (see coordinator_server.h).
#include "coordinator/coordinator_server.h"

#include <ifaddrs.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/message_limits.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/status.h"
#include "coordinator/certificate_authority.h"
#include "coordinator/exposure.h"
#include "coordinator/grpc_services.h"
#include "coordinator/monitored_job_store.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/sqlite_job_store.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace spindle {
namespace {

// What the server certificate the CA issues at start names: the names clients on this host and
// in a cluster use, this host's name and every address of its interfaces, and `extra`.
std::vector<std::string> ServerNames(const CoordinatorConfig& c) {
  std::vector<std::string> names = {"localhost", "127.0.0.1", "::1", "spindle-coordinator"};
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof(host) - 1) == 0 && host[0] != '\0') names.push_back(host);
  ifaddrs* addrs = nullptr;
  if (getifaddrs(&addrs) == 0) {
    for (ifaddrs* a = addrs; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr) continue;
      const int family = a->ifa_addr->sa_family;
      if (family != AF_INET && family != AF_INET6) continue;
      char buf[NI_MAXHOST];
      const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      if (getnameinfo(a->ifa_addr, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0)
        continue;
      std::string ip = buf;
      if (ip.find('%') != std::string::npos) continue;  // link-local with a scope
      names.push_back(ip);
    }
    freeifaddrs(addrs);
  }
  for (const std::string& address : {c.listen, c.worker_listen, c.advertise_address}) {
    const std::string h = ListenHost(address);
    if (!address.empty() && !h.empty() && h != "0.0.0.0" && h != "::") names.push_back(h);
  }
  names.insert(names.end(), c.tls_names.begin(), c.tls_names.end());
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace

struct CoordinatorServer::Impl {
  CoordinatorConfig config;
  RealClock real_clock;
  const Clock* clock = nullptr;
  std::unique_ptr<JobStore> sqlite_store;
  std::unique_ptr<JobStore> test_store;      // config.wrap_store's, over sqlite_store
  std::unique_ptr<MonitoredJobStore> store;  // what the manager writes through
  Counter* store_errors = nullptr;
  std::thread health_watch;  // serving status from the store's health
  std::unique_ptr<RendezvousStore> rendezvous;
  SessionRegistry sessions;
  MetricsRegistry registry;
  std::unique_ptr<MetricsServer> metrics_server;
  std::unique_ptr<WorkerCertificates> certificates;  // null without a CA
  std::string server_cert_pem, server_key_pem;       // empty: plaintext
  std::unique_ptr<Credentials> auth;
  std::unique_ptr<JobManager> manager;
  std::unique_ptr<JobServiceImpl> job_service;
  std::unique_ptr<ClusterServiceImpl> cluster_service;
  // ListWorkers on the client port when workers have a port of their own.
  std::unique_ptr<ClusterServiceImpl> client_cluster_service;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service;
  std::unique_ptr<grpc::Server> client_server;
  std::unique_ptr<grpc::Server> worker_server;  // null when sharing client_server
  int client_port = 0;
  int worker_port = 0;
  std::thread ticker;
  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool shut_down = false;

  // Metric families, refreshed from the manager before each scrape.
  Family<Gauge>* jobs_gauge = nullptr;
  Family<Gauge>* workers_gauge = nullptr;
  Family<Gauge>* devices_gauge = nullptr;
  Family<Gauge>* job_world_gauge = nullptr;
  Family<Gauge>* goodput_gauge = nullptr;
  // The jobs spindle_job_world and spindle_job_goodput have a series for (a finished job's, or
  // one the manager let go, is removed).
  absl::Mutex gauges_mu;
  std::set<std::string> world_jobs ABSL_GUARDED_BY(gauges_mu);
  std::set<std::string> goodput_jobs ABSL_GUARDED_BY(gauges_mu);

  // With a CA, a client may present a certificate (workers do; users and trainers need not), and
  // one it presents must verify against the CA.
  std::shared_ptr<grpc::ServerCredentials> ListenCredentials() const {
    if (server_cert_pem.empty()) return grpc::InsecureServerCredentials();
    grpc::SslServerCredentialsOptions opts(certificates
                                               ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    opts.pem_key_cert_pairs.push_back({server_key_pem, server_cert_pem});
    if (certificates) opts.pem_root_certs = config.ca_cert_pem;
    return grpc::SslServerCredentials(opts);
  }

  absl::Status SetUpMetrics(JobManagerMetrics* m) {
    ASSIGN_OR_RETURN(jobs_gauge, registry.GaugeFamily("spindle_jobs", "Jobs by state.", {"state"}));
    ASSIGN_OR_RETURN(workers_gauge,
                     registry.GaugeFamily("spindle_workers", "Workers by state.", {"state"}));
    ASSIGN_OR_RETURN(devices_gauge, registry.GaugeFamily(
                                        "spindle_devices",
                                        "Devices (GPUs or CPU slots) of live workers.", {"state"}));
    ASSIGN_OR_RETURN(job_world_gauge,
                     registry.GaugeFamily("spindle_job_world",
                                          "Ranks (dp x cp) an unfinished job is planned at now; "
                                          "an elastic job's changes with each resize.",
                                          {"job_id"}));
    ASSIGN_OR_RETURN(goodput_gauge,
                     registry.GaugeFamily("spindle_job_goodput",
                                          "Fraction of the job's wall time spent on steps that "
                                          "count (coordinator/goodput.h).",
                                          {"job_id"}));
    ASSIGN_OR_RETURN(auto* latency,
                     registry.HistogramFamily(
                         "spindle_scheduling_latency_seconds",
                         "Time from queueing (or restarting) to the placement of a whole gang.", {},
                         ExponentialBuckets(0.01, 2.0, 16)));
    ASSIGN_OR_RETURN(m->scheduling_latency_seconds, latency->Add({}));
    ASSIGN_OR_RETURN(
        auto* restarts,
        registry.CounterFamily("spindle_restarts_total", "Gang restarts by reason.", {"reason"}));
    ASSIGN_OR_RETURN(m->restarts_worker_lost, restarts->Add({{"reason", "worker_lost"}}));
    ASSIGN_OR_RETURN(m->restarts_worker_left, restarts->Add({{"reason", "worker_left"}}));
    ASSIGN_OR_RETURN(m->restarts_rank_failed, restarts->Add({{"reason", "rank_failed"}}));
    ASSIGN_OR_RETURN(m->restarts_hang, restarts->Add({{"reason", "hang"}}));
    ASSIGN_OR_RETURN(m->restarts_recovery, restarts->Add({{"reason", "coordinator_restart"}}));
    ASSIGN_OR_RETURN(auto* submitted, registry.CounterFamily("spindle_jobs_submitted_total",
                                                             "Jobs accepted by Submit."));
    ASSIGN_OR_RETURN(m->jobs_submitted, submitted->Add({}));
    ASSIGN_OR_RETURN(auto* store_errors_family,
                     registry.CounterFamily("spindle_store_errors_total",
                                            "Writes of the job store (SQLite) that failed."));
    ASSIGN_OR_RETURN(store_errors, store_errors_family->Add({}));
    ASSIGN_OR_RETURN(
        auto* ignored,
        registry.CounterFamily("spindle_ignored_rank_reports_total",
                               "Ranks that workers listed or reported on but were never given "
                               "(ignored)."));
    ASSIGN_OR_RETURN(m->ignored_rank_reports, ignored->Add({}));
    return absl::OkStatus();
  }

  void RefreshGauges() {
    if (!manager) return;
    for (const auto& [state, n] : manager->JobCounts()) {
      auto g = jobs_gauge->Add({{"state", std::string(JobStateName(state))}});
      if (g.ok()) (*g)->Set(static_cast<double>(n));
    }
    for (const auto& [state, n] : manager->WorkerCounts()) {
      auto g = workers_gauge->Add({{"state", state}});
      if (g.ok()) (*g)->Set(static_cast<double>(n));
    }
    for (const auto& [state, n] : manager->DeviceCounts()) {
      auto g = devices_gauge->Add({{"state", state}});
      if (g.ok()) (*g)->Set(static_cast<double>(n));
    }
    const std::map<std::string, int64_t> worlds = manager->JobWorlds();
    const std::map<std::string, double> goodputs = manager->JobGoodputs();
    absl::MutexLock l(&gauges_mu);
    for (const std::string& id : world_jobs)
      if (!worlds.count(id)) job_world_gauge->Remove({{"job_id", id}}).IgnoreError();
    world_jobs.clear();
    for (const auto& [id, n] : worlds) {
      auto g = job_world_gauge->Add({{"job_id", id}});
      if (g.ok()) (*g)->Set(static_cast<double>(n)), world_jobs.insert(id);
    }
    // One child per job the manager holds with a goodput; those of jobs it let go are removed.
    for (auto it = goodput_jobs.begin(); it != goodput_jobs.end();) {
      if (goodputs.count(*it)) {
        ++it;
        continue;
      }
      (void)goodput_gauge->Remove({{"job_id", *it}});
      it = goodput_jobs.erase(it);
    }
    for (const auto& [job, goodput] : goodputs) {
      auto g = goodput_gauge->Add({{"job_id", job}});
      if (!g.ok()) continue;
      (*g)->Set(goodput);
      goodput_jobs.insert(job);
    }
  }
};

CoordinatorServer::CoordinatorServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CoordinatorServer::~CoordinatorServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    CoordinatorConfig config, const Clock* clock) {
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.config = std::move(config);
  s.clock = clock ? clock : &s.real_clock;
  if (s.config.tls_cert_pem.empty() != s.config.tls_key_pem.empty())
    return absl::InvalidArgumentError("TLS needs both a certificate and a key");
  if (s.config.ca_cert_pem.empty() != s.config.ca_key_pem.empty())
    return absl::InvalidArgumentError("the CA needs both its certificate and its key");
  const bool with_ca = !s.config.ca_cert_pem.empty();
  if (with_ca && !s.config.worker_tokens.empty())
    return absl::InvalidArgumentError(
        "workers hold certificates of the coordinator's CA or worker tokens, not both: drop "
        "--worker_token_file, or run without a CA (--plaintext)");
  RETURN_IF_ERROR(CheckCoordinatorExposure(
      s.config.listen, s.config.worker_listen, !s.config.token.empty() || !s.config.users.empty(),
      with_ca || !s.config.worker_tokens.empty(), s.config.insecure));
  std::optional<CertificateAuthority> ca;
  if (with_ca) {
    ASSIGN_OR_RETURN(ca, CertificateAuthority::FromPem(s.config.ca_cert_pem, s.config.ca_key_pem));
  }
  if (!s.config.tls_cert_pem.empty()) {
    s.server_cert_pem = s.config.tls_cert_pem;
    s.server_key_pem = s.config.tls_key_pem;
  } else if (ca) {
    ASSIGN_OR_RETURN(KeyAndCertificate server,
                     ca->IssueServerCertificate(ServerNames(s.config), absl::Hours(24 * 365)));
    s.server_cert_pem = server.cert_pem;
    s.server_key_pem = server.key_pem;
  }
  // A coordinator that cannot start leaves no store behind that it created.
  const std::string db_path = s.config.db_path;
  std::error_code ec;
  const bool new_store = !std::filesystem::exists(db_path, ec);
  absl::Cleanup drop_new_store = [&] {
    if (!new_store) return;
    impl.reset();  // closes the store
    SqliteJobStore::RemoveFiles(db_path);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<SqliteJobStore> sqlite, SqliteJobStore::Open(s.config.db_path));
  IdentityStore* identities = sqlite.get();  // the same file; its writes are not the manager's
  s.sqlite_store = std::move(sqlite);
  JobManagerMetrics metrics;
  RETURN_IF_ERROR(s.SetUpMetrics(&metrics));
  JobStore* base = s.sqlite_store.get();
  if (s.config.wrap_store) {
    s.test_store = s.config.wrap_store(base);
    base = s.test_store.get();
  }
  s.store = std::make_unique<MonitoredJobStore>(base, s.store_errors,
                                                absl::Milliseconds(s.config.store_stall_ms));
  if (ca) {
    s.certificates = std::make_unique<WorkerCertificates>(
        *std::move(ca), s.config.bootstrap_tokens, identities, s.clock,
        s.config.worker_certificate_validity);
    RETURN_IF_ERROR(s.certificates->Load());
  }
  s.auth = std::make_unique<Credentials>(s.config.token, s.config.worker_tokens, s.config.users,
                                         s.certificates.get());

  grpc::EnableDefaultHealthCheckService(true);
  // The same address means one port, unless it asks for an ephemeral one (two then).
  const bool shared =
      s.config.worker_listen.empty() ||
      (s.config.worker_listen == s.config.listen && !absl::EndsWith(s.config.listen, ":0"));

  s.rendezvous = std::make_unique<RendezvousStore>(
      static_cast<size_t>(std::max<int64_t>(1, s.config.limits.max_rendezvous_keys)));
  s.manager = std::make_unique<JobManager>(s.store.get(), s.clock, &s.sessions, s.rendezvous.get(),
                                           s.config.manager, metrics);
  s.job_service = std::make_unique<JobServiceImpl>(s.manager.get(), s.auth.get(), s.config.limits);
  s.cluster_service = std::make_unique<ClusterServiceImpl>(
      s.manager.get(), &s.sessions, s.auth.get(), /*accepts_workers=*/true, s.config.limits);
  s.rendezvous_service =
      std::make_unique<RendezvousServiceImpl>(s.rendezvous.get(), s.auth.get(), s.config.limits);

  {
    grpc::ServerBuilder b;
    // gRPC binds with SO_REUSEPORT by default, so a second coordinator on a taken port would
    // start and take half of its connections; without it the bind fails.
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    b.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
    b.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
    b.AddListeningPort(s.config.listen, s.ListenCredentials(), &s.client_port);
    b.RegisterService(s.job_service.get());
    if (shared) {
      b.RegisterService(s.cluster_service.get());
      b.RegisterService(s.rendezvous_service.get());
    } else {
      s.client_cluster_service = std::make_unique<ClusterServiceImpl>(
          s.manager.get(), &s.sessions, s.auth.get(), /*accepts_workers=*/false);
      b.RegisterService(s.client_cluster_service.get());
    }
    s.client_server = b.BuildAndStart();
    if (!s.client_server || s.client_port == 0)
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", s.config.listen,
                       " (it is taken, is not HOST:PORT, or is not an address of this host)"));
  }
  if (shared) {
    s.worker_port = s.client_port;
  } else {
    grpc::ServerBuilder b;
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    b.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
    b.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
    b.AddListeningPort(s.config.worker_listen, s.ListenCredentials(), &s.worker_port);
    b.RegisterService(s.cluster_service.get());
    b.RegisterService(s.rendezvous_service.get());
    s.worker_server = b.BuildAndStart();
    if (!s.worker_server || s.worker_port == 0) {
      s.client_server->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", s.config.worker_listen,
                       " (it is taken, is not HOST:PORT, or is not an address of this host)"));
    }
  }
  // Without --advertise, assignments name no rendezvous address and each worker uses the address
  // it reaches this worker port at: whatever route it has to the coordinator, it has to this.
  if (s.config.manager.rendezvous_address.empty() && !s.config.advertise_address.empty())
    s.manager->SetRendezvousAddress(s.config.advertise_address);
  RETURN_IF_ERROR(s.manager->Recover());
  RETURN_IF_ERROR(s.manager->PruneFinishedJobs().status());

  if (s.config.metrics_port >= 0) {
    Impl* self = &s;
    s.metrics_server =
        std::make_unique<MetricsServer>(&s.registry, [self]() { self->RefreshGauges(); });
    absl::StatusOr<int> port =
        s.metrics_server->Start(s.config.metrics_host, s.config.metrics_port);
    if (!port.ok()) return port.status();
  }

  Impl* self = &s;
  // Health from the store's own state, every 200 ms: never behind the manager's mutex.
  s.health_watch = std::thread([self]() {
    bool serving = true;
    absl::MutexLock l(&self->mu);
    while (!self->stopping) {
      auto stop = [self]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu) { return self->stopping; };
      if (self->mu.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(200))) break;
      const std::string problem = self->store->Problem();
      if (problem.empty() == serving) continue;
      serving = problem.empty();
      for (grpc::Server* server : {self->client_server.get(), self->worker_server.get()})
        if (server != nullptr && server->GetHealthCheckService() != nullptr)
          server->GetHealthCheckService()->SetServingStatus(serving);
      std::fprintf(stderr, "coordinator: health %s%s\n",
                   serving ? "SERVING" : "NOT_SERVING: ", problem.c_str());
    }
  });
  s.ticker = std::thread([self]() {
    absl::Time next_prune = absl::Now() + absl::Milliseconds(self->config.prune_interval_ms);
    absl::MutexLock l(&self->mu);
    while (!self->stopping) {
      auto stop = [self]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu) { return self->stopping; };
      if (self->mu.AwaitWithTimeout(absl::Condition(&stop),
                                    absl::Milliseconds(self->config.tick_ms)))
        break;
      self->mu.Unlock();
      self->manager->Tick();
      if (absl::Now() >= next_prune) {
        // A store that refuses now is tried again at the next interval.
        if (absl::StatusOr<int64_t> n = self->manager->PruneFinishedJobs(); !n.ok())
          std::fprintf(stderr, "coordinator: pruning finished jobs: %s\n",
                       std::string(n.status().message()).c_str());
        next_prune = absl::Now() + absl::Milliseconds(self->config.prune_interval_ms);
      }
      self->mu.Lock();
    }
  });
  std::move(drop_new_store).Cancel();
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(std::move(impl)));
}

void CoordinatorServer::Shutdown() {
  Impl& s = *impl_;
  if (s.shut_down) return;
  s.shut_down = true;
  {
    absl::MutexLock l(&s.mu);
    s.stopping = true;
  }
  if (s.ticker.joinable()) s.ticker.join();
  if (s.health_watch.joinable()) s.health_watch.join();
  s.sessions.CloseAll();
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  if (s.worker_server) s.worker_server->Shutdown(deadline);
  if (s.client_server) s.client_server->Shutdown(deadline);
  if (s.metrics_server) s.metrics_server->Stop();
}

void CoordinatorServer::Wait() {
  absl::MutexLock l(&impl_->mu);
  auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) { return impl_->stopping; };
  impl_->mu.Await(absl::Condition(&stop));
}

int CoordinatorServer::client_port() const { return impl_->client_port; }
std::string CoordinatorServer::server_certificate_pem() const { return impl_->server_cert_pem; }
int CoordinatorServer::worker_port() const { return impl_->worker_port; }
int CoordinatorServer::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : 0;
}
JobManager* CoordinatorServer::manager() { return impl_->manager.get(); }
RendezvousStore* CoordinatorServer::rendezvous() { return impl_->rendezvous.get(); }

}  // namespace spindle
