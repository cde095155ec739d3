// Job lifecycle: transitions persisted before they are taken, events and their pages, attempts
// stopped, failed and restarted, cancel, recovery, Tick's job checks, pruning, and the client's
// reads (see job_lifecycle.h).
#include "coordinator/job_lifecycle.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/text_bounds.h"
#include "coordinator/job_admission.h"
#include "coordinator/job_pages.h"
#include "coordinator/retention.h"
#include "planner/plan_proto.h"

namespace spindle {
namespace {

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

}  // namespace

absl::Status JobLifecycle::Recover(JobTable& t, std::vector<JobRecord> jobs) {
  const int64_t now = clock_->SteadyMs();
  // Lost unless it reconnects within max(recovery_grace, heartbeat_timeout).
  RETURN_IF_ERROR(t.registry.Load(
      std::max<int64_t>(0, options_->recovery_grace_ms - options_->heartbeat_timeout_ms)));
  for (JobRecord& rec : jobs) {
    auto j = std::make_unique<JobRuntime>();
    // The job as planned at submit (or re-planned since), read back as it was decided: a
    // "fastest" mode or an "auto" recompute is not decided again by an empty cluster.
    if (absl::StatusOr<PlannedJob> stored = DecodePlannedJob(rec.plan); stored.ok()) {
      JobAdmission::AdoptPlan(*j, std::make_shared<const PlannedJob>(*std::move(stored)));
    } else if (absl::StatusOr<JobSpec> spec = ParseJobSpec(rec.spec_json); spec.ok()) {
      // A record of an older release (it stored only the plan): that plan's decisions kept.
      PlannedJob p = PlannedJobOfOlderRecord(*spec, DecodePlan(rec.plan));
      p.requested_json = rec.spec_json;
      JobAdmission::AdoptPlan(*j, std::make_shared<const PlannedJob>(std::move(p)));
    } else {
      LogCoordinatorLine(absl::StrCat("job ", rec.job_id,
                                      ": stored spec no longer parses: ", spec.status().message()));
    }
    ASSIGN_OR_RETURN(j->events, store_->LoadEvents(rec.job_id));
    if (static_cast<int64_t>(j->events.size()) > kMaxEventsPerJob)  // a store of older releases
      j->events.erase(j->events.begin(), j->events.end() - kMaxEventsPerJob);
    j->rec = std::move(rec);
    j->queued_since_ms = now;
    // A restart the previous coordinator process began: ranks of the stopped attempt may still
    // run on workers that have not yet fenced themselves (they fence a heartbeat timeout after
    // the last heartbeat that process acknowledged).
    if (j->rec.state == JobState::kRestarting) j->restart_not_before_ms = now + health_->FenceMs();
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
          Worker* w = t.registry.Find(p.worker_id);
          if (w != nullptr && p.device_index >= 0 &&
              p.device_index < static_cast<int32_t>(w->slots.size())) {
            w->slots[p.device_index] = {j->rec.job_id, j->rec.attempt, p.rank, 0};
          }
        }
      }
      j->adopt_deadline_ms = now + options_->recovery_grace_ms;
    }
    t.Bump(*j);
    if (!j->spec.checkpoint.dir.empty())
      j->checkpoint_place = JobAdmission::SamePlace(j->spec.checkpoint.dir);
    t.index.Add(j->rec.seq, j->rec.job_id, j->checkpoint_place, j->rec.request_id);
    t.jobs[j->rec.job_id] = std::move(j);
  }
  LogCoordinatorLine(absl::StrCat("recovered ", t.jobs.size(), " jobs and ",
                                  t.registry.workers().size(), " workers"));
  return absl::OkStatus();
}

absl::Status JobLifecycle::Transition(JobTable& t, JobRuntime& j, JobState to,
                                      const std::string& message, const AttemptRecord* attempt,
                                      std::optional<JobRecord> next) {
  // The change is made to a copy and applied once the store has it: a failed write leaves the
  // job in memory exactly as the database holds it.
  JobRecord rec = next ? *std::move(next) : j.rec;
  // A pending re-plan is saved with this transition, and stays pending when the write fails.
  const std::shared_ptr<const PlannedJob> plan = j.pending_plan;
  if (plan) rec.plan = EncodePlannedJob(*plan);
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
    LogCoordinatorLine(absl::StrCat("job ", j.rec.job_id, ": ", st.message()));
    return st;
  }
  j.rec = std::move(rec);
  if (plan) {
    JobAdmission::AdoptPlan(j, plan);
    j.pending_plan.reset();
  }
  AddEvent(j, std::move(ev));
  j.retry.reset();  // whatever was pending, this transition supersedes it
  t.Bump(j);
  return absl::OkStatus();
}

void JobLifecycle::TransitionOrRetry(JobTable& t, JobRuntime& j, JobState to,
                                     const std::string& message, int64_t add_restarts) {
  JobRecord next = j.rec;
  next.restarts += add_restarts;
  if (Transition(t, j, to, message, nullptr, std::move(next)).ok()) return;
  j.retry = std::make_unique<PendingTransition>(PendingTransition{to, message, add_restarts});
}

void JobLifecycle::CheckRunning(JobTable& t, JobRuntime& j) {
  if (j.rec.state != JobState::kPlaced || j.adopt_deadline_ms > 0) return;
  for (const RankRuntime& r : j.ranks)
    if (r.state != "running" && r.state != "exited") return;
  Transition(t, j, JobState::kRunning,
             absl::StrCat("attempt ", j.rec.attempt, ": all ", j.ranks.size(), " ranks started"))
      .IgnoreError();
}

void JobLifecycle::StopAttempt(JobTable& t, JobRuntime& j, const std::string& reason, Outbox* out) {
  const int64_t now = clock_->SteadyMs();
  std::set<std::string> told;
  for (RankRuntime& r : j.ranks) {
    if (r.state == "exited") continue;
    r.state = "stopped";
    Worker* wp = t.registry.Find(r.placement.worker_id);
    if (wp == nullptr) continue;
    Worker& w = *wp;
    // Whether or not the Stop reaches it, the rank is dead by then (fencing).
    r.dead_by_ms = health_->DeadBy(w, now);
    const int32_t d = r.placement.device_index;
    // A lost worker's slot drains too: the rank may still run there should the worker be back.
    if (d >= 0 && d < static_cast<int32_t>(w.slots.size()) && w.slots[d].job_id == j.rec.job_id &&
        w.slots[d].attempt == j.rec.attempt)
      w.slots[d].drain_deadline_ms = now + health_->FenceMs();
    if (told.insert(w.rec.worker_id).second && !w.lost)
      SendStop(w.rec.worker_id, j.rec.job_id, j.rec.attempt, reason, out);
  }
  j.adopt_deadline_ms = 0;
  rendezvous_->Close(j.rec.job_id, j.rec.attempt);
}

void JobLifecycle::FailAttempt(JobTable& t, JobRuntime& j, const std::string& reason, bool fatal,
                               Counter* kind, Outbox* out) {
  StopAttempt(t, j, reason, out);
  if (fatal) {
    TransitionOrRetry(t, j, JobState::kFailed,
                      absl::StrCat(reason, " (invalid input; not restarted)"));
  } else if (j.rec.restarts >= j.rec.max_restarts) {
    TransitionOrRetry(
        t, j, JobState::kFailed,
        absl::StrCat(reason, "; out of restarts (", j.rec.restarts, "/", j.rec.max_restarts, ")"));
  } else {
    j.queued_since_ms = clock_->SteadyMs();
    if (kind) kind->Increment();
    TransitionOrRetry(
        t, j, JobState::kRestarting,
        absl::StrCat(reason, "; restart ", j.rec.restarts + 1, "/", j.rec.max_restarts,
                     j.rec.last_checkpoint_step > 0
                         ? absl::StrCat(" from checkpoint step ", j.rec.last_checkpoint_step)
                         : std::string(" from scratch"),
                     // The ranks' workers may hold a newer replica; the attempt's event says.
                     j.spec.checkpoint.replicas_every > 0 ? " or a newer in-memory replica" : ""),
        /*add_restarts=*/1);
  }
}

void JobLifecycle::SendStop(const std::string& worker_id, const std::string& job_id,
                            int64_t attempt, const std::string& reason, Outbox* out) const {
  out->messages.emplace_back(worker_id,
                             StopCommand{job_id, attempt, reason, options_->stop_grace_ms});
}

absl::StatusOr<bool> JobLifecycle::Cancel(JobTable& t, const std::string& job_id,
                                          const std::string& reason, const User* by, JobView* out,
                                          Outbox* box) {
  JobRuntime* j = t.Find(job_id);
  if (!j) return JobNotFound(job_id);
  if (by != nullptr && !by->admin && by->name != j->rec.owner)
    return absl::PermissionDeniedError(absl::StrCat(
        "job ", job_id, " belongs to ", j->rec.owner.empty() ? "no named user" : j->rec.owner,
        "; only its owner or an admin may cancel it"));
  bool cancelled = false;
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
    RETURN_IF_ERROR(Transition(t, *j, JobState::kCancelled, msg));
    if (running) StopAttempt(t, *j, msg, box);
    cancelled = true;
  }
  FillJob(*j, true, out, 0, kDefaultEventPageSize);
  return cancelled;
}

void JobLifecycle::TickJobs(JobTable& t, int64_t now, Outbox* out) {
  for (auto& [id, jp] : t.jobs) {
    JobRuntime& j = *jp;
    if (j.retry != nullptr) {
      // The store refused this job's last transition: try again (its ranks are stopped).
      const PendingTransition p = *j.retry;
      TransitionOrRetry(t, j, p.to, p.message, p.add_restarts);
      continue;
    }
    if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
    if (j.adopt_deadline_ms > 0) {
      if (now < j.adopt_deadline_ms) continue;
      for (const RankRuntime& r : j.ranks) {
        if (r.adopted) continue;
        FailAttempt(t, j,
                    absl::StrCat("coordinator restarted and rank ", r.placement.rank, " on worker ",
                                 r.placement.worker_id, " was not re-adopted within ",
                                 Seconds(options_->recovery_grace_ms)),
                    false, metrics_->restarts_recovery, out);
        break;
      }
      if (j.ranks.empty())
        FailAttempt(t, j, "coordinator restarted and the attempt's placement was lost", false,
                    metrics_->restarts_recovery, out);
      j.adopt_deadline_ms = 0;
      continue;
    }
    std::vector<RankHealth> ranks;
    for (const RankRuntime& r : j.ranks)
      ranks.push_back({r.placement.rank, r.placement.worker_id, r.state == "exited", r.step,
                       r.last_progress_ms, r.step_ms});
    if (std::string hung = health_->Hung(ranks, now); !hung.empty())
      FailAttempt(t, j, hung, false, metrics_->restarts_hang, out);
  }
}

absl::StatusOr<int64_t> JobLifecycle::PruneFinishedJobs(JobTable& t) {
  std::vector<FinishedJob> finished;
  for (const auto& [id, j] : t.jobs)
    if (IsTerminal(j->rec.state)) finished.push_back({id, j->rec.seq, j->rec.updated_ms});
  const std::vector<std::string> prune =
      JobsToPrune(options_->retention, std::move(finished), clock_->NowMs());
  if (prune.empty()) return 0;
  // Durable first: a store that refuses keeps the jobs in memory too.
  RETURN_IF_ERROR(store_->DeleteJobs(prune));
  for (const std::string& id : prune) {
    auto it = t.jobs.find(id);
    const JobRuntime& j = *it->second;
    t.index.Remove(j.rec.seq, id, j.checkpoint_place, j.rec.request_id);
    t.jobs.erase(it);
  }
  LogCoordinatorLine(absl::StrCat("pruned ", prune.size(), " finished job",
                                  prune.size() == 1 ? "" : "s",
                                  " (retention: ", options_->retention.max_finished_jobs, " jobs, ",
                                  options_->retention.max_age_ms / 3600000, " h)"));
  return static_cast<int64_t>(prune.size());
}

absl::Status JobLifecycle::GetJob(const JobTable& t, const std::string& job_id, bool with_events,
                                  JobView* out, const EventPageRequest& page) const {
  if (page.page_size < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("get: events_page_size must not be negative, got ", page.page_size));
  ASSIGN_OR_RETURN(const int64_t from, ParseEventPageToken(page.page_token));
  const int size =
      page.page_size == 0 ? kDefaultEventPageSize : std::min(page.page_size, kMaxEventPageSize);
  const JobRuntime* j = t.Find(job_id);
  if (!j) return JobNotFound(job_id);
  FillJob(*j, with_events, out, from, size);
  return absl::OkStatus();
}

absl::Status JobLifecycle::ListJobPage(const JobTable& t, const std::set<JobState>& states,
                                       int page_size, const std::string& page_token,
                                       std::vector<JobView>* jobs, std::string* next_page_token,
                                       const std::string* owner) const {
  ASSIGN_OR_RETURN(const int64_t before, ParsePageToken(page_token));
  next_page_token->clear();
  int64_t last_seq = 0;
  t.index.VisitNewestFirst(
      before, [&](int64_t seq, const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu) {
        const JobRuntime* j = t.Find(id);
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

absl::Status JobLifecycle::WaitJob(JobTable& t, const std::string& job_id, uint64_t* version,
                                   size_t* events_seen, absl::Duration max_wait, JobView* out,
                                   std::vector<EventRecord>* new_events) const {
  const JobRuntime* j = t.Find(job_id);
  if (!j) return JobNotFound(job_id);
  // Looked up again after the wait: a finished job may be pruned meanwhile.
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu) {
    const JobRuntime* now = t.Find(job_id);
    return now == nullptr || now->version != *version;
  };
  if (j->version == *version) {
    t.mu.AwaitWithTimeout(absl::Condition(&changed), max_wait);
    j = t.Find(job_id);
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

void JobLifecycle::FillJob(const JobRuntime& j, bool with_events, JobView* out, int64_t events_from,
                           int events_page) const {
  const JobRecord& r = j.rec;
  *out = JobView{};
  out->record = r;
  if (j.planned) out->plan = j.planned->plan;
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
  if (const std::optional<double> g = j.goodput.Goodput(clock_->SteadyMs())) out->goodput = *g;
  if (with_events) {
    const int64_t first = std::max<int64_t>(0, events_from - j.events_dropped);
    const int64_t end =
        std::min<int64_t>(static_cast<int64_t>(j.events.size()), first + events_page);
    if (first < end) out->events.assign(j.events.begin() + first, j.events.begin() + end);
    if (end < static_cast<int64_t>(j.events.size()))
      out->next_events_page_token = absl::StrCat(kEventTokenPrefix, j.events_dropped + end);
  }
}

}  // namespace spindle
