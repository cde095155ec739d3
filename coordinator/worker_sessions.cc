// Worker sessions and their reports: registration, hellos, closed sessions, signs of life, lost
// and returning workers, and one handler per report kind (see worker_sessions.h).
#include "coordinator/worker_sessions.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/text_bounds.h"

namespace spindle {

struct WorkerSessions::ReportContext {
  Worker& w;
  const std::string& worker_id;
  int64_t now;   // steady: timers
  int64_t wall;  // what is recorded and shown
  Outbox* out;
  // Tells the worker to stop a rank the coordinator does not expect (a stale attempt).
  void StopStale(const JobLifecycle& lifecycle, const RankKey& ref) const {
    lifecycle.SendStop(worker_id, ref.job_id, ref.attempt, "not expected by the coordinator", out);
  }
};

// std::visit's visitor: each kind of report to its OnReport, under the table's mutex.
struct WorkerSessions::ReportDispatch {
  WorkerSessions& sessions;
  JobTable& t;
  ReportContext& c;
  template <typename Report>
  void operator()(const Report& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu) {
    sessions.OnReport(t, c, r);
  }
};

void WorkerSessions::IgnoredRankReport() const {
  if (metrics_->ignored_rank_reports) metrics_->ignored_rank_reports->Increment();
}

void WorkerSessions::HeardFrom(const std::string& worker_id) {
  const int64_t steady = clock_->SteadyMs(), wall = clock_->NowMs();
  absl::MutexLock l(&heard_mu_);
  // Only registered workers have an entry worth keeping: the session checked its hello.
  heard_[worker_id] = {steady, wall};
}

void WorkerSessions::SyncHeardLocked(JobTable& t) {
  std::map<std::string, std::pair<int64_t, int64_t>> heard;
  {
    absl::MutexLock l(&heard_mu_);
    heard.swap(heard_);
  }
  for (const auto& [id, when] : heard) {
    Worker* w = t.registry.Find(id);
    if (w == nullptr || when.first <= w->last_seen_ms) continue;
    w->last_seen_ms = when.first;
    w->last_seen_unix_ms = when.second;
  }
}

absl::Status WorkerSessions::CheckHello(const JobTable& t, const WorkerHello& hello) const {
  return t.registry.CheckOpen(hello.worker_id, hello.instance_id);
}

absl::StatusOr<RegistrationReply> WorkerSessions::RegisterWorker(JobTable& t,
                                                                 const WorkerRegistration& reg) {
  RETURN_IF_ERROR(t.registry.Register(reg).status());
  RegistrationReply reply;
  reply.heartbeat_interval_ms = options_->heartbeat_interval_ms;
  reply.heartbeat_timeout_ms = options_->heartbeat_timeout_ms;
  reply.stop_grace_ms = options_->stop_grace_ms;
  reply.observed_host = reg.observed_host;
  return reply;
}

absl::Status WorkerSessions::SessionOpened(JobTable& t, const WorkerHello& hello,
                                           uint64_t session_id, Outbox* out) {
  ASSIGN_OR_RETURN(Worker * opened,
                   t.registry.Open(hello.worker_id, hello.instance_id, session_id));
  Worker& w = *opened;
  const int64_t now = clock_->SteadyMs();
  SyncHeardLocked(t);
  std::set<std::pair<std::string, int64_t>> stops;
  std::set<std::tuple<std::string, int64_t, int64_t>> listed;
  int unknown_stops = 0;
  for (const RunningRankReport& rr : hello.running) {
    const RankKey& ref = rr.ref;
    if (!MayHaveGiven(t, w.rec.worker_id, ref)) {
      IgnoredRankReport();
      continue;
    }
    listed.insert({ref.job_id, ref.attempt, ref.rank});
    JobRuntime* j = t.Find(ref.job_id);
    bool expected = j && IsActive(j->rec.state) && j->rec.attempt == ref.attempt && ref.rank >= 0 &&
                    ref.rank < static_cast<int64_t>(j->ranks.size()) &&
                    j->ranks[ref.rank].placement.worker_id == w.rec.worker_id &&
                    j->ranks[ref.rank].state != "exited" && j->ranks[ref.rank].state != "stopped";
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
    lifecycle_->SendStop(w.rec.worker_id, job_id, attempt, "not expected by the coordinator", out);
  // Ranks placed on this worker that it no longer runs: the gang restarts, unless the worker
  // never started them (it did not acknowledge the assignment: the stream broke first), in
  // which case the assignment is sent again.
  for (auto& [id, jp] : t.jobs) {
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
          out->messages.emplace_back(w.rec.worker_id,
                                     placement_->MakeAssignment(t, j, r.placement));
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
      lifecycle_->FailAttempt(
          t, j, missing, false,
          j.adopt_deadline_ms > 0 ? metrics_->restarts_recovery : metrics_->restarts_worker_lost,
          out);
      for (int32_t d : gone) t.registry.Release(w.rec.worker_id, d, j.rec.job_id, attempt);
      continue;
    }
    if (j.adopt_deadline_ms > 0) {
      bool all = true;
      for (const RankRuntime& r : j.ranks) all = all && r.adopted;
      if (all) {
        j.adopt_deadline_ms = 0;
        t.Bump(j);
        lifecycle_->CheckRunning(t, j);
      }
    }
  }
  placement_->Schedule(t, out);
  return absl::OkStatus();
}

void WorkerSessions::SessionClosed(JobTable& t, const std::string& worker_id, uint64_t session_id) {
  Worker* found = t.registry.Find(worker_id);
  if (found == nullptr || found->session_id != session_id) return;
  Worker& w = *found;
  w.connected = false;
  if (w.leaving) {
    // Its gangs were restarted at Leaving; whatever it still held is free.
    w.lost = w.left = true;
    for (auto& s : w.slots) s = {};
    LogCoordinatorLine(absl::StrCat("worker ", w.rec.worker_id, " left"));
  }
}

void WorkerSessions::WorkerRevoked(JobTable& t, const std::string& worker_id,
                                   const std::string& by) {
  const int64_t wall = clock_->NowMs();
  for (auto& [id, jp] : t.jobs) {
    JobRuntime& j = *jp;
    if (!IsActive(j.rec.state)) continue;
    bool on = false;
    for (const RankRuntime& r : j.ranks)
      on |= r.placement.worker_id == worker_id && r.state != "exited" && r.state != "stopped";
    if (!on) continue;
    EventRecord ev{j.rec.job_id, j.rec.attempt, wall, j.rec.state,
                   absl::StrCat("worker ", worker_id, " revoked", by.empty() ? "" : " by ", by)};
    if (absl::Status st = store_->SaveJob(j.rec, &ev); !st.ok()) {
      LogCoordinatorLine(std::string(st.message()));
      continue;
    }
    AddEvent(j, std::move(ev));
    t.Bump(j);
  }
}

void WorkerSessions::MarkLostWorkers(JobTable& t, int64_t now, Outbox* out) {
  for (auto& [id, w] : t.registry.workers())
    if (std::string why = health_->Lost(*w, now); !why.empty()) MarkWorkerLost(t, *w, why, out);
}

void WorkerSessions::MarkWorkerLost(JobTable& t, Worker& w, const std::string& why, Outbox* out) {
  // Its session, if still open, stays its session (`connected` is only ever what SessionOpened
  // and SessionClosed say): a registration that clears `lost` while that stream is open leaves a
  // worker that is alive on it, not one taken for disconnected while it heartbeats.
  w.lost = true;
  LogCoordinatorLine(absl::StrCat("worker ", w.rec.worker_id, " lost: ", why));
  for (auto& [id, jp] : t.jobs) {
    JobRuntime& j = *jp;
    if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
    for (const RankRuntime& r : j.ranks) {
      if (r.placement.worker_id == w.rec.worker_id && r.state != "exited") {
        lifecycle_->FailAttempt(t, j,
                                absl::StrCat("worker ", w.rec.worker_id, " lost (", why,
                                             ") with rank ", r.placement.rank),
                                false, metrics_->restarts_worker_lost, out);
        break;
      }
    }
  }
}

void WorkerSessions::WorkerBack(JobTable& t, Worker& w, int64_t now, Outbox* out) {
  w.lost = false;
  LogCoordinatorLine(absl::StrCat("worker ", w.rec.worker_id, " is back (a message after ",
                                  Seconds(now - w.last_seen_ms), " of silence)"));
  // Its gangs restarted when it was lost; whatever it still runs of them stops, and their slots
  // drain from now.
  std::set<std::pair<std::string, int64_t>> told;
  for (WorkerSlot& s : w.slots) {
    if (s.job_id.empty()) continue;
    s.drain_deadline_ms = now + health_->FenceMs();
    if (told.insert({s.job_id, s.attempt}).second)
      lifecycle_->SendStop(w.rec.worker_id, s.job_id, s.attempt,
                           "the gang restarted while this worker was silent", out);
  }
}

void WorkerSessions::HandleWorkerMessage(JobTable& t, const std::string& worker_id,
                                         const WorkerReport& report, Outbox* out) {
  SyncHeardLocked(t);
  Worker* found = t.registry.Find(worker_id);
  if (found == nullptr) return;
  Worker& w = *found;
  ReportContext c{w, worker_id, clock_->SteadyMs(), clock_->NowMs(), out};
  if (w.lost && !w.left) WorkerBack(t, w, c.now, out);
  t.registry.Seen(w);
  std::visit(ReportDispatch{*this, t, c}, report);
}

bool WorkerSessions::MayHaveGiven(const JobTable& t, const std::string& worker_id,
                                  const RankKey& ref) {
  const JobRuntime* found = t.Find(ref.job_id);
  if (found == nullptr) return true;
  const JobRuntime& j = *found;
  if (ref.attempt < 1 || ref.attempt > j.rec.attempt || ref.rank < 0 ||
      ref.rank >= j.spec.parallel.world())
    return false;
  if (ref.attempt == j.rec.attempt && ref.rank < static_cast<int64_t>(j.ranks.size()))
    return j.ranks[ref.rank].placement.worker_id == worker_id;
  return true;
}

std::pair<JobRuntime*, RankRuntime*> WorkerSessions::CurrentRank(JobTable& t,
                                                                 const std::string& worker_id,
                                                                 const RankKey& ref) {
  JobRuntime* j = t.Find(ref.job_id);
  // A job whose ranks were stopped and whose transition waits for the store has no current rank.
  if (!j || j->retry != nullptr || !IsActive(j->rec.state) || j->rec.attempt != ref.attempt ||
      ref.rank < 0 || ref.rank >= static_cast<int64_t>(j->ranks.size()))
    return {nullptr, nullptr};
  RankRuntime& r = j->ranks[ref.rank];
  if (r.placement.worker_id != worker_id) return {nullptr, nullptr};
  return {j, &r};
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const HeartbeatReport& h) {
  std::set<std::pair<std::string, int64_t>> stopped;
  // A rank that pulses (its trainer prints a line every second) and has been silent for the
  // silence timeout is stopped (a frozen process, a hung host), while its peers wait for it in a
  // collective: found in seconds, whatever the job's step time.
  std::map<JobRuntime*, std::string> silent;
  int unknown_stops = 0;
  for (const RunningRankReport& rr : h.running) {
    if (!MayHaveGiven(t, c.worker_id, rr.ref)) {
      IgnoredRankReport();
      continue;
    }
    auto [j, r] = CurrentRank(t, c.worker_id, rr.ref);
    if (j && r->state != "stopped" && r->state != "exited") {
      if (std::string why =
              rr.pulsing ? health_->Silent(rr.ref.rank, c.worker_id, rr.silent_ms, r->step) : "";
          !why.empty() && !silent.count(j))
        silent[j] = why;
      continue;
    }
    // Stopped ranks still draining are told again only when their drain is over due.
    if (j == nullptr && t.Find(rr.ref.job_id) != nullptr) {
      bool draining = false;
      for (const auto& s : c.w.slots)
        draining |=
            s.job_id == rr.ref.job_id && s.attempt == rr.ref.attempt && s.drain_deadline_ms > c.now;
      if (draining) continue;
    }
    if (stopped.count({rr.ref.job_id, rr.ref.attempt})) continue;
    if (t.Find(rr.ref.job_id) == nullptr && ++unknown_stops > kMaxUnknownJobStopsPerReport) {
      IgnoredRankReport();
      continue;
    }
    stopped.insert({rr.ref.job_id, rr.ref.attempt});
    c.StopStale(*lifecycle_, rr.ref);
  }
  for (auto& [j, why] : silent)
    lifecycle_->FailAttempt(t, *j, why, false, metrics_->restarts_hang, c.out);
  if (!silent.empty()) placement_->Schedule(t, c.out);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const RankStartedReport& s) {
  auto [j, r] = CurrentRank(t, c.worker_id, s.ref);
  if (!j) return;
  if (r->state == "assigned") r->state = "running";
  r->last_progress_ms = c.now;
  r->last_report_ms = c.wall;
  j->goodput.OnStart(s.ref.attempt, c.now);
  t.Bump(*j);
  lifecycle_->CheckRunning(t, *j);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const RankProgressReport& p) {
  auto [j, r] = CurrentRank(t, c.worker_id, p.ref);
  if (!j) {
    if (MayHaveGiven(t, c.worker_id, p.ref))
      c.StopStale(*lifecycle_, p.ref);
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
  if (p.ref.rank == 0) {
    j->goodput.OnCheckpoint(j->rec.last_checkpoint_step);
    j->goodput.OnProgress(p.ref.attempt, p.step, p.elapsed_s, p.total_steps, c.now,
                          p.resumed_from_step);
  }
  if (j->rate_ref_step < 0) {
    int64_t min_step = r->step;
    for (const RankRuntime& o : j->ranks) min_step = std::min(min_step, o.step);
    if (min_step > 0) {
      j->rate_ref_step = min_step;
      j->rate_ref_ms = c.now;
    }
  }
  t.Bump(*j);
  lifecycle_->CheckRunning(t, *j);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const CheckpointDoneReport& d) {
  auto [j, r] = CurrentRank(t, c.worker_id, d.ref);
  if (!j) return;
  r->last_progress_ms = c.now;
  if (d.ref.rank == 0) j->goodput.OnCheckpoint(d.step);  // rank 0 reports it once committed
  if (d.step <= j->rec.last_checkpoint_step) {
    t.Bump(*j);
    return;  // complete already
  }
  // Steps the ranks have not all reported are kept up to a bound, the oldest given up first: a
  // rank reporting steps that never complete cannot grow the job's record without end.
  if (!j->checkpoints.count(d.step) &&
      static_cast<int64_t>(j->checkpoints.size()) >= kMaxPendingCheckpoints) {
    if (d.step < j->checkpoints.begin()->first) return;
    j->checkpoints.erase(j->checkpoints.begin());
  }
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
      LogCoordinatorLine(std::string(st.message()));
      return;
    }
    j->rec = std::move(next);
    AddEvent(*j, ev);
    for (auto it = j->checkpoints.begin(); it != j->checkpoints.end();)
      it = it->first <= d.step ? j->checkpoints.erase(it) : std::next(it);
    // An elastic job below its largest world grows here when devices for more ranks are free.
    placement_->GrowAtCheckpoint(t, *j, c.out);
  }
  t.Bump(*j);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const RankExitReport& e) {
  const RankKey& ref = e.ref;
  auto [j, r] = CurrentRank(t, c.worker_id, ref);
  if (!j) {
    // A stopped or stale rank: its device is free now.
    JobRuntime* any = t.Find(ref.job_id);
    if (any && any->rec.attempt == ref.attempt && ref.rank >= 0 &&
        ref.rank < static_cast<int64_t>(any->ranks.size())) {
      RankRuntime& rr = any->ranks[ref.rank];
      if (rr.placement.worker_id == c.worker_id) {
        rr.gone = true;
        rr.exit_code = e.exit_code;
        if (rr.state != "exited") rr.state = "stopped";
        t.Bump(*any);
      }
    }
    for (WorkerSlot& s : c.w.slots)
      if (s.job_id == ref.job_id && s.attempt == ref.attempt && s.rank == ref.rank) s = {};
    placement_->Schedule(t, c.out);
    return;
  }
  t.registry.Release(c.worker_id, r->placement.device_index, j->rec.job_id, j->rec.attempt);
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
      lifecycle_->TransitionOrRetry(t, *j, JobState::kSucceeded,
                                    absl::StrCat("all ", j->ranks.size(), " ranks finished"));
    } else {
      t.Bump(*j);
    }
  } else {
    std::string why = e.signal != 0 ? absl::StrCat("was killed by signal ", e.signal)
                                    : absl::StrCat("exited with code ", e.exit_code);
    std::string reason = absl::StrCat("rank ", ref.rank, " on worker ", c.worker_id, " ", why);
    if (!e.stderr_tail.empty()) absl::StrAppend(&reason, ": ", e.stderr_tail.back());
    // A worker that vanished (its session closed) takes its ranks with it, and their peers then
    // fail in their collectives: name the vanished worker as the cause.
    if (std::string gone = DisconnectedPeer(t, *j, *r); !gone.empty())
      reason = absl::StrCat(gone, "; then ", reason);
    if (e.signal == 0 && e.exit_code == kExitOutOfMemory)
      placement_->RecomputeMoreAfterOutOfMemory(t, *j, &reason);
    lifecycle_->FailAttempt(t, *j, reason, e.signal == 0 && e.exit_code == kExitInvalidInput,
                            metrics_->restarts_rank_failed, c.out);
  }
  placement_->Schedule(t, c.out);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const LeavingReport& l) {
  c.w.leaving = true;
  const std::string why =
      absl::StrCat("worker ", c.worker_id, " is shutting down (", l.reason, ")");
  LogCoordinatorLine(why);
  for (auto& [id, jp] : t.jobs) {
    JobRuntime& j = *jp;
    if (!IsActive(j.rec.state) || j.retry != nullptr) continue;
    for (const RankRuntime& r : j.ranks) {
      if (r.placement.worker_id != c.worker_id || r.state == "exited") continue;
      lifecycle_->FailAttempt(t, j, absl::StrCat(why, " with rank ", r.placement.rank), false,
                              metrics_->restarts_worker_left, c.out);
      break;
    }
  }
  placement_->Schedule(t, c.out);
}

void WorkerSessions::OnReport(JobTable& t, ReportContext& c, const RankNoteReport& n) {
  auto [j, r] = CurrentRank(t, c.worker_id, n.ref);
  if (!j) return;
  // A note is one line of the job's events, bounded like every field a worker sends (cut on a
  // character boundary where the session took it in).
  EventRecord ev{j->rec.job_id, j->rec.attempt, c.wall, j->rec.state,
                 absl::StrCat("rank ", n.ref.rank, ": ", BoundedUtf8(n.text, kMaxNoteBytes))};
  if (absl::Status st = store_->SaveJob(j->rec, &ev); !st.ok()) {
    LogCoordinatorLine(std::string(st.message()));
    return;
  }
  AddEvent(*j, std::move(ev));
  t.Bump(*j);
}

std::string WorkerSessions::DisconnectedPeer(const JobTable& t, const JobRuntime& j,
                                             const RankRuntime& failed) {
  for (const RankRuntime& o : j.ranks) {
    // A rank not yet re-adopted after a coordinator restart has a worker that may still be on
    // its way back, not gone.
    if (&o == &failed || o.state == "exited" || !o.adopted) continue;
    const Worker* w = t.registry.Find(o.placement.worker_id);
    if (w == nullptr || (w->connected && !w->lost)) continue;
    return absl::StrCat("worker ", o.placement.worker_id, " disconnected with rank ",
                        o.placement.rank);
  }
  return "";
}

}  // namespace spindle
