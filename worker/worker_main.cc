// spindle-worker: the worker daemon. Registers with the coordinator, keeps the Session stream,
// runs one spindle-train process per assigned rank and serves Prometheus metrics. See
// worker/README.md for the flags and the trainer contract.
#include <limits.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/daemon_flags.h"
#include "common/host_cores.h"
#include "common/host_port.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/status.h"
#include "worker/coordinator_session.h"
#include "worker/device_discovery.h"
#include "worker/grpc_client.h"
#include "worker/path_roots.h"
#include "worker/rank_runner.h"
#include "worker/rate_report.h"
#include "worker/replica_dirs.h"
#include "worker/shutdown_signal.h"
#include "worker/worker_identity.h"
#include "worker/worker_log.h"
#include "worker/worker_metrics.h"

ABSL_FLAG(std::string, coordinator, "", "Coordinator address HOST:PORT (required).");
ABSL_FLAG(std::string, worker_id, "", "Stable worker id (default: the hostname).");
ABSL_FLAG(int, slots, 0,
          "CPU slots to offer (ranks run at once). 0: the GPUs if any are visible, else 1 slot.");
ABSL_FLAG(std::string, work_dir, "", "Directory for job specs and trainer logs "
                                     "(default: $TMPDIR/spindle-worker-<worker id>).");
ABSL_FLAG(int, metrics_port, 9401, "Port of the /metrics endpoint; 0: any free port; -1: off.");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "Address the /metrics endpoint binds (default loopback only; 0.0.0.0 or the pod IP to "
          "let Prometheus on another host scrape it).");
ABSL_FLAG(std::string, advertise_host, "",
          "Address other hosts reach this worker at: its ranks' Gloo address and its /metrics "
          "(default: the address the coordinator sees this worker connect from).");
ABSL_FLAG(std::string, gloo_host, "",
          "Address this worker's trainers bind for Gloo and give their peers (default: "
          "--advertise_host when set, else the address the coordinator sees this worker at).");
ABSL_FLAG(std::string, token_file, "",
          "File holding the worker's bearer token, for a coordinator without a CA (--plaintext).");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM certificate of the coordinator's CA: talk TLS to the coordinator and, with a "
          "certificate in --identity-dir or --bootstrap-token-file, be who this worker's client "
          "certificate says (mutual TLS).");
ABSL_FLAG(std::string, bootstrap_token_file, "",
          "File holding a bootstrap token: without a usable certificate in --identity-dir the "
          "worker joins with it (a new key and a certificate request for its id, signed by the "
          "coordinator's CA).");
ABSL_FLAG(std::string, identity_dir, "",
          "Directory of the worker's key (key.pem) and certificate (cert.pem) (default: "
          "<work dir>/identity).");
ABSL_FLAG(absl::Duration, coordinator_loss_timeout, absl::Seconds(60),
          "Kill every trainer once no heartbeat was acknowledged by the coordinator for this "
          "long, or for the coordinator's heartbeat timeout when that is shorter (fencing).");
ABSL_FLAG(absl::Duration, kill_grace, absl::Seconds(10),
          "Time between SIGTERM and SIGKILL when stopping a trainer (unless the stop names one).");
ABSL_FLAG(std::string, trainer_binary, "",
          "Path of spindle-train (default: spindle-train next to this executable).");
ABSL_FLAG(std::string, checkpoint_root, spindle::kDefaultCheckpointRoot,
          "Directory every job's checkpoint.dir must lie in (after resolving symbolic links); a "
          "rank whose checkpoint.dir is outside it, or has a \"..\" component, exits with code 2 "
          "before its trainer starts.");
ABSL_FLAG(std::string, data_root, spindle::kDefaultDataRoot,
          "Directory every job's data file (data.source tokens:<path> or text:<path>) must lie "
          "in, checked like --checkpoint-root.");
ABSL_FLAG(std::string, replica_dir, "",
          "Directory (on tmpfs: RAM) where the ranks of jobs with checkpoint.replicas keep their "
          "in-memory replicas, emptied at start (default: /dev/shm/spindle-replicas-<worker id>, "
          "or <work dir>/replicas without /dev/shm; \"off\": this worker's ranks keep none).");
ABSL_FLAG(int, cpu_threads_per_slot, 0,
          "OMP_NUM_THREADS for CPU ranks (0: hardware threads / slots).");
ABSL_FLAG(bool, probe_rates, false,
          "Measure the CPU kernel rates and the local link (loopback, or ranks sharing one GPU) "
          "at start (about a second, every core busy) and report them for the planner's cost "
          "model; false: the planner uses its built-in rates. "
          "scripts/run.sh and the Kubernetes manifests turn it on; off by default so that a "
          "daemon restarted in a loop starts at once.");

namespace spindle {
namespace {

std::string Hostname() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string DefaultTrainerBinary() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "spindle-train";
  return (self.parent_path() / "spindle-train").string();
}

// The numeric flags a typo could make meaningless, each refused by name.
absl::Status CheckNumericFlags() {
  RETURN_IF_ERROR(CheckMetricsPortFlag(absl::GetFlag(FLAGS_metrics_port)));
  if (const int t = absl::GetFlag(FLAGS_cpu_threads_per_slot); t < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-threads-per-slot must be >= 0 (0: hardware threads / slots), got ", t));
  }
  if (const absl::Duration d = absl::GetFlag(FLAGS_coordinator_loss_timeout);
      d <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--coordinator-loss-timeout must be a positive duration, got ", absl::FormatDuration(d)));
  }
  if (const absl::Duration d = absl::GetFlag(FLAGS_kill_grace); d < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kill-grace must not be negative, got ", absl::FormatDuration(d)));
  }
  RETURN_IF_ERROR(CheckRootFlag("--checkpoint-root", absl::GetFlag(FLAGS_checkpoint_root)));
  RETURN_IF_ERROR(CheckRootFlag("--data-root", absl::GetFlag(FLAGS_data_root)));
  return absl::OkStatus();
}

int Main() {
  // Before any thread exists, so every thread inherits the blocked SIGTERM/SIGINT.
  absl::StatusOr<ShutdownSignal> shutdown = ShutdownSignal::Create();
  if (!shutdown.ok()) {
    std::fprintf(stderr, "spindle-worker: %s\n", shutdown.status().ToString().c_str());
    return 1;
  }
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) {
    std::fprintf(stderr, "spindle-worker: --coordinator HOST:PORT is required\n");
    return 2;
  }
  if (absl::Status a = CheckHostPort("--coordinator", coordinator); !a.ok()) {
    std::fprintf(stderr, "spindle-worker: %s\n", std::string(a.message()).c_str());
    return 2;
  }
  if (absl::Status flags = CheckNumericFlags(); !flags.ok()) {
    std::fprintf(stderr, "spindle-worker: %s\n", std::string(flags.message()).c_str());
    return 2;
  }
  const std::string hostname = Hostname();
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) worker_id = hostname;

  std::string gpu_note;
  absl::StatusOr<v1::DeviceGroup> devices = DiscoverDevices(absl::GetFlag(FLAGS_slots), &gpu_note);
  if (!devices.ok()) {
    std::fprintf(stderr, "spindle-worker: %s\n", std::string(devices.status().message()).c_str());
    return 2;
  }
  if (!gpu_note.empty()) WorkerLog("GPUs not offered, one CPU slot instead: %s", gpu_note);
  absl::StatusOr<std::string> token = ReadTokenFile(absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    std::fprintf(stderr, "spindle-worker: --token-file: %s\n",
                 std::string(token.status().message()).c_str());
    return 2;
  }
  std::string trainer = absl::GetFlag(FLAGS_trainer_binary);
  if (trainer.empty()) trainer = DefaultTrainerBinary();
  {
    std::error_code ec;
    std::filesystem::path abs = std::filesystem::absolute(trainer, ec);
    if (!ec) trainer = abs.string();
  }
  // Every rank would fail to start (and its gang restart) on a worker without its trainer.
  if (std::error_code ec;
      !std::filesystem::is_regular_file(trainer, ec) || ::access(trainer.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "spindle-worker: --trainer-binary: %s is not an executable file\n",
                 trainer.c_str());
    return 2;
  }
  std::string work_dir = absl::GetFlag(FLAGS_work_dir);
  if (work_dir.empty()) {
    work_dir = (std::filesystem::temp_directory_path() / absl::StrCat("spindle-worker-", worker_id))
                   .string();
  }
  {
    std::error_code ec;
    std::filesystem::create_directories(work_dir, ec);
    if (ec) {
      std::fprintf(stderr, "spindle-worker: --work-dir %s: %s\n", work_dir.c_str(),
                   ec.message().c_str());
      return 2;
    }
    work_dir = std::filesystem::absolute(work_dir, ec).string();
  }

  MetricsRegistry registry;
  absl::StatusOr<std::unique_ptr<WorkerMetrics>> metrics = WorkerMetrics::Create(&registry);
  if (!metrics.ok()) {
    std::fprintf(stderr, "spindle-worker: metrics: %s\n", metrics.status().ToString().c_str());
    return 1;
  }
  (*metrics)->SetSlots(devices->count());
  (*metrics)->SetDeviceMemory(devices->memory_bytes());
  WorkerMetrics* worker_metrics = metrics->get();
  MetricsServer metrics_server(&registry, [worker_metrics] { worker_metrics->RefreshSelf(); });
  std::string metrics_address;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    absl::StatusOr<int> port =
        metrics_server.Start(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
    if (!port.ok()) {
      std::fprintf(stderr, "spindle-worker: --metrics-port: %s\n",
                   port.status().ToString().c_str());
      return 2;
    }
    // Without --advertise-host the coordinator puts in the address it sees this worker at.
    const std::string advertise = absl::GetFlag(FLAGS_advertise_host);
    metrics_address = absl::StrCat(advertise, ":", *port);
    WorkerLog("metrics on %s:%d/metrics", absl::GetFlag(FLAGS_metrics_host), *port);
  }

  // With the CA and a certificate (or a bootstrap token to get one) the worker is who its
  // certificate says; its trainers then get only their attempt's rendezvous token (and the CA to
  // check the coordinator with). Without either it talks TLS without a client certificate (a
  // coordinator without a CA, --plaintext with --tls-cert) and authenticates by --token-file.
  const std::string tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  std::string identity_dir = absl::GetFlag(FLAGS_identity_dir);
  if (identity_dir.empty()) identity_dir = (std::filesystem::path(work_dir) / "identity").string();
  std::error_code exists_ec;
  const bool certified =
      !tls_ca_file.empty() &&
      (!absl::GetFlag(FLAGS_bootstrap_token_file).empty() ||
       std::filesystem::exists(std::filesystem::path(identity_dir) / "cert.pem", exists_ec));
  if (!absl::GetFlag(FLAGS_bootstrap_token_file).empty() && tls_ca_file.empty()) {
    std::fprintf(stderr,
                 "spindle-worker: --bootstrap-token-file needs --tls-ca-file (the "
                 "coordinator's CA certificate)\n");
    return 2;
  }
  WorkerIdentity identity;
  if (certified) {
    WorkerIdentityOptions id_options;
    id_options.coordinator_address = coordinator;
    id_options.tls_ca_file = tls_ca_file;
    id_options.worker_id = worker_id;
    id_options.identity_dir = identity_dir;
    id_options.bootstrap_token_file = absl::GetFlag(FLAGS_bootstrap_token_file);
    absl::StatusOr<WorkerIdentity> obtained = ObtainWorkerIdentity(id_options);
    if (!obtained.ok()) {
      std::fprintf(stderr, "spindle-worker: worker certificate: %s\n",
                   std::string(obtained.status().message()).c_str());
      return absl::IsUnavailable(obtained.status()) ? 1 : 2;
    }
    identity = *std::move(obtained);
    WorkerLog("worker certificate for %s %s %s", worker_id,
              identity.joined ? "signed at join, kept in" : "from", id_options.identity_dir);
  }

  int threads = absl::GetFlag(FLAGS_cpu_threads_per_slot);
  if (threads <= 0 && devices->kind() == "cpu") {
    threads = std::max(1, static_cast<int>(HostCores()) / devices->count());
  }
  SessionOptions session_options;
  session_options.coordinator_address = coordinator;
  session_options.tls_ca_file = tls_ca_file;
  session_options.tls_client_cert_pem = identity.cert_pem;
  session_options.tls_client_key_pem = identity.key_pem;
  session_options.bearer_token = certified ? "" : *token;
  session_options.worker_id = worker_id;
  session_options.hostname = hostname;
  session_options.metrics_address = metrics_address;
  session_options.version = "spindle-worker 0.1";
  session_options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  session_options.roots = {absl::GetFlag(FLAGS_checkpoint_root), absl::GetFlag(FLAGS_data_root)};
  session_options.instance_id = absl::StrCat(absl::Hex(std::random_device{}(), absl::kZeroPad8),
                                             absl::Hex(::getpid(), absl::kZeroPad8));
  if (absl::GetFlag(FLAGS_probe_rates)) {
    if (absl::Status probed = ReportRates(trainer, threads, &*devices); !probed.ok())
      WorkerLog("device rates not measured (the planner uses built-in ones): %s",
                probed.message());
  }
  session_options.devices = {*devices};
  session_options.loss_timeout = absl::GetFlag(FLAGS_coordinator_loss_timeout);
  session_options.stop_grace = absl::GetFlag(FLAGS_kill_grace);
  CoordinatorSession session(session_options, worker_metrics);

  RankRunnerOptions runner_options;
  runner_options.work_dir = work_dir;
  runner_options.trainer_binary = trainer;
  runner_options.token_file = certified ? "" : absl::GetFlag(FLAGS_token_file);
  runner_options.gloo_host = absl::GetFlag(FLAGS_gloo_host);
  if (runner_options.gloo_host.empty()) runner_options.gloo_host = absl::GetFlag(FLAGS_advertise_host);
  runner_options.coordinator_address = coordinator;
  runner_options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  runner_options.cpu_threads_per_rank = threads;
  runner_options.cpu_passive_wait =
      devices->kind() == "cpu" && PassiveWaitForRanks(devices->count(), threads, HostCores());
  runner_options.roots = session_options.roots;
  runner_options.supervisor.kill_grace = absl::GetFlag(FLAGS_kill_grace);
  runner_options.worker_id = worker_id;
  runner_options.replica_dir = absl::GetFlag(FLAGS_replica_dir);
  if (runner_options.replica_dir.empty())
    runner_options.replica_dir = DefaultReplicaDir(worker_id, work_dir);
  if (runner_options.replica_dir == "off") runner_options.replica_dir.clear();
  if (!runner_options.replica_dir.empty()) {
    if (absl::Status reset = ResetReplicaDir(runner_options.replica_dir); !reset.ok()) {
      std::fprintf(stderr, "spindle-worker: %s\n", std::string(reset.message()).c_str());
      return 2;
    }
  }
  RankRunner runner(runner_options, worker_metrics, &session);

  WorkerLog(
      "worker %s: %d %s device(s) (%s), work dir %s, trainer %s, checkpoints under %s, "
      "data under %s, in-memory replicas in %s",
      worker_id, devices->count(), devices->kind(), devices->name(), work_dir, trainer,
      runner_options.roots.checkpoint_root, runner_options.roots.data_root,
      runner_options.replica_dir.empty() ? "none" : runner_options.replica_dir);
  session.Start(&runner);

  const int sig = shutdown->Wait();
  WorkerLog("received signal %d: stopping %d trainer(s)", sig,
            static_cast<int>(runner.running_count()));
  // The coordinator hears of the shutdown before the trainers' exits (one ordered stream), so it
  // names the shutdown as their cause and places nothing more here.
  v1::WorkerMessage leaving;
  leaving.mutable_leaving()->set_reason(absl::StrCat("received signal ", sig));
  session.Send(std::move(leaving));
  runner.Shutdown();  // every exit is queued for the coordinator
  session.Shutdown(absl::Seconds(5));
  metrics_server.Stop();
  WorkerLog("stopped");
  return 0;
}

}  // namespace
}  // namespace spindle

int main(int argc, char** argv) {
  spindle::ParseDaemonFlags(
      argc, argv, "runs the training ranks the coordinator places on this machine.",
      "spindle-worker --coordinator HOST:PORT [--slots N] [--work-dir DIR] [--metrics-port P] "
      "[flags]",
      "worker/worker_main.cc");
  return spindle::Main();
}
