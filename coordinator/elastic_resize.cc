// World changes of elastic jobs: shrinking a job that waits too long, growing one when devices
// come back (see elastic_resize.h).
#include "coordinator/elastic_resize.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/planned_job.h"

namespace spindle {
namespace {

// Whether a gang of `world` ranks of `j` laid out by `plan` fits `workers` now.
bool Fits(const JobRuntime& j, int64_t world, const CpPlan& plan,
          const std::vector<SchedulableWorker>& workers) {
  SchedulableJob sj;
  sj.job_id = j.rec.job_id;
  sj.world = world;
  sj.kind = j.spec.resources;
  sj.memory_bytes_per_rank = plan.memory.total_bytes;
  sj.host_bytes_per_rank = plan.memory.host_bytes;
  return !ScheduleGangs({sj}, workers).empty();
}

int64_t FreeDevices(const std::vector<SchedulableWorker>& workers, const std::string& kind) {
  int64_t n = 0;
  for (const SchedulableWorker& w : workers)
    if (w.kind == kind) n += static_cast<int64_t>(w.free_devices.size());
  return n;
}

// Whether a job other than `j`, of its resources, waits for devices (QUEUED, or RESTARTING): a
// job does not grow into devices one of those waits for.
bool OthersWait(const JobTable& t, const JobRuntime& j) {
  for (const auto& [id, other] : t.jobs) {
    if (other.get() == &j || other->spec.resources != j.spec.resources) continue;
    if (other->rec.state == JobState::kQueued || other->rec.state == JobState::kRestarting)
      return true;
  }
  return false;
}

}  // namespace

std::vector<SchedulableWorker> SchedulableWorkers(const JobTable& t,
                                                  const std::string& as_free_job) {
  std::vector<SchedulableWorker> ws;
  for (const auto& [id, w] : t.registry.workers()) {
    if (!w->connected || w->lost || w->leaving) continue;
    SchedulableWorker sw = w->Schedulable();
    sw.total_devices = static_cast<int32_t>(w->slots.size());
    for (size_t d = 0; d < w->slots.size(); ++d) {
      const std::string& job_id = w->slots[d].job_id;
      if (job_id.empty() || (!as_free_job.empty() && job_id == as_free_job)) {
        sw.free_devices.push_back(static_cast<int32_t>(d));
      } else if (const JobRuntime* holder = t.Find(job_id)) {
        sw.host_pinned_bytes += holder->host_bytes_per_rank;
      }
    }
    ws.push_back(std::move(sw));
  }
  return ws;
}

int64_t ElasticResize::LargestPlaceable(const JobTable& t, const JobRuntime& j, int64_t lo,
                                        int64_t hi, const std::vector<SchedulableWorker>& workers,
                                        std::shared_ptr<const PlannedJob>* next,
                                        std::string* change) const {
  const int64_t present = j.spec.parallel.world();
  const int64_t free = FreeDevices(workers, j.spec.resources);
  const Topology topo = admission_->TopologyLocked(t, j.spec);
  for (int64_t world = std::min(hi, free); world >= lo; --world) {
    if (world == present) continue;
    PlannedJob p = ReplanForWorld(*j.planned, world, j.planned->plan.memory.device_memory_bytes,
                                  &topo, change);
    if (!p.ok() || !Fits(j, world, p.plan, workers)) continue;
    *next = std::make_shared<const PlannedJob>(std::move(p));
    return world;
  }
  change->clear();
  return 0;
}

void ElasticResize::ResizeWaiting(JobTable& t, const std::vector<JobRuntime*>& waiting,
                                  int64_t now) {
  std::vector<SchedulableWorker> workers;
  bool have_workers = false;
  for (JobRuntime* jp : waiting) {
    JobRuntime& j = *jp;
    const ElasticSpec& e = j.spec.parallel.elastic;
    if (!e.enabled() || !j.planned || j.retry != nullptr) continue;
    if (!have_workers) workers = SchedulableWorkers(t), have_workers = true;
    const int64_t present = j.spec.parallel.world();
    const bool fits = Fits(j, present, j.planned->plan, workers);
    const bool waited = now - j.queued_since_ms >= static_cast<int64_t>(e.wait_s * 1000);
    if (!fits && !waited) continue;
    if (fits && OthersWait(t, j)) continue;  // placeable as it is; no growing past a waiting job
    // Placeable as it is: only a larger world is worth a change. Not placeable after wait_s: the
    // largest that is.
    const int64_t lo = fits ? present + 1 : e.min_world;
    std::shared_ptr<const PlannedJob> next;
    std::string change;
    const int64_t world = LargestPlaceable(t, j, lo, e.max_world, workers, &next, &change);
    if (world == 0) continue;
    j.pending_plan = next;
    const std::string why =
        world > present
            ? "devices for a larger world are free"
            : absl::StrCat("no gang of world ", present,
                           " could be placed within parallel.elastic.wait_s = ", e.wait_s, " s");
    if (!lifecycle_
             ->Transition(t, j, j.rec.state,
                          absl::StrCat("resized (", why, "); ", change,
                                       j.rec.last_checkpoint_step > 0
                                           ? absl::StrCat("; resumes from checkpoint step ",
                                                          j.rec.last_checkpoint_step)
                                           : std::string()))
             .ok()) {
      j.pending_plan.reset();  // the next pass tries again
      continue;
    }
    LogCoordinatorLine(absl::StrCat("job ", j.rec.job_id, " resized: ", change));
  }
}

bool ElasticResize::GrowAtCheckpoint(JobTable& t, JobRuntime& j, Outbox* out) {
  const ElasticSpec& e = j.spec.parallel.elastic;
  if (!e.enabled() || !j.planned || j.retry != nullptr || j.rec.state != JobState::kRunning)
    return false;
  const int64_t present = j.spec.parallel.world();
  if (present >= e.max_world || j.rec.last_checkpoint_step >= j.spec.train.steps) return false;
  if (OthersWait(t, j)) return false;
  std::shared_ptr<const PlannedJob> next;
  std::string change;
  const std::vector<SchedulableWorker> workers = SchedulableWorkers(t, j.rec.job_id);
  const int64_t world = LargestPlaceable(t, j, present + 1, e.max_world, workers, &next, &change);
  if (world == 0) return false;
  const std::string reason =
      absl::StrCat("growing at checkpoint step ", j.rec.last_checkpoint_step, ": ", change);
  lifecycle_->StopAttempt(t, j, reason, out);
  j.pending_plan = std::move(next);
  j.queued_since_ms = clock_->SteadyMs();
  lifecycle_->TransitionOrRetry(t, j, JobState::kRestarting, reason);
  LogCoordinatorLine(absl::StrCat("job ", j.rec.job_id, " ", reason));
  return true;
}

}  // namespace spindle
