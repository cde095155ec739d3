// Job lifecycle, worker registry, placement and failure handling (see job_manager.h).
#include "coordinator/job_manager.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/exit_codes.h"
#include "common/host_port.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/text_bounds.h"
#include "coordinator/job_pages.h"
#include "coordinator/scheduler.h"
#include "planner/plan_proto.h"

namespace spindle {

struct JobManager::RankRuntime {
  RankPlacement placement;
  std::string state = "assigned";  // assigned | running | exited | stopped
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0, tokens_per_s = 0, lr = 0, grad_norm = 0, elapsed_s = 0, mfu = 0;
  double memory_bytes = 0;  // the largest memory this attempt reported
  MoeSummary moe;
  int32_t exit_code = 0;
  int64_t last_report_ms = 0;  // wall clock (shown)
  // Timers below are on the steady clock (Clock::SteadyMs).
  int64_t last_progress_ms = 0;  // last step advance (or placement / adoption)
  int64_t step_ms = 0;           // the rank's last step time as seen here; 0: none yet
  bool adopted = true;           // false while waiting for re-adoption after a restart
  // Its trainer is known to have ended: it reported its exit, or its worker reconnected without
  // it. A restart waits for this, or for dead_by_ms: set when the rank is stopped, the time by
  // which it must have been killed (by its worker, or by the worker itself when cut off).
  bool gone = false;
  int64_t dead_by_ms = 0;
};

struct JobManager::JobRuntime {
  JobRecord rec;
  JobSpec spec;
  CpMode lightning_mode = CpMode::kAllGather;
  CpMode mla_mode = CpMode::kAllGather;
  int64_t recompute_layers = 0;  // train.recompute as planned (never auto)
  std::string run_spec_json;     // the spec with the plan's modes (AdoptPlan): what ranks run
  // "auto" planned with no device registered (every layer): decided at the first placement.
  bool recompute_at_placement = false;
  int64_t memory_per_rank = 0;
  int64_t host_bytes_per_rank = 0;  // pinned host memory a rank needs (train.offload)
  std::vector<RankRuntime> ranks;  // current attempt
  std::string token;
  int64_t queued_since_ms = 0;    // steady clock, as every timer here
  int64_t adopt_deadline_ms = 0;  // > 0 while waiting for re-adoption
  // Fencing: the next attempt is placed only when every rank of the stopped one is gone or past
  // its dead_by_ms, and not before this (a restart recovered from the store, its ranks unknown).
  int64_t restart_not_before_ms = 0;
  // A new plan (more layers recomputing) that the next transition saves and then adopts.
  std::optional<CpPlan> pending_plan;
  // step -> (the distinct ranks that reported it, its path)
  std::map<int64_t, std::pair<std::set<int64_t>, std::string>> checkpoints;
  std::vector<EventRecord> events;  // the newest kMaxEventsPerJob
  int64_t events_dropped = 0;       // older events no longer kept (positions of page tokens)
  // A transition the store refused, tried again at each Tick (TransitionOrRetry).
  std::unique_ptr<PendingTransition> retry;
  // spec.checkpoint.dir as a comparable path (SamePlace), resolved once at submit or recovery;
  // "" for none. Its key in the JobIndex.
  std::string checkpoint_place;
  uint64_t version = 0;
  int64_t rate_ref_ms = 0, rate_ref_step = -1;  // for the ETA
};

struct JobManager::PendingTransition {
  JobState to;
  std::string message;
  int64_t add_restarts = 0;
};

struct JobManager::Outbox {
  std::vector<std::pair<std::string, WorkerCommand>> messages;
};

namespace {

void LogLine(const std::string& line) { std::fprintf(stderr, "coordinator: %s\n", line.c_str()); }

std::string RandomToken() {
  std::random_device rd;
  uint64_t a = (uint64_t{rd()} << 32) ^ rd(), b = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrFormat("%016x%016x", a, b);
}

// Trainers run in their workers' own directories, so a relative path would name a different
// place for every rank and attempt (and a restart would not find its checkpoint).
absl::Status CheckAbsolutePaths(const JobSpec& spec) {
  auto relative = [](const std::string& p) { return !p.empty() && p[0] != '/'; };
  if (relative(spec.checkpoint.dir))
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: checkpoint.dir: must be an absolute path (`spindle submit` makes relative "
        "paths absolute), got \"",
        spec.checkpoint.dir, "\""));
  if (spec.data.kind != DataKind::kSynthetic && relative(spec.data.path))
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: data.source: the file must be an absolute path (`spindle submit` makes "
        "relative paths absolute), got \"",
        spec.data.source, "\""));
  return absl::OkStatus();
}

// A request id is 1 to JobManager::kMaxRequestIdLength characters of [A-Za-z0-9._:-] ("" none).
absl::Status CheckRequestId(const std::string& id) {
  const bool ok_chars = std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
           c == '-';
  });
  if (id.size() <= JobManager::kMaxRequestIdLength && ok_chars) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("submit: request_id must be at most ", JobManager::kMaxRequestIdLength,
                   " characters of [A-Za-z0-9._:-], got ", id.size(), " characters",
                   ok_chars ? "" : " including others"));
}

bool IsActive(JobState s) { return s == JobState::kPlaced || s == JobState::kRunning; }

absl::Status JobNotFound(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("job ", BoundedUtf8(job_id, kMaxIdBytes), " not found"));
}

// Event page tokens: "events-N", N the position of the page's first event among every event the
// job ever had.
constexpr char kEventTokenPrefix[] = "events-";

absl::StatusOr<int64_t> ParseEventPageToken(const std::string& token) {
  if (token.empty()) return 0;
  int64_t at = -1;
  if (token.size() > 64 || !absl::StartsWith(token, kEventTokenPrefix) ||
      !absl::SimpleAtoi(token.substr(sizeof(kEventTokenPrefix) - 1), &at) || at < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "get: events_page_token \"", BoundedUtf8(token, 64), "\" is not one that Get returned"));
  return at;
}

// A checkpoint directory as a comparable path ("/a/b/" and "/a//b" are "/a/b"; the symbolic
// links among its existing parts, as the coordinator's host sees them, resolved).
std::string SamePlace(const std::string& dir) {
  std::error_code ec;
  std::filesystem::path resolved = std::filesystem::weakly_canonical(dir, ec);
  if (ec) resolved = dir;
  std::string p = resolved.lexically_normal().string();
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

}  // namespace

JobManager::JobManager(JobStore* store, const Clock* clock, WorkerChannel* channel,
                       RendezvousStore* rendezvous, JobManagerOptions options,
                       JobManagerMetrics metrics)
    : store_(store),
      clock_(clock),
      channel_(channel),
      rendezvous_(rendezvous),
      options_(std::move(options)),
      metrics_(metrics),
      health_(HealthOptions{options_.heartbeat_interval_ms, options_.heartbeat_timeout_ms,
                            options_.hang_timeout_ms, options_.start_timeout_ms,
                            options_.silence_timeout_ms, options_.stop_grace_ms}),
      registry_(store, clock, options_.registry),
      rendezvous_address_(options_.rendezvous_address) {}

void JobManager::SetRendezvousAddress(const std::string& address) {
  absl::MutexLock l(&mu_);
  rendezvous_address_ = address;
}

JobManager::~JobManager() = default;

JobManager::JobRuntime* JobManager::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

void JobManager::Bump(JobRuntime& j) { j.version = next_version_++; }

void JobManager::AddEvent(JobRuntime& j, EventRecord ev) {
  j.events.push_back(std::move(ev));
  if (static_cast<int64_t>(j.events.size()) > kMaxEventsPerJob) {
    const int64_t drop = static_cast<int64_t>(j.events.size()) - kMaxEventsPerJob;
    j.events.erase(j.events.begin(), j.events.begin() + drop);
    j.events_dropped += drop;
  }
}

void JobManager::IgnoredRankReport() const {
  if (metrics_.ignored_rank_reports) metrics_.ignored_rank_reports->Increment();
}

void JobManager::HeardFrom(const std::string& worker_id) {
  const int64_t steady = clock_->SteadyMs(), wall = clock_->NowMs();
  absl::MutexLock l(&heard_mu_);
  // Only registered workers have an entry worth keeping: the session checked its hello.
  heard_[worker_id] = {steady, wall};
}

void JobManager::SyncHeardLocked() {
  std::map<std::string, std::pair<int64_t, int64_t>> heard;
  {
    absl::MutexLock l(&heard_mu_);
    heard.swap(heard_);
  }
  for (const auto& [id, t] : heard) {
    Worker* w = registry_.Find(id);
    if (w == nullptr || t.first <= w->last_seen_ms) continue;
    w->last_seen_ms = t.first;
    w->last_seen_unix_ms = t.second;
  }
}

absl::Status JobManager::CheckHello(const WorkerHello& hello) {
  absl::MutexLock l(&mu_);
  return registry_.CheckOpen(hello.worker_id, hello.instance_id);
}

void JobManager::TransitionOrRetry(JobRuntime& j, JobState to, const std::string& message,
                                   int64_t add_restarts) {
  JobRecord next = j.rec;
  next.restarts += add_restarts;
  if (Transition(j, to, message, nullptr, std::move(next)).ok()) return;
  j.retry = std::make_unique<PendingTransition>(PendingTransition{to, message, add_restarts});
}

void JobManager::Flush(Outbox& out) {
  for (auto& [worker, msg] : out.messages) channel_->Send(worker, msg);
  out.messages.clear();
}

absl::Status JobManager::Recover() {
  ASSIGN_OR_RETURN(std::vector<JobRecord> jobs, store_->LoadJobs());
  absl::MutexLock l(&mu_);
  const int64_t now = clock_->SteadyMs();
  // Lost unless it reconnects within max(recovery_grace, heartbeat_timeout).
  RETURN_IF_ERROR(registry_.Load(
      std::max<int64_t>(0, options_.recovery_grace_ms - options_.heartbeat_timeout_ms)));
  for (JobRecord& rec : jobs) {
    auto j = std::make_unique<JobRuntime>();
    absl::StatusOr<JobSpec> spec = ParseJobSpec(rec.spec_json);
    if (!spec.ok()) {
      LogLine(absl::StrCat("job ", rec.job_id, ": stored spec no longer parses: ",
                           spec.status().message()));
    } else {
      j->spec = *spec;
      // "auto" recompute stays what it was decided at submit time (the stored plan), not what an
      // empty cluster would give.
      JobSpec planned = j->spec;
      absl::StatusOr<CpPlan> stored = DecodePlan(rec.plan);
      if (planned.train.recompute_layers == TrainSpec::kRecomputeAuto && stored.ok()) {
        planned.train.recompute_layers = stored->memory.recompute_layers;
        j->recompute_at_placement = stored->memory.device_memory_bytes <= 0;
      }
      AdoptPlan(*j, planner_.Plan(planned, 0));
    }
    ASSIGN_OR_RETURN(j->events, store_->LoadEvents(rec.job_id));
    if (static_cast<int64_t>(j->events.size()) > kMaxEventsPerJob)  // a store of older releases
      j->events.erase(j->events.begin(), j->events.end() - kMaxEventsPerJob);
    j->rec = std::move(rec);
    j->queued_since_ms = now;
    // A restart the previous coordinator process began: ranks of the stopped attempt may still
    // run on workers that have not yet fenced themselves (they fence a heartbeat timeout after
    // the last heartbeat that process acknowledged).
    if (j->rec.state == JobState::kRestarting) j->restart_not_before_ms = now + health_.FenceMs();
    if (IsActive(j->rec.state)) {
      absl::StatusOr<AttemptRecord> a = store_->LoadAttempt(j->rec.job_id, j->rec.attempt);
      if (a.ok()) {
        j->token = a->rendezvous_token;
        rendezvous_->Open(j->rec.job_id, j->rec.attempt, j->token);
        for (const RankPlacement& p : a->ranks) {
          RankRuntime r;
          r.placement = p;
          r.adopted = false;
          r.last_progress_ms = now;
          // Until its worker reports, a rank is at least at the job's last complete checkpoint
          // (this attempt wrote it or resumed from it), not at step 0.
          r.step = j->rec.last_checkpoint_step;
          j->ranks.push_back(r);
          Worker* w = registry_.Find(p.worker_id);
          if (w != nullptr && p.device_index >= 0 &&
              p.device_index < static_cast<int32_t>(w->slots.size())) {
            w->slots[p.device_index] = {j->rec.job_id, j->rec.attempt, p.rank, 0};
          }
        }
      }
      j->adopt_deadline_ms = now + options_.recovery_grace_ms;
    }
    Bump(*j);
    if (!j->spec.checkpoint.dir.empty()) j->checkpoint_place = SamePlace(j->spec.checkpoint.dir);
    index_.Add(j->rec.seq, j->rec.job_id, j->checkpoint_place, j->rec.request_id);
    jobs_[j->rec.job_id] = std::move(j);
  }
  LogLine(absl::StrCat("recovered ", jobs_.size(), " jobs and ", registry_.workers().size(),
                       " workers"));
  return absl::OkStatus();
}

CpPlan JobManager::PlanLocked(const JobSpec& spec) const {
  const Topology topo = TopologyLocked(spec);
  return planner_.Plan(spec, registry_.LargestDeviceMemory(spec.resources), &topo);
}

Topology JobManager::TopologyLocked(const JobSpec& spec) const {
  Topology t = DefaultTopology(spec.resources);
  const Worker* w = registry_.LargestWorker(spec.resources);
  if (w == nullptr) return t;
  const DeviceOffer& d = w->devices;
  const std::string threads =
      d.threads_per_rank > 0 ? absl::StrCat(", ", d.threads_per_rank, " threads a rank") : "";
  if (d.rates.known()) {
    t.rates = d.rates;
    t.basis = absl::StrCat("rates measured by worker ", w->rec.worker_id, " (", d.kind, " ",
                           d.name, threads, ")");
  } else {
    t.basis = absl::StrCat(t.basis.substr(0, t.basis.find(',')), " (worker ", w->rec.worker_id,
                           " reported none)");
  }
  // The gang fits on that worker: its own link; otherwise the ranks meet over the network.
  const int64_t world = spec.parallel.world();
  LinkClass link = t.link;
  if (world > d.count)
    link = LinkClass::kNetwork;
  else if (!d.link.empty())
    ParseLinkClass(d.link, &link);
  t.link = link;
  t.link_rates = DefaultLinkRates(link);
  // CPU ranks of one host share its cores.
  const int64_t on_host = std::min<int64_t>(world, d.count);
  if (d.kind == "cpu" && d.cores > 0 && d.threads_per_rank > 0)
    t.sharing = CoreSharing(on_host, d.threads_per_rank, d.cores);
  absl::StrAppend(&t.basis, ", link ", LinkClassName(link),
                  t.sharing > 1 ? absl::StrFormat(", %d ranks sharing %d cores", on_host, d.cores)
                                : "");
  return t;
}

absl::Status JobManager::CheckCanEverFitLocked(const std::string& kind, int64_t world,
                                               const CpPlan& plan) const {
  SchedulableJob sj;
  sj.world = world;
  sj.kind = kind;
  sj.memory_bytes_per_rank = plan.memory.total_bytes;
  sj.host_bytes_per_rank = plan.memory.host_bytes;
  return CheckCanEverFit(sj, registry_.Registered());
}

absl::Status JobManager::CheckCheckpointDirFreeLocked(const JobSpec& spec) const {
  if (spec.checkpoint.dir.empty()) return absl::OkStatus();
  // Through the index: one path resolution per submit, not one per stored job. A directory
  // inside another's is refused like the same one: the outer job's pruning and `latest` would
  // see the inner job's checkpoints.
  const std::string place = SamePlace(spec.checkpoint.dir);
  for (const std::string& id : index_.OverlappingCheckpointPlace(place)) {
    auto it = jobs_.find(id);
    if (it == jobs_.end() || IsTerminal(it->second->rec.state)) continue;
    const JobRuntime* other = it->second.get();
    const std::string state(JobStateName(other->rec.state));
    if (other->checkpoint_place == place)
      return absl::FailedPreconditionError(absl::StrCat(
          "job cannot run: checkpoint.dir \"", spec.checkpoint.dir, "\" is in use by job ", id,
          " (", state, "); two jobs on one directory would resume from each other's checkpoints"));
    return absl::FailedPreconditionError(
        absl::StrCat("job cannot run: checkpoint.dir \"", spec.checkpoint.dir, "\" is ",
                     other->checkpoint_place.size() < place.size() ? "inside" : "around", " \"",
                     other->spec.checkpoint.dir, "\", the checkpoint.dir of job ", id, " (", state,
                     "); nested checkpoint directories would mix the two jobs' checkpoints"));
  }
  return absl::OkStatus();
}

absl::Status JobManager::PlanSpec(const std::string& spec_json, CpPlan* plan_out) {
  ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpec(spec_json));
  absl::MutexLock l(&mu_);
  CpPlan plan = PlanLocked(spec);
  // What submit would refuse besides an impossible plan.
  if (plan.ok()) {
    if (absl::Status fit = CheckCanEverFitLocked(spec.resources, spec.parallel.world(), plan);
        !fit.ok())
      plan.problems.emplace_back(fit.message());
  }
  if (absl::Status free = CheckCheckpointDirFreeLocked(spec); !free.ok())
    plan.problems.emplace_back(free.message());
  *plan_out = std::move(plan);
  return absl::OkStatus();
}

absl::StatusOr<std::string> JobManager::Submit(const std::string& spec_json, CpPlan* plan_out,
                                               const std::string& request_id,
                                               const std::string& owner) {
  RETURN_IF_ERROR(CheckRequestId(request_id));
  ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpec(spec_json));
  RETURN_IF_ERROR(CheckAbsolutePaths(spec));
  const std::string canonical_spec = spec.ToJson().dump();
  // Resolved outside the mutex (it reads the filesystem).
  const std::string checkpoint_place =
      spec.checkpoint.dir.empty() ? "" : SamePlace(spec.checkpoint.dir);
  Outbox out;
  std::string job_id;
  {
    absl::MutexLock l(&mu_);
    // A retried submit (its first reply lost) gets the job its first attempt created.
    if (const std::string seen = index_.ByRequestId(request_id);
        !request_id.empty() && !seen.empty()) {
      const JobRuntime* j = FindJob(seen);
      if (j != nullptr) {
        if (j->rec.spec_json != canonical_spec)
          return absl::AlreadyExistsError(
              absl::StrCat("submit: request id \"", request_id, "\" was already used for job ",
                           seen, " with a different spec; a new job needs a new request id"));
        if (plan_out) {
          absl::StatusOr<CpPlan> stored = DecodePlan(j->rec.plan);
          *plan_out = stored.ok() ? *std::move(stored) : CpPlan{};
        }
        return seen;
      }
    }
    CpPlan plan = PlanLocked(spec);
    if (plan_out) *plan_out = plan;
    if (!plan.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("job cannot run: ", absl::StrJoin(plan.problems, "; ")));
    RETURN_IF_ERROR(CheckCanEverFitLocked(spec.resources, spec.parallel.world(), plan));
    RETURN_IF_ERROR(CheckCheckpointDirFreeLocked(spec));

    auto j = std::make_unique<JobRuntime>();
    j->spec = spec;
    AdoptPlan(*j, plan);
    j->recompute_at_placement = spec.train.recompute_layers == TrainSpec::kRecomputeAuto &&
                                plan.memory.device_memory_bytes <= 0;
    const int64_t now = clock_->NowMs();
    JobRecord& rec = j->rec;
    rec.name = spec.name;
    rec.state = JobState::kQueued;
    rec.priority = spec.priority;
    rec.spec_json = canonical_spec;
    rec.request_id = request_id;
    rec.owner = owner;
    rec.plan = EncodePlan(plan);
    rec.submitted_ms = rec.updated_ms = now;
    rec.max_restarts = spec.max_restarts;
    const int64_t world = spec.parallel.world();
    rec.message = absl::StrCat("waiting for ", world, " free ", spec.resources, " device",
                               world == 1 ? "" : "s");
    EventRecord ev{"", 0, now, JobState::kQueued,
                   owner.empty() ? "submitted" : absl::StrCat("submitted by ", owner)};
    RETURN_IF_ERROR(store_->CreateJob(&rec, ev));
    ev.job_id = rec.job_id;
    AddEvent(*j, ev);
    j->queued_since_ms = clock_->SteadyMs();
    Bump(*j);
    job_id = rec.job_id;
    j->checkpoint_place = checkpoint_place;
    index_.Add(rec.seq, job_id, checkpoint_place, request_id);
    jobs_[job_id] = std::move(j);
    if (metrics_.jobs_submitted) metrics_.jobs_submitted->Increment();
    Schedule(&out);
  }
  Flush(out);
  return job_id;
}

absl::Status JobManager::Transition(JobRuntime& j, JobState to, const std::string& message,
                                    const AttemptRecord* attempt, std::optional<JobRecord> next) {
  // The change is made to a copy and applied once the store has it: a failed write leaves the
  // job in memory exactly as the database holds it.
  JobRecord rec = next ? *std::move(next) : j.rec;
  std::optional<CpPlan> plan = std::move(j.pending_plan);
  j.pending_plan.reset();
  if (plan) rec.plan = EncodePlan(*plan);
  if (IsTerminal(to) && !j.ranks.empty()) {
    // Where it ended stays shown once the ranks are gone (a restarted coordinator has none).
    const RankRuntime* low = &j.ranks[0];
    for (const RankRuntime& r : j.ranks)
      if (r.step < low->step) low = &r;
    rec.final_step = low->step;
    rec.final_loss = low->loss;
  }
  const int64_t now = clock_->NowMs();
  rec.state = to;
  rec.message = message;
  rec.updated_ms = now;
  EventRecord ev{rec.job_id, rec.attempt, now, to, message};
  if (absl::Status st = store_->SaveJob(rec, &ev, attempt); !st.ok()) {
    LogLine(absl::StrCat("job ", j.rec.job_id, ": ", st.message()));
    return st;
  }
  j.rec = std::move(rec);
  if (plan) {
    AdoptPlan(j, *plan);
    j.recompute_at_placement = false;
  }
  AddEvent(j, std::move(ev));
  j.retry.reset();  // whatever was pending, this transition supersedes it
  Bump(j);
  return absl::OkStatus();
}

void JobManager::FillJob(const JobRuntime& j, bool with_events, JobView* out, int64_t events_from,
                         int events_page) const {
  const JobRecord& r = j.rec;
  *out = JobView{};
  out->record = r;
  if (absl::StatusOr<CpPlan> plan = DecodePlan(r.plan); plan.ok()) out->plan = *std::move(plan);
  out->total_steps = j.spec.train.steps;
  int64_t min_step = -1;
  double tps = 0, mfu_sum = 0;
  int64_t mfu_ranks = 0;
  out->ranks.reserve(j.ranks.size());
  for (const RankRuntime& rr : j.ranks) {
    out->ranks.push_back({rr.placement, rr.state, rr.step, rr.loss, rr.tokens_per_s, rr.lr,
                          rr.grad_norm, rr.elapsed_s, rr.mfu, rr.memory_bytes, rr.exit_code,
                          rr.last_report_ms, rr.moe});
    min_step = min_step < 0 ? rr.step : std::min(min_step, rr.step);
    if (rr.state == "running") {
      tps += rr.tokens_per_s;
      if (rr.mfu > 0) mfu_sum += rr.mfu, ++mfu_ranks;
    }
  }
  out->step = std::max<int64_t>(0, min_step);
  // The loss of the step shown (every rank reports the world's loss; a rank ahead of the others
  // already reports the next step's).
  for (const RankRuntime& rr : j.ranks) {
    if (rr.step == min_step) {
      out->loss = rr.loss;
      out->moe = rr.moe;
      break;
    }
  }
  if (j.ranks.empty() && IsTerminal(r.state)) {  // finished before this coordinator started
    out->step = r.final_step;
    out->loss = r.final_loss;
  }
  out->tokens_per_s = tps;
  out->mfu = mfu_ranks > 0 ? mfu_sum / static_cast<double>(mfu_ranks) : 0.0;
  if (r.state == JobState::kSucceeded) {
    out->eta_s = 0;
  } else if (r.state == JobState::kRunning && j.rate_ref_step >= 0 && min_step > j.rate_ref_step) {
    const double dt = static_cast<double>(clock_->SteadyMs() - j.rate_ref_ms) / 1000.0;
    const double rate = (min_step - j.rate_ref_step) / std::max(dt, 1e-3);
    out->eta_s = (j.spec.train.steps - min_step) / rate;
  }
  if (with_events) {
    const int64_t first = std::max<int64_t>(0, events_from - j.events_dropped);
    const int64_t end =
        std::min<int64_t>(static_cast<int64_t>(j.events.size()), first + events_page);
    if (first < end) out->events.assign(j.events.begin() + first, j.events.begin() + end);
    if (end < static_cast<int64_t>(j.events.size()))
      out->next_events_page_token = absl::StrCat(kEventTokenPrefix, j.events_dropped + end);
  }
}

absl::Status JobManager::GetJob(const std::string& job_id, bool with_events, JobView* out,
                                const EventPageRequest& page) {
  if (page.page_size < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("get: events_page_size must not be negative, got ", page.page_size));
  ASSIGN_OR_RETURN(const int64_t from, ParseEventPageToken(page.page_token));
  const int size =
      page.page_size == 0 ? kDefaultEventPageSize : std::min(page.page_size, kMaxEventPageSize);
  absl::MutexLock l(&mu_);
  JobRuntime* j = FindJob(job_id);
  if (!j) return JobNotFound(job_id);
  FillJob(*j, with_events, out, from, size);
  return absl::OkStatus();
}

std::vector<JobView> JobManager::ListJobs(const std::set<JobState>& states, int limit) {
  std::vector<JobView> out;
  std::string next;
  ListJobPage(states, limit > 0 ? limit : std::numeric_limits<int>::max(), "", &out, &next)
      .IgnoreError();  // the first page's token cannot be wrong
  return out;
}

absl::Status JobManager::ListJobPage(const std::set<JobState>& states, int page_size,
                                     const std::string& page_token, std::vector<JobView>* jobs,
                                     std::string* next_page_token, const std::string* owner) {
  ASSIGN_OR_RETURN(const int64_t before, ParsePageToken(page_token));
  next_page_token->clear();
  absl::MutexLock l(&mu_);
  int64_t last_seq = 0;
  index_.VisitNewestFirst(before, [&](int64_t seq, const std::string& id) {
    const JobRuntime* j = FindJob(id);
    if (j == nullptr || (!states.empty() && !states.count(j->rec.state))) return true;
    if (owner != nullptr && j->rec.owner != *owner) return true;
    if (static_cast<int64_t>(jobs->size()) >= page_size) {  // one more: there is a next page
      *next_page_token = MakePageToken(last_seq);
      return false;
    }
    FillJob(*j, false, &jobs->emplace_back());
    last_seq = seq;
    return true;
  });
  return absl::OkStatus();
}

absl::Status JobManager::WaitJob(const std::string& job_id, uint64_t* version, size_t* events_seen,
                                 absl::Duration max_wait, JobView* out,
                                 std::vector<EventRecord>* new_events) {
  absl::MutexLock l(&mu_);
  JobRuntime* j = FindJob(job_id);
  if (!j) return JobNotFound(job_id);
  // Looked up again after the wait: a finished job may be pruned meanwhile.
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const JobRuntime* now = FindJob(job_id);
    return now == nullptr || now->version != *version;
  };
  if (j->version == *version) {
    mu_.AwaitWithTimeout(absl::Condition(&changed), max_wait);
    j = FindJob(job_id);
    if (!j) return JobNotFound(job_id);
  }
  FillJob(*j, false, out);
  *version = j->version;
  // `events_seen` counts every event the job ever had; those no longer kept are skipped.
  const size_t dropped = static_cast<size_t>(j->events_dropped);
  for (size_t i = std::max(*events_seen, dropped) - dropped; i < j->events.size(); ++i)
    new_events->push_back(j->events[i]);
  *events_seen = dropped + j->events.size();
  return absl::OkStatus();
}

absl::Status JobManager::Cancel(const std::string& job_id, const std::string& reason, JobView* out,
                                const User* by) {
  Outbox box;
  {
    absl::MutexLock l(&mu_);
    SyncHeardLocked();
    JobRuntime* j = FindJob(job_id);
    if (!j) return JobNotFound(job_id);
    if (by != nullptr && !by->admin && by->name != j->rec.owner)
      return absl::PermissionDeniedError(absl::StrCat(
          "job ", job_id, " belongs to ", j->rec.owner.empty() ? "no named user" : j->rec.owner,
          "; only its owner or an admin may cancel it"));
    if (!IsTerminal(j->rec.state)) {
      const std::string who = by != nullptr && !by->name.empty() ? by->name : "";
      const std::string why = BoundedUtf8(reason, kMaxReasonBytes);
      std::string msg;
      if (who.empty()) {
        msg = reason.empty() ? "cancelled by user" : absl::StrCat("cancelled: ", why);
      } else {
        msg = reason.empty() ? absl::StrCat("cancelled by ", who)
                             : absl::StrCat("cancelled by ", who, ": ", why);
      }
      const bool running = !j->ranks.empty() && j->rec.state != JobState::kQueued &&
                           j->rec.state != JobState::kRestarting;
      RETURN_IF_ERROR(Transition(*j, JobState::kCancelled, msg));
      if (running) StopAttempt(*j, msg, &box);
      Schedule(&box);
    }
    FillJob(*j, true, out, 0, kDefaultEventPageSize);
  }
  Flush(box);
  return absl::OkStatus();
}

void JobManager::StopAttempt(JobRuntime& j, const std::string& reason, Outbox* out) {
  const int64_t now = clock_->SteadyMs();
  std::set<std::string> told;
  for (RankRuntime& r : j.ranks) {
    if (r.state == "exited") continue;
    r.state = "stopped";
    Worker* wp = registry_.Find(r.placement.worker_id);
    if (wp == nullptr) continue;
    Worker& w = *wp;
    // Whether or not the Stop reaches it, the rank is dead by then (fencing).
    r.dead_by_ms = health_.DeadBy(w, now);
    const int32_t d = r.placement.device_index;
    // A lost worker's slot drains too: the rank may still run there should the worker be back.
    if (d >= 0 && d < static_cast<int32_t>(w.slots.size()) && w.slots[d].job_id == j.rec.job_id &&
        w.slots[d].attempt == j.rec.attempt)
      w.slots[d].drain_deadline_ms = now + health_.FenceMs();
    if (told.insert(w.rec.worker_id).second && !w.lost)
      SendStop(w.rec.worker_id, j.rec.job_id, j.rec.attempt, reason, out);
  }
  j.adopt_deadline_ms = 0;
  rendezvous_->Close(j.rec.job_id, j.rec.attempt);
}

void JobManager::AdoptPlan(JobRuntime& j, const CpPlan& plan) {
  j.lightning_mode = plan.ModeOf("lightning");
  j.mla_mode = plan.ModeOf("mla");
  j.recompute_layers = plan.memory.recompute_layers;
  j.memory_per_rank = plan.memory.total_bytes;
  j.host_bytes_per_rank = plan.memory.host_bytes;
  // The spec the ranks run: the plan's decisions (modes, ulysses, recompute) in place of "auto"
  // and "fastest", so that the trainer applies the plan as sent.
  j.run_spec_json = PlannedSpec(j.spec, plan).ToJson().dump();
}

void JobManager::RecomputeMoreAfterOutOfMemory(JobRuntime& j, std::string* reason) {
  const int64_t n = j.spec.model.n_layers;
  if (j.spec.train.recompute_layers != TrainSpec::kRecomputeAuto || j.recompute_layers >= n) return;
  // Half of the layers still keeping their activations start recomputing (at least two: one
  // alone saves nothing, the shared cache being as large as a layer's).
  const int64_t more =
      std::min(n, j.recompute_layers + std::max<int64_t>(2, (n - j.recompute_layers + 1) / 2));
  JobSpec planned = j.spec;
  planned.train.recompute_layers = more;
  j.pending_plan = PlanLocked(planned);  // the restart's
  absl::StrAppend(reason, "; train.recompute \"auto\": ", more, " of ", n,
                  " layers recompute from now on");
}

void JobManager::DecideRecomputeAtPlacement(JobRuntime& j,
                                            const std::vector<RankPlacement>& ranks) {
  int64_t memory = 0;  // the smallest device the gang got
  for (const RankPlacement& p : ranks) {
    const Worker* w = registry_.Find(p.worker_id);
    if (w == nullptr) return;
    const int64_t m = w->devices.memory_bytes;
    memory = memory == 0 ? m : std::min(memory, m);
  }
  if (memory <= 0) return;
  // The spec's "auto", sized to `memory`; taken with the placement's transition.
  const Topology topo = TopologyLocked(j.spec);
  j.pending_plan = planner_.Plan(j.spec, memory, &topo);
}

void JobManager::FailAttempt(JobRuntime& j, const std::string& reason, bool fatal, Counter* kind,
                             Outbox* out) {
  StopAttempt(j, reason, out);
  if (fatal) {
    TransitionOrRetry(j, JobState::kFailed,
                      absl::StrCat(reason, " (invalid input; not restarted)"));
  } else if (j.rec.restarts >= j.rec.max_restarts) {
    TransitionOrRetry(
        j, JobState::kFailed,
        absl::StrCat(reason, "; out of restarts (", j.rec.restarts, "/", j.rec.max_restarts, ")"));
  } else {
    j.queued_since_ms = clock_->SteadyMs();
    if (kind) kind->Increment();
    TransitionOrRetry(
        j, JobState::kRestarting,
        absl::StrCat(reason, "; restart ", j.rec.restarts + 1, "/", j.rec.max_restarts,
                     j.rec.last_checkpoint_step > 0
                         ? absl::StrCat(" from checkpoint step ", j.rec.last_checkpoint_step)
                         : std::string(" from scratch")),
        /*add_restarts=*/1);
  }
}

void JobManager::Schedule(Outbox* out) {
  // With every device taken (a long queue on a full cluster) there is nothing to place: no pass
  // over the queued jobs.
  bool any_free = false;
  for (const auto& [id, w] : registry_.workers()) {
    if (!w->connected || w->lost || w->leaving) continue;
    for (const auto& slot : w->slots) any_free |= slot.job_id.empty();
    if (any_free) break;
  }
  if (!any_free) return;
  std::vector<SchedulableJob> cands;
  const int64_t now = clock_->SteadyMs();
  for (const auto& [id, j] : jobs_) {
    if (j->rec.state != JobState::kQueued && j->rec.state != JobState::kRestarting) continue;
    // No rank of the stopped attempt may still train when the next one starts.
    if (j->rec.state == JobState::kRestarting && !PreviousAttemptGone(*j, now)) continue;
    SchedulableJob sj;
    sj.job_id = id;
    sj.priority = j->rec.priority;
    sj.seq = j->rec.seq;
    sj.world = j->spec.parallel.world();
    sj.kind = j->spec.resources;
    sj.memory_bytes_per_rank = j->memory_per_rank;
    sj.host_bytes_per_rank = j->host_bytes_per_rank;
    cands.push_back(sj);
  }
  if (cands.empty()) return;
  std::vector<SchedulableWorker> ws;
  for (const auto& [id, w] : registry_.workers()) {
    if (!w->connected || w->lost || w->leaving) continue;
    SchedulableWorker sw = w->Schedulable();
    sw.total_devices = static_cast<int32_t>(w->slots.size());
    for (size_t d = 0; d < w->slots.size(); ++d) {
      const std::string& job_id = w->slots[d].job_id;
      if (job_id.empty()) {
        sw.free_devices.push_back(static_cast<int32_t>(d));
      } else if (auto it = jobs_.find(job_id); it != jobs_.end()) {
        sw.host_pinned_bytes += it->second->host_bytes_per_rank;
      }
    }
    ws.push_back(std::move(sw));
  }
  for (const GangPlacement& p : ScheduleGangs(std::move(cands), std::move(ws))) {
    PlaceJob(*jobs_[p.job_id], p.ranks, out);
  }
}

void JobManager::PlaceJob(JobRuntime& j, const std::vector<RankPlacement>& ranks, Outbox* out) {
  const int64_t now = clock_->SteadyMs();
  if (absl::Status reach = CheckReachable(ranks); !reach.ok()) {
    TransitionOrRetry(j, JobState::kFailed, std::string(reach.message()));
    return;
  }
  if (j.recompute_at_placement) DecideRecomputeAtPlacement(j, ranks);
  AttemptRecord a;
  a.job_id = j.rec.job_id;
  a.attempt = j.rec.attempt + 1;
  a.ranks = ranks;
  a.rendezvous_token = RandomToken();
  a.started_ms = clock_->NowMs();
  std::map<std::string, std::vector<int64_t>> by_worker;
  for (const RankPlacement& p : ranks) by_worker[p.worker_id].push_back(p.rank);
  std::vector<std::string> parts;
  for (const auto& [w, rs] : by_worker)
    parts.push_back(absl::StrCat(w, " (", rs.size(), " rank", rs.size() == 1 ? "" : "s", ")"));
  JobRecord next = j.rec;
  next.attempt = a.attempt;
  if (!Transition(j, JobState::kPlaced,
                  absl::StrCat("attempt ", a.attempt, " placed on ", absl::StrJoin(parts, ", ")),
                  &a, std::move(next))
           .ok()) {
    return;
  }
  if (metrics_.scheduling_latency_seconds)
    metrics_.scheduling_latency_seconds->Observe((now - j.queued_since_ms) / 1000.0);
  j.token = a.rendezvous_token;
  j.checkpoints.clear();
  j.rate_ref_step = -1;
  j.adopt_deadline_ms = 0;
  j.restart_not_before_ms = 0;
  j.ranks.clear();
  rendezvous_->Open(j.rec.job_id, j.rec.attempt, j.token);
  for (const RankPlacement& p : ranks) {
    RankRuntime r;
    r.placement = p;
    r.last_progress_ms = now;
    j.ranks.push_back(r);
    registry_.Find(p.worker_id)->slots[p.device_index] = {j.rec.job_id, j.rec.attempt, p.rank, 0};
    out->messages.emplace_back(p.worker_id, MakeAssignment(j, p));
  }
}

AssignmentCommand JobManager::MakeAssignment(const JobRuntime& j, const RankPlacement& p) const {
  AssignmentCommand a;
  a.ref = {j.rec.job_id, j.rec.attempt, p.rank};
  a.world = j.spec.parallel.world();
  a.cp = j.spec.parallel.cp;
  a.dp = j.spec.parallel.dp;
  a.lightning_mode = j.lightning_mode;
  a.mla_mode = j.mla_mode;
  a.recompute_layers = j.recompute_layers;
  a.spec_json = j.run_spec_json.empty() ? j.rec.spec_json : j.run_spec_json;
  a.rendezvous_address = rendezvous_address_;
  a.rendezvous_token = j.token;
  a.checkpoint_dir = j.spec.checkpoint.dir;
  a.resume_step = j.rec.last_checkpoint_step;
  a.resume_path = j.rec.last_checkpoint_path;
  a.device_index = p.device_index;
  a.device_kind = j.spec.resources;
  if (const Worker* w = registry_.Find(p.worker_id)) a.host_address = w->address;
  return a;
}

absl::Status JobManager::CheckReachable(const std::vector<RankPlacement>& ranks) const {
  // A worker that reached the coordinator over loopback shares its host; its ranks' Gloo address
  // would be loopback too, which ranks on other hosts cannot reach.
  std::string local, remote;
  for (const RankPlacement& p : ranks) {
    const Worker* w = registry_.Find(p.worker_id);
    if (w == nullptr) continue;
    (IsLoopbackHost(w->address) ? local : remote) = p.worker_id;
  }
  if (local.empty() || remote.empty()) return absl::OkStatus();
  const Worker& l = *registry_.Find(local);
  const Worker& r = *registry_.Find(remote);
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot place the job across workers ", local, " and ", remote, ": ", local, "'s address ",
      l.address,
      " (it reaches the coordinator over loopback) cannot be reached "
      "from ",
      remote, " at ", r.address, "; start ", local,
      " with --advertise-host=<an address the other hosts reach>, or connect it to the "
      "coordinator's network address"));
}

void JobManager::CheckRunning(JobRuntime& j) {
  if (j.rec.state != JobState::kPlaced || j.adopt_deadline_ms > 0) return;
  for (const RankRuntime& r : j.ranks)
    if (r.state != "running" && r.state != "exited") return;
  Transition(j, JobState::kRunning, absl::StrCat("attempt ", j.rec.attempt, ": all ",
                                                 j.ranks.size(), " ranks started"))
      .IgnoreError();
}

absl::StatusOr<RegistrationReply> JobManager::RegisterWorker(const WorkerRegistration& reg) {
  {
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(registry_.Register(reg).status());
  }
  RegistrationReply reply;
  reply.heartbeat_interval_ms = options_.heartbeat_interval_ms;
  reply.heartbeat_timeout_ms = options_.heartbeat_timeout_ms;
  reply.stop_grace_ms = options_.stop_grace_ms;
  reply.observed_host = reg.observed_host;
  return reply;
}

absl::Status JobManager::SessionOpened(const WorkerHello& hello, uint64_t session_id) {
  Outbox out;
  {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Worker * opened,
                     registry_.Open(hello.worker_id, hello.instance_id, session_id));
    Worker& w = *opened;
    const int64_t now = clock_->SteadyMs();
    SyncHeardLocked();
    std::set<std::pair<std::string, int64_t>> stops;
    std::set<std::tuple<std::string, int64_t, int64_t>> listed;
    int unknown_stops = 0;
    for (const RunningRankReport& rr : hello.running) {
      const RankKey& ref = rr.ref;
      if (!MayHaveGiven(w.rec.worker_id, ref)) {
        IgnoredRankReport();
        continue;
      }
      listed.insert({ref.job_id, ref.attempt, ref.rank});
      JobRuntime* j = FindJob(ref.job_id);
      bool expected = j && IsActive(j->rec.state) && j->rec.attempt == ref.attempt &&
                      ref.rank >= 0 && ref.rank < static_cast<int64_t>(j->ranks.size()) &&
                      j->ranks[ref.rank].placement.worker_id == w.rec.worker_id &&
                      j->ranks[ref.rank].state != "exited" &&
                      j->ranks[ref.rank].state != "stopped";
      if (!expected) {
        if (j == nullptr && !stops.count({ref.job_id, ref.attempt}) &&
            ++unknown_stops > kMaxUnknownJobStopsPerReport) {
          IgnoredRankReport();
          continue;
        }
        stops.insert({ref.job_id, ref.attempt});
        continue;
      }
      RankRuntime& r = j->ranks[ref.rank];
      r.adopted = true;
      r.state = "running";
      if (rr.step >= r.step && rr.loss != 0) r.loss = rr.loss;
      r.step = std::max(r.step, rr.step);
      r.last_progress_ms = now;
      r.last_report_ms = clock_->NowMs();
    }
    // A slot still draining a stopped rank that the worker no longer runs is free now, not at
    // its drain deadline.
    for (WorkerSlot& s : w.slots) {
      if (s.drain_deadline_ms > 0 && !listed.count({s.job_id, s.attempt, s.rank})) s = {};
    }
    for (const auto& [job_id, attempt] : stops)
      SendStop(w.rec.worker_id, job_id, attempt, "not expected by the coordinator", &out);
    // Ranks placed on this worker that it no longer runs: the gang restarts, unless the worker
    // never started them (it did not acknowledge the assignment: the stream broke first), in
    // which case the assignment is sent again.
    for (auto& [id, jp] : jobs_) {
      JobRuntime& j = *jp;
      for (RankRuntime& r : j.ranks) {  // of a stopped attempt: not running there any more
        if (r.placement.worker_id == w.rec.worker_id && r.state == "stopped" &&
            !listed.count({j.rec.job_id, j.rec.attempt, r.placement.rank}))
          r.gone = true;
      }
      if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
      std::string missing;
      std::vector<int32_t> gone;  // devices of ranks the worker no longer runs
      for (RankRuntime& r : j.ranks) {
        if (r.placement.worker_id != w.rec.worker_id || r.state == "exited") continue;
        if (!listed.count({j.rec.job_id, j.rec.attempt, r.placement.rank})) {
          if (r.state == "assigned" && r.adopted) {
            out.messages.emplace_back(w.rec.worker_id, MakeAssignment(j, r.placement));
            r.last_progress_ms = now;
            continue;
          }
          r.gone = true;
          if (missing.empty())
            missing = absl::StrCat("rank ", r.placement.rank, " was not running on worker ",
                                   w.rec.worker_id, " when it reconnected");
          gone.push_back(r.placement.device_index);
        }
      }
      if (!missing.empty()) {
        const int64_t attempt = j.rec.attempt;
        FailAttempt(j, missing, false,
                    j.adopt_deadline_ms > 0 ? metrics_.restarts_recovery
                                            : metrics_.restarts_worker_lost,
                    &out);
        for (int32_t d : gone) registry_.Release(w.rec.worker_id, d, j.rec.job_id, attempt);
        continue;
      }
      if (j.adopt_deadline_ms > 0) {
        bool all = true;
        for (const RankRuntime& r : j.ranks) all = all && r.adopted;
        if (all) {
          j.adopt_deadline_ms = 0;
          Bump(j);
          CheckRunning(j);
        }
      }
    }
    Schedule(&out);
  }
  Flush(out);
  return absl::OkStatus();
}

void JobManager::SessionClosed(const std::string& worker_id, uint64_t session_id) {
  absl::MutexLock l(&mu_);
  Worker* found = registry_.Find(worker_id);
  if (found == nullptr || found->session_id != session_id) return;
  Worker& w = *found;
  w.connected = false;
  if (w.leaving) {
    // Its gangs were restarted at Leaving; whatever it still held is free.
    w.lost = w.left = true;
    for (auto& s : w.slots) s = {};
    LogLine(absl::StrCat("worker ", w.rec.worker_id, " left"));
  }
}

struct JobManager::ReportContext {
  Worker& w;
  const std::string& worker_id;
  int64_t now;   // steady: timers
  int64_t wall;  // what is recorded and shown
  Outbox* out;
  // Tells the worker to stop a rank the coordinator does not expect (a stale attempt).
  void StopStale(const JobManager& m, const RankKey& ref) const {
    m.SendStop(worker_id, ref.job_id, ref.attempt, "not expected by the coordinator", out);
  }
};

void JobManager::HandleWorkerMessage(const std::string& worker_id, const WorkerReport& report) {
  Outbox out;
  {
    absl::MutexLock l(&mu_);
    SyncHeardLocked();
    Worker* found = registry_.Find(worker_id);
    if (found == nullptr) return;
    Worker& w = *found;
    ReportContext c{w, worker_id, clock_->SteadyMs(), clock_->NowMs(), &out};
    if (w.lost && !w.left) WorkerBack(w, c.now, &out);
    registry_.Seen(w);
    std::visit([&](const auto& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { OnReport(c, r); }, report);
  }
  Flush(out);
}

bool JobManager::MayHaveGiven(const std::string& worker_id, const RankKey& ref) const {
  auto it = jobs_.find(ref.job_id);
  if (it == jobs_.end()) return true;
  const JobRuntime& j = *it->second;
  if (ref.attempt < 1 || ref.attempt > j.rec.attempt || ref.rank < 0 ||
      ref.rank >= j.spec.parallel.world())
    return false;
  if (ref.attempt == j.rec.attempt && ref.rank < static_cast<int64_t>(j.ranks.size()))
    return j.ranks[ref.rank].placement.worker_id == worker_id;
  return true;
}

std::pair<JobManager::JobRuntime*, JobManager::RankRuntime*> JobManager::CurrentRank(
    const std::string& worker_id, const RankKey& ref) {
  JobRuntime* j = FindJob(ref.job_id);
  // A job whose ranks were stopped and whose transition waits for the store has no current rank.
  if (!j || j->retry != nullptr || !IsActive(j->rec.state) || j->rec.attempt != ref.attempt ||
      ref.rank < 0 || ref.rank >= static_cast<int64_t>(j->ranks.size()))
    return {nullptr, nullptr};
  RankRuntime& r = j->ranks[ref.rank];
  if (r.placement.worker_id != worker_id) return {nullptr, nullptr};
  return {j, &r};
}

void JobManager::OnReport(ReportContext& c, const HeartbeatReport& h) {
  std::set<std::pair<std::string, int64_t>> stopped;
  // A rank that pulses (its trainer prints a line every second) and has been silent for the
  // silence timeout is stopped (a frozen process, a hung host), while its peers wait for it in a
  // collective: found in seconds, whatever the job's step time.
  std::map<JobRuntime*, std::string> silent;
  int unknown_stops = 0;
  for (const RunningRankReport& rr : h.running) {
    if (!MayHaveGiven(c.worker_id, rr.ref)) {
      IgnoredRankReport();
      continue;
    }
    auto [j, r] = CurrentRank(c.worker_id, rr.ref);
    if (j && r->state != "stopped" && r->state != "exited") {
      if (std::string why =
              rr.pulsing ? health_.Silent(rr.ref.rank, c.worker_id, rr.silent_ms, r->step) : "";
          !why.empty() && !silent.count(j))
        silent[j] = why;
      continue;
    }
    // Stopped ranks still draining are told again only when their drain is over due.
    if (j == nullptr && FindJob(rr.ref.job_id) != nullptr) {
      bool draining = false;
      for (const auto& s : c.w.slots)
        draining |= s.job_id == rr.ref.job_id && s.attempt == rr.ref.attempt &&
                    s.drain_deadline_ms > c.now;
      if (draining) continue;
    }
    if (stopped.count({rr.ref.job_id, rr.ref.attempt})) continue;
    if (FindJob(rr.ref.job_id) == nullptr && ++unknown_stops > kMaxUnknownJobStopsPerReport) {
      IgnoredRankReport();
      continue;
    }
    stopped.insert({rr.ref.job_id, rr.ref.attempt});
    c.StopStale(*this, rr.ref);
  }
  for (auto& [j, why] : silent) FailAttempt(*j, why, false, metrics_.restarts_hang, c.out);
  if (!silent.empty()) Schedule(c.out);
}

void JobManager::OnReport(ReportContext& c, const RankStartedReport& s) {
  auto [j, r] = CurrentRank(c.worker_id, s.ref);
  if (!j) return;
  if (r->state == "assigned") r->state = "running";
  r->last_progress_ms = c.now;
  r->last_report_ms = c.wall;
  Bump(*j);
  CheckRunning(*j);
}

void JobManager::OnReport(ReportContext& c, const RankProgressReport& p) {
  auto [j, r] = CurrentRank(c.worker_id, p.ref);
  if (!j) {
    if (MayHaveGiven(c.worker_id, p.ref))
      c.StopStale(*this, p.ref);
    else
      IgnoredRankReport();
    return;
  }
  if (r->state == "assigned") r->state = "running";
  r->adopted = true;
  if (p.step > r->step) {
    // The attempt's first step (from its start, so with the set-up: longer) or the mean of the
    // steps since the last report.
    r->step_ms = (c.now - r->last_progress_ms) / (r->step > 0 ? p.step - r->step : 1);
    r->last_progress_ms = c.now;
  }
  r->step = p.step;
  r->total_steps = p.total_steps;
  r->loss = p.loss;
  r->tokens_per_s = p.tokens_per_s;
  r->lr = p.lr;
  r->grad_norm = p.grad_norm;
  r->elapsed_s = p.elapsed_s;
  r->mfu = p.mfu;
  r->moe = p.moe;
  r->memory_bytes = std::max(r->memory_bytes, p.memory_bytes);
  r->last_report_ms = c.wall;
  if (j->rate_ref_step < 0) {
    int64_t min_step = r->step;
    for (const RankRuntime& o : j->ranks) min_step = std::min(min_step, o.step);
    if (min_step > 0) {
      j->rate_ref_step = min_step;
      j->rate_ref_ms = c.now;
    }
  }
  Bump(*j);
  CheckRunning(*j);
}

void JobManager::OnReport(ReportContext& c, const CheckpointDoneReport& d) {
  auto [j, r] = CurrentRank(c.worker_id, d.ref);
  if (!j) return;
  r->last_progress_ms = c.now;
  // Counted by distinct rank: a rank that reports one step twice does not stand in for another.
  auto& [reported, path] = j->checkpoints[d.step];
  reported.insert(d.ref.rank);
  if (path.empty() || d.ref.rank == 0) path = d.path;
  if (reported.size() == j->ranks.size() && d.step > j->rec.last_checkpoint_step) {
    JobRecord next = j->rec;  // applied once stored
    next.last_checkpoint_step = d.step;
    next.last_checkpoint_path = path;
    next.updated_ms = c.wall;
    EventRecord ev{j->rec.job_id, j->rec.attempt, c.wall, j->rec.state,
                   absl::StrCat("checkpoint at step ", d.step, " complete: ", path)};
    if (absl::Status st = store_->SaveJob(next, &ev); !st.ok()) {
      LogLine(std::string(st.message()));
      return;
    }
    j->rec = std::move(next);
    AddEvent(*j, ev);
    for (auto it = j->checkpoints.begin(); it != j->checkpoints.end();)
      it = it->first <= d.step ? j->checkpoints.erase(it) : std::next(it);
  }
  Bump(*j);
}

void JobManager::OnReport(ReportContext& c, const RankExitReport& e) {
  const RankKey& ref = e.ref;
  auto [j, r] = CurrentRank(c.worker_id, ref);
  if (!j) {
    // A stopped or stale rank: its device is free now.
    JobRuntime* any = FindJob(ref.job_id);
    if (any && any->rec.attempt == ref.attempt && ref.rank >= 0 &&
        ref.rank < static_cast<int64_t>(any->ranks.size())) {
      RankRuntime& rr = any->ranks[ref.rank];
      if (rr.placement.worker_id == c.worker_id) {
        rr.gone = true;
        rr.exit_code = e.exit_code;
        if (rr.state != "exited") rr.state = "stopped";
        Bump(*any);
      }
    }
    for (WorkerSlot& s : c.w.slots)
      if (s.job_id == ref.job_id && s.attempt == ref.attempt && s.rank == ref.rank) s = {};
    Schedule(c.out);
    return;
  }
  registry_.Release(c.worker_id, r->placement.device_index, j->rec.job_id, j->rec.attempt);
  r->gone = true;
  r->exit_code = e.exit_code;
  r->last_report_ms = c.wall;
  r->state = "exited";
  if (e.exit_code == 0 && e.signal == 0) {
    if (e.last_loss != 0) r->loss = e.last_loss;  // its last step's, seen or not
    // A trainer exits 0 only after its last step; its final progress line may have been sent
    // while this coordinator was away.
    r->step = std::max<int64_t>(r->step, j->spec.train.steps);
    bool all = true;
    for (const RankRuntime& o : j->ranks) all = all && o.state == "exited";
    if (all) {
      rendezvous_->Close(j->rec.job_id, j->rec.attempt);
      TransitionOrRetry(*j, JobState::kSucceeded,
                        absl::StrCat("all ", j->ranks.size(), " ranks finished"));
    } else {
      Bump(*j);
    }
  } else {
    std::string why = e.signal != 0 ? absl::StrCat("was killed by signal ", e.signal)
                                    : absl::StrCat("exited with code ", e.exit_code);
    std::string reason = absl::StrCat("rank ", ref.rank, " on worker ", c.worker_id, " ", why);
    if (!e.stderr_tail.empty()) absl::StrAppend(&reason, ": ", e.stderr_tail.back());
    // A worker that vanished (its session closed) takes its ranks with it, and their peers then
    // fail in their collectives: name the vanished worker as the cause.
    if (std::string gone = DisconnectedPeer(*j, *r); !gone.empty())
      reason = absl::StrCat(gone, "; then ", reason);
    if (e.signal == 0 && e.exit_code == kExitOutOfMemory) RecomputeMoreAfterOutOfMemory(*j, &reason);
    FailAttempt(*j, reason, e.signal == 0 && e.exit_code == kExitInvalidInput,
                metrics_.restarts_rank_failed, c.out);
  }
  Schedule(c.out);
}

void JobManager::OnReport(ReportContext& c, const LeavingReport& l) {
  c.w.leaving = true;
  const std::string why =
      absl::StrCat("worker ", c.worker_id, " is shutting down (", l.reason, ")");
  LogLine(why);
  for (auto& [id, jp] : jobs_) {
    JobRuntime& j = *jp;
    if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
    for (const RankRuntime& r : j.ranks) {
      if (r.placement.worker_id != c.worker_id || r.state == "exited") continue;
      FailAttempt(j, absl::StrCat(why, " with rank ", r.placement.rank), false,
                  metrics_.restarts_worker_left, c.out);
      break;
    }
  }
  Schedule(c.out);
}

void JobManager::OnReport(ReportContext& c, const RankNoteReport& n) {
  auto [j, r] = CurrentRank(c.worker_id, n.ref);
  if (!j) return;
  // A note is one line of the job's events, bounded like every field a worker sends (cut on a
  // character boundary where the session took it in).
  EventRecord ev{j->rec.job_id, j->rec.attempt, c.wall, j->rec.state,
                 absl::StrCat("rank ", n.ref.rank, ": ", BoundedUtf8(n.text, kMaxNoteBytes))};
  if (absl::Status st = store_->SaveJob(j->rec, &ev); !st.ok()) {
    LogLine(std::string(st.message()));
    return;
  }
  AddEvent(*j, std::move(ev));
  Bump(*j);
}

std::string JobManager::DisconnectedPeer(const JobRuntime& j, const RankRuntime& failed) const {
  for (const RankRuntime& o : j.ranks) {
    // A rank not yet re-adopted after a coordinator restart has a worker that may still be on
    // its way back, not gone.
    if (&o == &failed || o.state == "exited" || !o.adopted) continue;
    const Worker* w = registry_.Find(o.placement.worker_id);
    if (w == nullptr || (w->connected && !w->lost)) continue;
    return absl::StrCat("worker ", o.placement.worker_id, " disconnected with rank ",
                        o.placement.rank);
  }
  return "";
}

void JobManager::MarkWorkerLost(Worker& w, const std::string& why, Outbox* out) {
  // Its session, if still open, stays its session (`connected` is only ever what SessionOpened
  // and SessionClosed say): a registration that clears `lost` while that stream is open leaves a
  // worker that is alive on it, not one taken for disconnected while it heartbeats.
  w.lost = true;
  LogLine(absl::StrCat("worker ", w.rec.worker_id, " lost: ", why));
  for (auto& [id, jp] : jobs_) {
    JobRuntime& j = *jp;
    if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
    for (const RankRuntime& r : j.ranks) {
      if (r.placement.worker_id == w.rec.worker_id && r.state != "exited") {
        FailAttempt(j,
                    absl::StrCat("worker ", w.rec.worker_id, " lost (", why, ") with rank ",
                                 r.placement.rank),
                    false, metrics_.restarts_worker_lost, out);
        break;
      }
    }
  }
}

void JobManager::WorkerBack(Worker& w, int64_t now, Outbox* out) {
  w.lost = false;
  LogLine(absl::StrCat("worker ", w.rec.worker_id, " is back (a message after ",
                       Seconds(now - w.last_seen_ms), " of silence)"));
  // Its gangs restarted when it was lost; whatever it still runs of them stops, and their slots
  // drain from now.
  std::set<std::pair<std::string, int64_t>> told;
  for (WorkerSlot& s : w.slots) {
    if (s.job_id.empty()) continue;
    s.drain_deadline_ms = now + health_.FenceMs();
    if (told.insert({s.job_id, s.attempt}).second)
      SendStop(w.rec.worker_id, s.job_id, s.attempt,
               "the gang restarted while this worker was silent", out);
  }
}

bool JobManager::PreviousAttemptGone(const JobRuntime& j, int64_t now) const {
  if (now < j.restart_not_before_ms) return false;  // recovered: ranks unknown, wait it out
  for (const RankRuntime& r : j.ranks)
    if (r.state != "exited" && !r.gone && now < r.dead_by_ms) return false;
  return true;
}

void JobManager::SendStop(const std::string& worker_id, const std::string& job_id, int64_t attempt,
                          const std::string& reason, Outbox* out) const {
  out->messages.emplace_back(worker_id,
                             StopCommand{job_id, attempt, reason, options_.stop_grace_ms});
}

void JobManager::Tick() {
  Outbox out;
  {
    absl::MutexLock l(&mu_);
    SyncHeardLocked();
    const int64_t now = clock_->SteadyMs();
    for (auto& [id, jp] : jobs_) {
      JobRuntime& j = *jp;
      if (j.retry != nullptr) {
        // The store refused this job's last transition: try again (its ranks are stopped).
        const PendingTransition p = *j.retry;
        TransitionOrRetry(j, p.to, p.message, p.add_restarts);
        continue;
      }
      if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
      if (j.adopt_deadline_ms > 0) {
        if (now < j.adopt_deadline_ms) continue;
        for (const RankRuntime& r : j.ranks) {
          if (r.adopted) continue;
          FailAttempt(j,
                      absl::StrCat("coordinator restarted and rank ", r.placement.rank,
                                   " on worker ", r.placement.worker_id,
                                   " was not re-adopted within ",
                                   Seconds(options_.recovery_grace_ms)),
                      false, metrics_.restarts_recovery, &out);
          break;
        }
        if (j.ranks.empty())
          FailAttempt(j, "coordinator restarted and the attempt's placement was lost", false,
                      metrics_.restarts_recovery, &out);
        j.adopt_deadline_ms = 0;
        continue;
      }
      std::vector<RankHealth> ranks;
      for (const RankRuntime& r : j.ranks)
        ranks.push_back({r.placement.rank, r.placement.worker_id, r.state == "exited", r.step,
                         r.last_progress_ms, r.step_ms});
      if (std::string hung = health_.Hung(ranks, now); !hung.empty())
        FailAttempt(j, hung, false, metrics_.restarts_hang, &out);
    }
    for (auto& [id, w] : registry_.workers())
      if (std::string why = health_.Lost(*w, now); !why.empty()) MarkWorkerLost(*w, why, &out);
    registry_.FreeDrained(now);
    Schedule(&out);
  }
  Flush(out);
}

absl::StatusOr<int64_t> JobManager::PruneFinishedJobs() {
  absl::MutexLock l(&mu_);
  std::vector<FinishedJob> finished;
  for (const auto& [id, j] : jobs_)
    if (IsTerminal(j->rec.state)) finished.push_back({id, j->rec.seq, j->rec.updated_ms});
  const std::vector<std::string> prune =
      JobsToPrune(options_.retention, std::move(finished), clock_->NowMs());
  if (prune.empty()) return 0;
  // Durable first: a store that refuses keeps the jobs in memory too.
  RETURN_IF_ERROR(store_->DeleteJobs(prune));
  for (const std::string& id : prune) {
    auto it = jobs_.find(id);
    const JobRuntime& j = *it->second;
    index_.Remove(j.rec.seq, id, j.checkpoint_place, j.rec.request_id);
    jobs_.erase(it);
  }
  LogLine(absl::StrCat("pruned ", prune.size(), " finished job", prune.size() == 1 ? "" : "s",
                       " (retention: ", options_.retention.max_finished_jobs, " jobs, ",
                       options_.retention.max_age_ms / 3600000, " h)"));
  return static_cast<int64_t>(prune.size());
}

std::vector<WorkerView> JobManager::ListWorkers() {
  absl::MutexLock l(&mu_);
  return registry_.Views();
}

std::map<JobState, int64_t> JobManager::JobCounts() const {
  absl::MutexLock l(&mu_);
  std::map<JobState, int64_t> out;
  for (JobState s : kAllJobStates) out[s] = 0;
  for (const auto& [id, j] : jobs_) ++out[j->rec.state];
  return out;
}

std::map<std::string, int64_t> JobManager::WorkerCounts() const {
  absl::MutexLock l(&mu_);
  return registry_.StateCounts();
}

std::map<std::string, int64_t> JobManager::DeviceCounts() const {
  absl::MutexLock l(&mu_);
  return registry_.DeviceCounts();
}

}  // namespace spindle
