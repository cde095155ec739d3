// RankRunner (see rank_runner.h).
#include "worker/rank_runner.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/exit_codes.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/text_bounds.h"
#include "planner/plan_proto.h"
#include "worker/parity_note.h"
#include "worker/replica_dirs.h"
#include "worker/trainer_event.h"

namespace spindle {
namespace {

std::string RankName(const v1::RankRef& ref) {
  return absl::StrCat(ref.job_id(), "/", ref.attempt(), "/", ref.rank());
}

bool SameRank(const v1::RankRef& a, const v1::RankRef& b) {
  return a.job_id() == b.job_id() && a.attempt() == b.attempt() && a.rank() == b.rank();
}

// Writes `contents` to `path` atomically (temporary file in the same directory, then rename).
absl::Status WriteFileAtomically(const std::filesystem::path& path, const std::string& contents) {
  const std::filesystem::path tmp =
      path.parent_path() / absl::StrCat(".", path.filename().string(), ".", ::getpid(), ".",
                                        reinterpret_cast<uintptr_t>(&contents), ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << contents;
    out.flush();
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", tmp.string()));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return absl::InternalError(absl::StrCat("cannot rename to ", path.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

std::string ExitReason(const ProcessExit& exit) {
  if (exit.stop_requested) return "stopped";
  if (exit.term_signal > 0) return "signal";
  return exit.exit_code == 0 ? "success" : "error";
}

}  // namespace

absl::Status ValidateJobIdForPath(const std::string& job_id) {
  if (job_id.empty() || job_id.size() > 200 || job_id == "." || job_id == "..") {
    return absl::InvalidArgumentError(absl::StrCat("assignment: job_id: unusable: \"", job_id, "\""));
  }
  for (char c : job_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("assignment: job_id: \"", job_id, "\" has a character other than [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

RankRunner::RankRunner(RankRunnerOptions options, WorkerMetrics* metrics, MessageSink* sink)
    : options_(std::move(options)),
      metrics_(metrics),
      sink_(sink),
      supervisor_(std::make_unique<ProcessSupervisor>(options_.supervisor, this)) {}

RankRunner::~RankRunner() { Shutdown(); }

void RankRunner::Shutdown() { supervisor_->Shutdown(); }

std::string TrainerVisibleDevice(int64_t device_index, const char* daemon_visible) {
  if (daemon_visible != nullptr && *daemon_visible != '\0') {
    const std::vector<std::string> ids = absl::StrSplit(daemon_visible, ',');
    if (device_index >= 0 && device_index < static_cast<int64_t>(ids.size())) {
      const std::string id(absl::StripAsciiWhitespace(ids[device_index]));
      if (!id.empty()) return id;
    }
  }
  return absl::StrCat(device_index);
}

absl::StatusOr<std::vector<std::string>> RankRunner::TrainerArgv(
    const v1::Assignment& a, const std::string& job_path, const std::string& replica_root) const {
  std::vector<std::string> argv = {
      options_.trainer_binary,
      "--planned-job",
      job_path,
      "--rank",
      absl::StrCat(a.ref().rank()),
      "--rendezvous",
      a.rendezvous_address().empty() ? options_.coordinator_address : a.rendezvous_address(),
      "--job-id",
      a.ref().job_id(),
      "--attempt",
      absl::StrCat(a.ref().attempt())};
  // The coordinator's record of the job's last checkpoint: the ranks resume from it or newer.
  if (a.resume_step() > 0) {
    argv.push_back("--resume-step");
    argv.push_back(absl::StrCat(a.resume_step()));
  }
  if (!options_.token_file.empty()) {
    argv.push_back("--token-file");
    argv.push_back(options_.token_file);
  }
  // The daemon's --gloo-host, else the address the coordinator knows this worker by (the one it
  // connected from: other hosts reach it there).
  const std::string& gloo_host = options_.gloo_host.empty() ? a.host_address() : options_.gloo_host;
  if (!gloo_host.empty()) {
    argv.push_back("--gloo-host");
    argv.push_back(gloo_host);
  }
  if (options_.pulse_ms > 0) {
    argv.push_back("--pulse-ms");
    argv.push_back(absl::StrCat(options_.pulse_ms));
  }
  if (!replica_root.empty()) {
    argv.push_back("--replica-dir");
    argv.push_back(replica_root);
    argv.push_back("--replica-host");
    argv.push_back(options_.worker_id);
  }
  for (const std::string& extra : options_.extra_trainer_args) argv.push_back(extra);
  return argv;
}

void RankRunner::ReportLaunchFailure(const v1::RankRef& ref, const absl::Status& status,
                                     int exit_code) {
  if (metrics_ != nullptr) metrics_->OnTrainerExit("launch_failed");
  v1::WorkerMessage msg;
  v1::RankExit* exit = msg.mutable_rank_exit();
  *exit->mutable_ref() = ref;
  exit->set_exit_code(exit_code);
  exit->set_signal(0);
  exit->add_stderr_tail(
      BoundedUtf8(absl::StrCat("worker: cannot start trainer: ", status.message()), kMaxNoteBytes));
  sink_->Send(std::move(msg));
}

absl::Status RankRunner::Start(const v1::Assignment& a) {
  absl::MutexLock start_lock(&start_mu_);
  const v1::RankRef& ref = a.ref();
  RETURN_IF_ERROR(ValidateJobIdForPath(ref.job_id()));
  // The job as the coordinator planned it, read once here (the trainer reads its own copy).
  absl::StatusOr<PlannedJob> job = PlannedJobFromProto(a.job());
  if (!job.ok()) {
    const absl::Status status = absl::InvalidArgumentError(
        absl::StrCat("assignment ", RankName(ref), ": ", job.status().message()));
    ReportLaunchFailure(ref, status, kExitInvalidInput);
    return status;
  }
  const int64_t world = job->spec.parallel.world();
  if (ref.attempt() < 1 || ref.rank() < 0 || ref.rank() >= world) {
    absl::Status status = absl::InvalidArgumentError(absl::StrCat(
        "assignment ", RankName(ref), ": bad attempt, rank or world (world ", world, ")"));
    ReportLaunchFailure(ref, status);
    return status;
  }
  if (absl::Status paths = CheckJobPaths(job->spec, options_.roots); !paths.ok()) {
    ReportLaunchFailure(ref, paths, kExitInvalidInput);
    return paths;
  }
  // Already running (a re-sent assignment, e.g. after a reconnect): confirm it again.
  // Ranks of older attempts of this job are stale: the coordinator has moved on.
  std::vector<ProcessId> stale;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, rank] : ranks_) {
      if (SameRank(rank.ref, ref)) {
        v1::WorkerMessage msg;
        *msg.mutable_rank_started()->mutable_ref() = ref;
        msg.mutable_rank_started()->set_pid(rank.pid);
        sink_->Send(std::move(msg));
        return absl::OkStatus();
      }
      if (rank.ref.job_id() == ref.job_id() && rank.ref.attempt() < ref.attempt()) {
        stale.push_back(id);
      }
    }
  }
  for (ProcessId id : stale) supervisor_->Stop(id, absl::ZeroDuration()).IgnoreError();

  const std::filesystem::path dir = std::filesystem::path(options_.work_dir) / ref.job_id() /
                                    absl::StrCat(ref.attempt());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    absl::Status status = absl::InternalError(
        absl::StrCat("cannot create work directory ", dir.string(), ": ", ec.message()));
    ReportLaunchFailure(ref, status);
    return status;
  }
  const std::filesystem::path job_path = dir / "planned_job.pb";
  if (absl::Status s = WriteFileAtomically(job_path, a.job().SerializeAsString()); !s.ok()) {
    ReportLaunchFailure(ref, s);
    return s;
  }
  // checkpoint.replicas: the job's directory in this worker's replica directory.
  std::string replica_root;
  if (!options_.replica_dir.empty() && job->spec.checkpoint.replicas_every > 0) {
    std::set<std::string> running;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, rank] : ranks_) running.insert(rank.ref.job_id());
    }
    running.erase(ref.job_id());
    replica_root = ReplicaJobRoot(options_.replica_dir, ref.job_id(), running);
  }
  absl::StatusOr<std::vector<std::string>> argv = TrainerArgv(a, job_path.string(), replica_root);
  if (!argv.ok()) {
    ReportLaunchFailure(ref, argv.status());
    return argv.status();
  }
  ProcessSpec spec;
  spec.argv = *std::move(argv);
  spec.working_dir = dir.string();
  spec.stderr_log_path = (dir / absl::StrCat("rank-", ref.rank(), ".stderr.log")).string();
  spec.extra_env.push_back(absl::StrCat("SPINDLE_RENDEZVOUS_TOKEN=", a.rendezvous_token()));
  if (!options_.tls_ca_file.empty()) {
    spec.extra_env.push_back(absl::StrCat("SPINDLE_TLS_CA_FILE=", options_.tls_ca_file));
  }
  if (job->spec.resources == "cuda") {
    spec.extra_env.push_back(absl::StrCat(
        "CUDA_VISIBLE_DEVICES=",
        TrainerVisibleDevice(a.device_index(), std::getenv("CUDA_VISIBLE_DEVICES"))));
  } else {
    if (options_.cpu_threads_per_rank > 0 && std::getenv("OMP_NUM_THREADS") == nullptr)
      spec.extra_env.push_back(absl::StrCat("OMP_NUM_THREADS=", options_.cpu_threads_per_rank));
    if (options_.cpu_passive_wait && std::getenv("OMP_WAIT_POLICY") == nullptr)
      spec.extra_env.push_back("OMP_WAIT_POLICY=passive");
  }

  // The rank is registered (and RankStarted sent) on the supervisor thread before any output or
  // exit of the trainer can be delivered.
  absl::StatusOr<LaunchedProcess> launched =
      supervisor_->Launch(spec, [this, &ref](const LaunchedProcess& p) {
        {
          absl::MutexLock lock(&mu_);
          ranks_[p.id] = Rank{ref, p.pid, 0};
          UpdateRunningGauge();
        }
        if (metrics_ != nullptr) metrics_->OnRankStarted(ref.job_id(), ref.attempt(), ref.rank());
        v1::WorkerMessage msg;
        *msg.mutable_rank_started()->mutable_ref() = ref;
        msg.mutable_rank_started()->set_pid(p.pid);
        sink_->Send(std::move(msg));
      });
  if (!launched.ok()) {
    ReportLaunchFailure(ref, launched.status());
    return launched.status();
  }
  return absl::OkStatus();
}

int RankRunner::Stop(const std::string& job_id, int64_t attempt, absl::Duration grace) {
  std::vector<ProcessId> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, rank] : ranks_) {
      if (rank.ref.job_id() == job_id && (attempt == 0 || rank.ref.attempt() == attempt)) {
        ids.push_back(id);
      }
    }
  }
  int stopped = 0;
  for (ProcessId id : ids) stopped += supervisor_->Stop(id, grace).ok() ? 1 : 0;
  return stopped;
}

int RankRunner::StopAll(absl::Duration grace) {
  std::vector<ProcessId> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, rank] : ranks_) ids.push_back(id);
  }
  int stopped = 0;
  for (ProcessId id : ids) stopped += supervisor_->Stop(id, grace).ok() ? 1 : 0;
  return stopped;
}

std::vector<v1::RunningRank> RankRunner::Running() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::RunningRank> out;
  for (const auto& [id, rank] : ranks_) {
    v1::RunningRank r;
    *r.mutable_ref() = rank.ref;
    r.set_step(rank.step);
    r.set_pid(rank.pid);
    r.set_pulsing(rank.pulsing);
    r.set_loss(rank.loss);
    if (rank.pulsing)
      r.set_silent_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - rank.last_line)
                          .count());
    out.push_back(std::move(r));
  }
  return out;
}

size_t RankRunner::running_count() const {
  absl::MutexLock lock(&mu_);
  return ranks_.size();
}

void RankRunner::UpdateRunningGauge() {
  if (metrics_ != nullptr) metrics_->SetRunningRanks(static_cast<int64_t>(ranks_.size()));
}

void RankRunner::OnStdoutLine(ProcessId id, std::string_view line) {
  absl::StatusOr<TrainerEvent> event = ParseTrainerEvent(line);
  if (!event.ok()) return;  // not a progress line: the trainer may print other text
  v1::RankRef ref;
  pid_t pid = 0;
  int64_t resumed_from = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = ranks_.find(id);
    if (it == ranks_.end()) return;
    it->second.last_line = std::chrono::steady_clock::now();
    if (event->kind == TrainerEventKind::kPulse) {
      it->second.pulsing = true;
      return;
    }
    if (event->kind == TrainerEventKind::kStep && event->loss) it->second.loss = *event->loss;
    if (event->kind == TrainerEventKind::kStart && event->resumed_from_step)
      it->second.resumed_from = std::max<int64_t>(0, *event->resumed_from_step);
    resumed_from = it->second.resumed_from;
    if (event->step && (event->kind == TrainerEventKind::kStep ||
                        event->kind == TrainerEventKind::kStart ||
                        event->kind == TrainerEventKind::kDone)) {
      it->second.step = std::max(it->second.step, *event->step);
    }
    ref = it->second.ref;
    pid = it->second.pid;
  }
  if (metrics_ != nullptr) metrics_->OnTrainerEvent(ref.job_id(), ref.rank(), *event, pid);
  v1::WorkerMessage msg;
  switch (event->kind) {
    case TrainerEventKind::kStep: {
      v1::RankProgress* p = msg.mutable_rank_progress();
      *p->mutable_ref() = ref;
      p->set_step(event->step.value_or(0));
      p->set_total_steps(event->total_steps.value_or(0));
      p->set_loss(event->loss.value_or(0.0));
      p->set_tokens_per_s(event->tokens_per_s.value_or(0.0));
      p->set_lr(event->lr.value_or(0.0));
      p->set_grad_norm(event->grad_norm.value_or(0.0));
      p->set_elapsed_s(event->elapsed_s.value_or(0.0));
      p->set_mfu(event->mfu.value_or(0.0));
      p->set_resumed_from_step(resumed_from);
      // The device peak of a GPU rank, else the trainer's resident host memory.
      double memory = event->mem_peak_bytes.value_or(event->host_rss_bytes.value_or(0.0));
      if (memory <= 0 && pid > 0) {
        if (absl::StatusOr<int64_t> rss = ReadRssBytes(pid); rss.ok()) memory = *rss;
      }
      p->set_memory_bytes(memory);
      if (!event->moe.empty()) {
        v1::MoeStatus* m = p->mutable_moe();
        m->set_bias_min(event->moe[0].bias_min);
        m->set_bias_max(event->moe[0].bias_max);
        double lse_sq = 0.0;
        for (const MoeLayerStat& l : event->moe) {
          m->set_load_max_over_mean(std::max(m->load_max_over_mean(), l.load_max_over_mean));
          m->set_bias_min(std::min(m->bias_min(), l.bias_min));
          m->set_bias_max(std::max(m->bias_max(), l.bias_max));
          lse_sq += l.router_lse_sq / static_cast<double>(event->moe.size());
        }
        m->set_router_z_loss(lse_sq);
        for (const CommStat& c : event->comm)
          if (c.layer_type == "moe") {
            m->set_dispatch_bytes(m->dispatch_bytes() + c.bytes);
            m->set_dispatch_s(m->dispatch_s() + c.seconds);
          }
      }
      break;
    }
    case TrainerEventKind::kCheckpoint: {
      v1::CheckpointDone* c = msg.mutable_checkpoint_done();
      *c->mutable_ref() = ref;
      c->set_step(event->step.value_or(0));
      c->set_path(BoundedUtf8(event->path, kMaxPathBytes));
      break;
    }
    case TrainerEventKind::kNote: {
      v1::RankNote* n = msg.mutable_note();
      *n->mutable_ref() = ref;
      n->set_text(BoundedUtf8(event->message, kMaxNoteBytes));
      break;
    }
    case TrainerEventKind::kParity: {
      // The parity canary's verdict, rank 0's, among the job's events (parity_note.h).
      std::optional<std::string> text = ParityNoteText(*event, ref.rank());
      if (!text) return;
      v1::RankNote* n = msg.mutable_note();
      *n->mutable_ref() = ref;
      n->set_text(BoundedUtf8(*text, kMaxNoteBytes));
      break;
    }
    default:
      return;
  }
  sink_->Send(std::move(msg));
}

void RankRunner::OnExit(ProcessId id, const ProcessExit& exit) {
  v1::RankRef ref;
  double loss = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = ranks_.find(id);
    if (it == ranks_.end()) return;
    ref = it->second.ref;
    loss = it->second.loss;
    ranks_.erase(it);
    UpdateRunningGauge();
  }
  if (metrics_ != nullptr) metrics_->OnTrainerExit(ExitReason(exit));
  // The job is done (its final checkpoint is on the volume): its replicas here are not needed.
  if (!options_.replica_dir.empty() && exit.term_signal == 0 && exit.exit_code == 0 &&
      !exit.stop_requested)
    RemoveReplicaJob(options_.replica_dir, ref.job_id());
  v1::WorkerMessage msg;
  v1::RankExit* e = msg.mutable_rank_exit();
  *e->mutable_ref() = ref;
  e->set_exit_code(exit.term_signal > 0 ? -1 : exit.exit_code);
  e->set_signal(exit.term_signal);
  // A trainer's stderr may hold any bytes: each line goes out as bounded, valid UTF-8 (a proto3
  // string that is not UTF-8 would make the coordinator refuse the whole message).
  for (const std::string& line : exit.stderr_tail)
    e->add_stderr_tail(BoundedUtf8(line, kMaxNoteBytes));
  e->set_stopped(exit.stop_requested);
  e->set_last_loss(loss);
  sink_->Send(std::move(msg));
}

}  // namespace spindle
