// ClusterHarness: a real Spindle cluster on 127.0.0.1 for integration tests: the
// spindle-coordinator binary (SQLite file in a scratch directory), any number of spindle-worker
// daemons, and a JobService client. By default the way a cluster runs: TLS on every port, the
// coordinator's CA generated at its first start beside its database, and workers that join with
// a bootstrap token and then call with the client certificate the CA signed (mutual TLS).
// Optionally plaintext with bearer tokens instead (UsePlaintext), users' tokens, TLS with a given
// server certificate, a separate worker port and /metrics ports (set these before
// StartCoordinator). Processes are killed when the harness is destroyed.
// Thread-safety: owned and used by one test thread.
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "tests/integration/worker_test_util.h"

namespace spindle::testing {

// A TCP port on 127.0.0.1 that was free a moment ago.
inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

inline std::vector<pid_t> ProcessesWithAllArgs(const std::vector<std::string>& args,
                                               const std::string& scope) {
  std::vector<pid_t> out;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = ::readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    const std::string cmdline = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
    std::vector<std::string> argv;
    size_t start = 0;
    for (size_t i = 0; i < cmdline.size(); ++i) {
      if (cmdline[i] == '\0') {
        argv.push_back(cmdline.substr(start, i - start));
        start = i + 1;
      }
    }
    // `args` are (flag, value) pairs that must appear next to each other.
    bool all = !argv.empty();
    if (!scope.empty()) {  // some argument must lie under the test's own scratch directory
      bool in_scope = false;
      for (const std::string& a : argv) in_scope |= a.find(scope) != std::string::npos;
      all &= in_scope;
    }
    for (size_t a = 0; a + 1 < args.size(); a += 2) {
      bool found = false;
      for (size_t v = 0; v + 1 < argv.size(); ++v) {
        found |= argv[v] == args[a] && argv[v + 1] == args[a + 1];
      }
      all &= found;
    }
    if (all && ProcessAlive(pid)) out.push_back(pid);
  }
  ::closedir(proc);
  return out;
}

inline pid_t ParentPid(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  int ppid = 0;
  std::sscanf(stat.c_str() + paren + 2, "%*c %d", &ppid);
  return ppid;
}

// Pids of live processes whose command line has every (flag, value) pair of `args` and, when
// `scope` is set, an argument containing it (a test's scratch directory: job ids repeat across
// clusters that other tests on the machine may be running), leaving out momentary forks (a
// process whose parent is also in the set).
inline std::vector<pid_t> ProcessesWithArgs(const std::vector<std::string>& args,
                                            const std::string& scope = "") {
  std::vector<pid_t> all = ProcessesWithAllArgs(args, scope);
  std::vector<pid_t> out;
  for (pid_t pid : all) {
    if (std::find(all.begin(), all.end(), ParentPid(pid)) == all.end()) out.push_back(pid);
  }
  return out;
}

class ClusterHarness {
 public:
  explicit ClusterHarness(const ScratchDir* dir) : dir_(dir) {}
  ~ClusterHarness() {
    for (auto& [id, w] : workers_) {
      if (w != nullptr) w->Kill().IgnoreError();
    }
    if (coordinator_ != nullptr) coordinator_->Kill().IgnoreError();
  }

  // Client port (JobService; also the worker services unless UseSeparateWorkerPort()).
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  // The address workers and the rendezvous use.
  std::string worker_address() const {
    return absl::StrCat("127.0.0.1:", worker_port_ != 0 ? worker_port_ : port_);
  }

  // No CA: plaintext (unless UseTls) and workers with bearer tokens (--plaintext).
  void UsePlaintext() { plaintext_ = true; }
  bool plaintext() const { return plaintext_; }
  // The coordinator's CA certificate (written at its first start), which workers and clients
  // trust; "" with UsePlaintext.
  std::string ca_file() const {
    if (plaintext_) return "";
    return !ca_cert_file_.empty() ? ca_cert_file_ : dir_->File("spindle.db.ca.pem");
  }
  // The coordinator's CA from these files (--ca_cert, --ca_key) instead of one it generates.
  void UseCaFiles(const std::string& cert_file, const std::string& key_file) {
    ca_cert_file_ = cert_file;
    ca_key_file_ = key_file;
  }
  // The bootstrap token workers join with (in bootstrap_token_file(), valid for a day).
  std::string bootstrap_token_file() const { return dir_->File("bootstrap-token"); }

  // Every daemon and the harness's own client use `token` (written to a file under the scratch
  // directory and passed with --token_file; workers get it only with UsePlaintext).
  void UseToken(const std::string& token) {
    token_ = token;
    std::ofstream(dir_->File("token")) << token << "\n";
  }
  const std::string& token() const { return token_; }
  std::string token_file() const { return dir_->File("token"); }
  // Workers (and their trainers) get `token` of their own: the coordinator takes it with
  // --worker_token_file, workers with --token_file; users and the harness's client keep
  // UseToken's.
  void UseWorkerToken(const std::string& token) {
    worker_token_ = token;
    std::ofstream(worker_token_file()) << token << "\n";
  }
  std::string worker_token_file() const { return dir_->File("worker-token"); }
  // TLS on both coordinator ports with PEM files `cert_file` and `key_file`; workers and the
  // harness's client trust `ca_file`.
  void UseTls(const std::string& ca_file, const std::string& cert_file,
              const std::string& key_file) {
    tls_ca_file_ = ca_file;
    tls_cert_file_ = cert_file;
    tls_key_file_ = key_file;
  }
  // Workers (ClusterService, RendezvousService) on a port of their own.
  void UseSeparateWorkerPort() { separate_worker_port_ = true; }
  // /metrics of the coordinator on 127.0.0.1:`port` (default: off).
  void UseCoordinatorMetricsPort(int port) { coordinator_metrics_port_ = port; }

  // The CA file clients trust: UseTls's, else the coordinator's own; "" for plaintext.
  std::string client_ca_file() const { return !tls_ca_file_.empty() ? tls_ca_file_ : ca_file(); }
  // Credentials for a client of this cluster (TLS with client_ca_file() unless plaintext).
  std::shared_ptr<grpc::ChannelCredentials> ClientCredentials() const {
    if (client_ca_file().empty()) return grpc::InsecureChannelCredentials();
    grpc::SslCredentialsOptions opts;
    opts.pem_root_certs = ReadFile(client_ca_file());
    return grpc::SslCredentials(opts);
  }
  // Adds the bearer token (if any) to a call of the harness's client.
  void Authorize(grpc::ClientContext* ctx) const {
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  }

  // Starts (or restarts, same port and database) the coordinator and waits until it answers;
  // false when it exits first or does not answer within 30 s.
  bool StartCoordinator(const std::vector<std::string>& extra = {}) {
    if (port_ == 0) port_ = FreePort();
    if (separate_worker_port_ && worker_port_ == 0) worker_port_ = FreePort();
    std::vector<std::string> argv = {
        BinaryPath("SPINDLE_COORDINATOR_BINARY", SPINDLE_COORDINATOR_BINARY),
        "--listen=" + address(), "--advertise=" + worker_address(),
        "--db=" + dir_->File("spindle.db"),
        absl::StrCat("--metrics_port=", coordinator_metrics_port_)};
    if (separate_worker_port_) argv.push_back("--worker_listen=" + worker_address());
    if (plaintext_) {
      argv.push_back("--plaintext");
    } else {
      const std::string expires =
          absl::FormatTime(absl::RFC3339_sec, absl::Now() + absl::Hours(24), absl::UTCTimeZone());
      std::ofstream(bootstrap_token_file()) << "harness-bootstrap-token-0123456789\n";
      std::ofstream(dir_->File("bootstrap-tokens"))
          << "harness-bootstrap-token-0123456789 " << expires << "\n";
      argv.push_back("--bootstrap_token_file=" + dir_->File("bootstrap-tokens"));
      if (!ca_cert_file_.empty()) {
        argv.push_back("--ca_cert=" + ca_cert_file_);
        argv.push_back("--ca_key=" + ca_key_file_);
      }
    }
    if (!token_.empty()) argv.push_back("--token_file=" + token_file());
    if (!worker_token_.empty()) argv.push_back("--worker_token_file=" + worker_token_file());
    if (!tls_cert_file_.empty()) {
      argv.push_back("--tls_cert=" + tls_cert_file_);
      argv.push_back("--tls_key=" + tls_key_file_);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    coordinator_args_ = extra;
    SubprocessOptions options;
    options.stderr_path = dir_->File(absl::StrCat("coordinator-", ++coordinator_starts_, ".log"));
    auto p = Subprocess::Spawn(argv, options);
    if (!p.ok()) return false;
    coordinator_ = *std::move(p);
    // Dialled once the coordinator says it serves (it writes its CA before): a connection the
    // gRPC server accepts while it is still starting may wait seconds for its TLS handshake.
    const std::string log = options.stderr_path;
    if (!WaitFor(
            [&] {
              absl::StatusOr<std::optional<int>> status = coordinator_->Poll();
              return !status.ok() || status->has_value() ||
                     ReadFile(log).find("spindle-coordinator: serving clients") !=
                         std::string::npos;
            },
            std::chrono::seconds(30)))
      return false;
    // Retry a failed connection soon, not after gRPC's default backoff (which grows past 10 s).
    // (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS stays at its default: gRPC also takes it as the time a
    // connection attempt, TLS handshake included, may last.)
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    channel_ = grpc::CreateCustomChannel(address(), ClientCredentials(), args);
    worker_channel_ = grpc::CreateCustomChannel(worker_address(), ClientCredentials(), args);
    jobs_ = v1::JobService::NewStub(channel_);
    bool exited = false;
    const bool answered = WaitFor(
        [&] {
          absl::StatusOr<std::optional<int>> status = coordinator_->Poll();
          if (status.ok() && status->has_value()) return exited = true;
          v1::ListJobsRequest req;
          v1::ListJobsResponse resp;
          grpc::ClientContext ctx;
          Authorize(&ctx);
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
          return jobs_->List(&ctx, req, &resp).ok();
        },
        std::chrono::seconds(30));
    return answered && !exited;
  }
  void KillCoordinator() {
    if (coordinator_ != nullptr) coordinator_->Kill().IgnoreError();
    coordinator_.reset();
  }

  // Starts worker `id` with `slots` CPU slots running `trainer`; `env` is added to its
  // environment (inherited by its trainers); `extra` flags go last (a repeated flag wins).
  bool StartWorker(const std::string& id, int slots, const std::string& trainer,
                   const std::vector<std::pair<std::string, std::string>>& env = {},
                   const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {BinaryPath("SPINDLE_WORKER_BINARY", SPINDLE_WORKER_BINARY),
                                     "--coordinator=" + worker_address(),
                                     "--worker_id=" + id,
                                     absl::StrCat("--slots=", slots),
                                     "--work_dir=" + dir_->File("work-" + id),
                                     "--metrics_port=-1",
                                     "--kill_grace=2s",
                                     "--coordinator_loss_timeout=60s",
                                     "--cpu_threads_per_slot=1",
                                     "--trainer_binary=" + trainer,
                                     // In-memory replicas in the scratch directory, not /dev/shm.
                                     "--replica_dir=" + dir_->File("replicas-" + id),
                                     "--checkpoint_root=" + dir_->path(),
                                     "--data_root=" + dir_->path()};
    if (!plaintext_) {
      argv.push_back("--tls_ca_file=" + ca_file());
      argv.push_back("--bootstrap_token_file=" + bootstrap_token_file());
    } else if (!worker_token_.empty()) {
      argv.push_back("--token_file=" + worker_token_file());
    } else if (!token_.empty()) {
      argv.push_back("--token_file=" + token_file());
    }
    if (plaintext_ && !tls_ca_file_.empty()) argv.push_back("--tls_ca_file=" + tls_ca_file_);
    argv.insert(argv.end(), extra.begin(), extra.end());
    SubprocessOptions options;
    options.stderr_path = dir_->File("worker-" + id + ".log");
    options.env = env;
    auto p = Subprocess::Spawn(argv, options);
    if (!p.ok()) return false;
    workers_[id] = *std::move(p);
    return true;
  }
  pid_t WorkerPid(const std::string& id) { return workers_[id] ? workers_[id]->pid() : 0; }
  void KillWorker(const std::string& id) {
    if (workers_[id] != nullptr) workers_[id]->Kill().IgnoreError();
    workers_[id].reset();
  }

  // Sends `signal` to a worker daemon (SIGTERM: the shutdown an operator or Kubernetes starts).
  void SignalWorker(const std::string& id, int signal) {
    if (workers_[id] != nullptr) workers_[id]->Signal(signal).IgnoreError();
  }
  // The coordinator's workers (ListWorkers), or nullopt when it does not answer within 2 s.
  std::optional<v1::ListWorkersResponse> ListWorkers() {
    auto stub = v1::ClusterService::NewStub(worker_channel_);
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    Authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (!stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) return std::nullopt;
    return resp;
  }
  // The coordinator's state for worker `id` ("alive", "left", ...); "" when not listed.
  std::string WorkerState(const std::string& id) {
    const auto resp = ListWorkers();
    if (!resp) return "";
    for (const auto& w : resp->workers())
      if (w.worker_id() == id) return w.state();
    return "";
  }

  // Waits until `n` workers are registered and alive.
  bool WaitForWorkers(int n) {
    return WaitFor(
        [&] {
          const auto resp = ListWorkers();
          if (!resp) return false;
          int alive = 0;
          for (const auto& w : resp->workers()) alive += w.state() == "alive" ? 1 : 0;
          return alive >= n;
        },
        std::chrono::seconds(20));
  }

  // The coordinator's plan of `spec_json` (the Plan RPC), or its error.
  absl::StatusOr<v1::Plan> Plan(const std::string& spec_json) {
    v1::PlanJobRequest req;
    req.set_spec_json(spec_json);
    v1::PlanJobResponse resp;
    grpc::ClientContext ctx;
    Authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = jobs_->Plan(&ctx, req, &resp);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return resp.plan();
  }

  absl::StatusOr<std::string> Submit(const std::string& spec_json) {
    v1::SubmitJobRequest req;
    req.set_spec_json(spec_json);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    Authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = jobs_->Submit(&ctx, req, &resp);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return resp.job_id();
  }

  std::optional<v1::Job> Get(const std::string& job_id) {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::Job job;
    grpc::ClientContext ctx;
    Authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (!jobs_->Get(&ctx, req, &job).ok()) return std::nullopt;
    return job;
  }

  bool Cancel(const std::string& job_id) {
    v1::CancelJobRequest req;
    req.set_job_id(job_id);
    req.set_reason("test cancel");
    v1::CancelJobResponse resp;
    grpc::ClientContext ctx;
    Authorize(&ctx);
    return jobs_->Cancel(&ctx, req, &resp).ok();
  }

  // True once a job has ended: succeeded, failed or cancelled (a predicate for WaitJob).
  static bool Ended(const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
           j.state() == v1::JOB_STATE_CANCELLED;
  }

  // Waits for `pred(job)`; returns the last job seen.
  std::optional<v1::Job> WaitJob(const std::string& job_id,
                                 const std::function<bool(const v1::Job&)>& pred,
                                 std::chrono::seconds timeout) {
    std::optional<v1::Job> last;
    WaitFor(
        [&] {
          if (auto j = Get(job_id)) last = j;
          return last.has_value() && pred(*last);
        },
        timeout);
    return last;
  }

  // Every log written so far, for failure messages.
  std::string Logs() {
    std::string out;
    for (const auto& entry : std::filesystem::directory_iterator(dir_->path())) {
      if (entry.path().extension() == ".log") {
        out += "==== " + entry.path().filename().string() + "\n" + ReadFile(entry.path());
      }
    }
    return out;
  }

  static std::string Events(const v1::Job& job) {
    std::string out;
    for (const auto& e : job.events()) absl::StrAppend(&out, e.attempt(), ": ", e.message(), "\n");
    return out;
  }

 private:
  const ScratchDir* dir_;
  int port_ = 0;
  int worker_port_ = 0;
  bool separate_worker_port_ = false;
  int coordinator_metrics_port_ = -1;
  bool plaintext_ = false;
  std::string ca_cert_file_, ca_key_file_;
  std::string token_;
  std::string worker_token_;
  std::string tls_ca_file_, tls_cert_file_, tls_key_file_;
  int coordinator_starts_ = 0;
  std::vector<std::string> coordinator_args_;
  std::unique_ptr<Subprocess> coordinator_;
  std::map<std::string, std::unique_ptr<Subprocess>> workers_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<grpc::Channel> worker_channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

}  // namespace spindle::testing
