// ElasticResize: the world changes of elastic jobs (parallel.elastic, common/job_spec.h). A job
// waiting for devices (QUEUED, or RESTARTING once its stopped attempt is gone) whose world cannot
// be placed within parallel.elastic.wait_s is re-planned at the largest world in [min_world,
// max_world] that plans (planner/planned_job.h's ReplanForWorld) and fits the free devices now,
// and one that waits while devices for a larger world are free takes it at once (ResizeWaiting).
// A running elastic job below max_world whose checkpoint just committed, with devices free for a
// larger world (its own counted free), is stopped and re-placed there from that checkpoint
// (GrowAtCheckpoint; no restart is counted). Growing yields to waiting jobs: a job takes a larger
// world than it has (at a checkpoint, or while it waits) only while no other job of its resources
// waits for devices, so that free devices go to a queued job before an elastic one grows into
// them. Shrinking does not yield. Each resize is saved with its event through the
// lifecycle's transition ("resized ...", "growing ..."), so a coordinator restart keeps the
// resized plan. JobPlacement owns one and calls it; WorkerSessions through the placement.
//
// Thread-safety: thread-compatible; functions taking a JobTable require its mutex (job_table.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "coordinator/clock.h"
#include "coordinator/job_admission.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/job_table.h"
#include "coordinator/scheduler.h"

namespace spindle {

// The connected, live workers as the gang scheduler sees them: each one's free devices, and the
// host memory its running ranks pin. The devices of `as_free_job`'s current attempt count as
// free ("": none).
std::vector<SchedulableWorker> SchedulableWorkers(const JobTable& t,
                                                  const std::string& as_free_job = "")
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

class ElasticResize {
 public:
  // Every pointer is not owned and must outlive it.
  ElasticResize(const Clock* clock, const JobAdmission* admission, JobLifecycle* lifecycle)
      : clock_(clock), admission_(admission), lifecycle_(lifecycle) {}

  // `waiting` are the jobs the scheduling pass at `now` (steady) may place: see the file comment.
  // A resize the store refuses changes nothing (tried again at the next pass).
  void ResizeWaiting(JobTable& t, const std::vector<JobRuntime*>& waiting, int64_t now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Called once checkpoint j.rec.last_checkpoint_step of a RUNNING job committed: true when the
  // job was stopped to grow (RESTARTING, its larger plan saved with the transition).
  bool GrowAtCheckpoint(JobTable& t, JobRuntime& j, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

 private:
  // The largest world in [lo, hi] other than the job's present one that plans and whose gang
  // fits `workers`, its plan in `*next` and its change in `*change`; 0 when none.
  int64_t LargestPlaceable(const JobTable& t, const JobRuntime& j, int64_t lo, int64_t hi,
                           const std::vector<SchedulableWorker>& workers,
                           std::shared_ptr<const PlannedJob>* next, std::string* change) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  const Clock* const clock_;
  const JobAdmission* const admission_;
  JobLifecycle* const lifecycle_;
};

}  // namespace spindle
