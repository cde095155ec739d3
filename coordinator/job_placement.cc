// Placement of gangs: the scheduling pass, fencing of the previous attempt, reachability,
// assignments and the recompute decisions a placement takes (see job_placement.h).
#include "coordinator/job_placement.h"

#include <algorithm>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/host_port.h"
#include "common/metrics.h"
#include "coordinator/scheduler.h"
#include "planner/cp_cost_model.h"

namespace spindle {
namespace {

std::string RandomToken() {
  std::random_device rd;
  uint64_t a = (uint64_t{rd()} << 32) ^ rd(), b = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrFormat("%016x%016x", a, b);
}

}  // namespace

void JobPlacement::Schedule(JobTable& t, Outbox* out) {
  // With every device taken (a long queue on a full cluster) there is nothing to place: no pass
  // over the queued jobs.
  bool any_free = false;
  for (const auto& [id, w] : t.registry.workers()) {
    if (!w->connected || w->lost || w->leaving) continue;
    for (const auto& slot : w->slots) any_free |= slot.job_id.empty();
    if (any_free) break;
  }
  if (!any_free) return;
  const int64_t now = clock_->SteadyMs();
  std::vector<JobRuntime*> waiting;
  for (const auto& [id, j] : t.jobs) {
    if (j->rec.state != JobState::kQueued && j->rec.state != JobState::kRestarting) continue;
    // No rank of the stopped attempt may still train when the next one starts.
    if (j->rec.state == JobState::kRestarting && !PreviousAttemptGone(*j, now)) continue;
    waiting.push_back(j.get());
  }
  if (waiting.empty()) return;
  elastic_.ResizeWaiting(t, waiting, now);
  std::vector<SchedulableJob> cands;
  for (const JobRuntime* j : waiting) {
    SchedulableJob sj;
    sj.job_id = j->rec.job_id;
    sj.priority = j->rec.priority;
    sj.seq = j->rec.seq;
    sj.world = j->spec.parallel.world();
    sj.kind = j->spec.resources;
    sj.memory_bytes_per_rank = j->memory_per_rank;
    sj.host_bytes_per_rank = j->host_bytes_per_rank;
    cands.push_back(sj);
  }
  std::vector<SchedulableWorker> ws = SchedulableWorkers(t);
  for (const GangPlacement& p : ScheduleGangs(std::move(cands), std::move(ws))) {
    PlaceJob(t, *t.jobs[p.job_id], p.ranks, out);
  }
}

void JobPlacement::PlaceJob(JobTable& t, JobRuntime& j, const std::vector<RankPlacement>& ranks,
                            Outbox* out) {
  const int64_t now = clock_->SteadyMs();
  if (absl::Status reach = CheckReachable(t, ranks); !reach.ok()) {
    lifecycle_->TransitionOrRetry(t, j, JobState::kFailed, std::string(reach.message()));
    return;
  }
  const std::string replanned = ReplanForPlacement(t, j, ranks);
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
  if (!lifecycle_
           ->Transition(
               t, j, JobState::kPlaced,
               absl::StrCat("attempt ", a.attempt, " placed on ", absl::StrJoin(parts, ", "),
                            replanned.empty() ? "" : "; ", replanned),
               &a,
               std::move(next))
           .ok()) {
    return;
  }
  if (scheduling_latency_seconds_)
    scheduling_latency_seconds_->Observe((now - j.queued_since_ms) / 1000.0);
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
    t.registry.Find(p.worker_id)->slots[p.device_index] = {j.rec.job_id, j.rec.attempt, p.rank, 0};
    out->messages.emplace_back(p.worker_id, MakeAssignment(t, j, p));
  }
}

AssignmentCommand JobPlacement::MakeAssignment(const JobTable& t, const JobRuntime& j,
                                               const RankPlacement& p) const {
  AssignmentCommand a;
  a.ref = {j.rec.job_id, j.rec.attempt, p.rank};
  a.job = j.planned;
  a.rendezvous_address = t.rendezvous_address;
  a.rendezvous_token = j.token;
  a.resume_step = j.rec.last_checkpoint_step;
  a.resume_path = j.rec.last_checkpoint_path;
  a.device_index = p.device_index;
  if (const Worker* w = t.registry.Find(p.worker_id)) a.host_address = w->address;
  return a;
}

absl::Status JobPlacement::CheckReachable(const JobTable& t,
                                          const std::vector<RankPlacement>& ranks) const {
  // A worker that reached the coordinator over loopback shares its host; its ranks' Gloo address
  // would be loopback too, which ranks on other hosts cannot reach.
  std::string local, remote;
  for (const RankPlacement& p : ranks) {
    const Worker* w = t.registry.Find(p.worker_id);
    if (w == nullptr) continue;
    (IsLoopbackHost(w->address) ? local : remote) = p.worker_id;
  }
  if (local.empty() || remote.empty()) return absl::OkStatus();
  const Worker& l = *t.registry.Find(local);
  const Worker& r = *t.registry.Find(remote);
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot place the job across workers ", local, " and ", remote, ": ", local, "'s address ",
      l.address,
      " (it reaches the coordinator over loopback) cannot be reached "
      "from ",
      remote, " at ", r.address, "; start ", local,
      " with --advertise-host=<an address the other hosts reach>, or connect it to the "
      "coordinator's network address"));
}

bool JobPlacement::PreviousAttemptGone(const JobRuntime& j, int64_t now) {
  if (now < j.restart_not_before_ms) return false;  // recovered: ranks unknown, wait it out
  for (const RankRuntime& r : j.ranks)
    if (r.state != "exited" && !r.gone && now < r.dead_by_ms) return false;
  return true;
}

std::string JobPlacement::ReplanForPlacement(const JobTable& t, JobRuntime& j,
                                             const std::vector<RankPlacement>& ranks) const {
  if (!j.planned) return "";
  const Topology topo = admission_->TopologyLocked(t, j.spec);
  std::string change;
  PlannedJob next = Replan(*j.planned, ReplanCause::kPlacement,
                           JobAdmission::SmallestDeviceMemory(t, ranks), &topo, &change);
  // Taken with the placement's transition.
  if (!change.empty()) j.pending_plan = std::make_shared<const PlannedJob>(std::move(next));
  return change;
}

void JobPlacement::RecomputeMoreAfterOutOfMemory(const JobTable& t, JobRuntime& j,
                                                 std::string* reason) const {
  if (!j.planned) return;
  const Topology topo = admission_->TopologyLocked(t, j.spec);
  std::string change;
  PlannedJob next = Replan(*j.planned, ReplanCause::kOutOfMemory,
                           t.registry.LargestDeviceMemory(j.spec.resources), &topo, &change);
  if (change.empty()) return;
  j.pending_plan = std::make_shared<const PlannedJob>(std::move(next));  // the restart's
  absl::StrAppend(reason, "; ", change);
}

}  // namespace spindle
