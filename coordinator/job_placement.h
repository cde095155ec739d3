// JobPlacement: how queued and restarting jobs get devices. A scheduling pass (Schedule) offers
// the jobs that may be placed now to the gang scheduler (scheduler.h) over the free devices of the
// connected workers; a restarting job waits until every rank of its stopped attempt is gone or
// must be (PreviousAttemptGone: fencing). Each gang placed (PlaceJob) is checked for addresses its
// ranks can reach (CheckReachable: not across a loopback worker and one on another host), stored
// as the job's next attempt (PLACED) with a new rendezvous scope, and sent to its workers as one
// assignment per rank (MakeAssignment). Also the recompute decisions a placement takes:
// train.recompute "auto" planned with no device registered is sized to the smallest device of the
// gang (ReplanForPlacement), and a rank out of device memory makes the next attempt recompute
// more layers (RecomputeMoreAfterOutOfMemory); both through the planner's one Replan. Elastic
// jobs change their world through its ElasticResize (elastic_resize.h): before each pass for the
// jobs it may place, and after a running job's checkpoint (GrowAtCheckpoint).
//
// Thread-safety: thread-compatible; functions taking a JobTable require its mutex (job_table.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "coordinator/clock.h"
#include "coordinator/elastic_resize.h"
#include "coordinator/job_admission.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/job_store.h"
#include "coordinator/job_table.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/worker_messages.h"
#include "planner/cp_planner.h"

namespace spindle {

class Histogram;

class JobPlacement {
 public:
  // Every pointer is not owned and must outlive it; `scheduling_latency_seconds` may be null.
  JobPlacement(const Clock* clock, RendezvousStore* rendezvous, const CpPlanner* planner,
               const JobAdmission* admission, JobLifecycle* lifecycle,
               Histogram* scheduling_latency_seconds)
      : clock_(clock),
        rendezvous_(rendezvous),
        planner_(planner),
        admission_(admission),
        lifecycle_(lifecycle),
        scheduling_latency_seconds_(scheduling_latency_seconds),
        elastic_(clock, admission, lifecycle) {}

  // Places every gang the scheduler can place now; their assignments go to `out`.
  void Schedule(JobTable& t, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Makes `ranks` the job's next attempt: stored PLACED (nothing changes when the store refuses),
  // slots taken, rendezvous opened, assignments queued. A gang its ranks cannot reach fails the
  // job.
  void PlaceJob(JobTable& t, JobRuntime& j, const std::vector<RankPlacement>& ranks, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The assignment of rank `p` of the job's current attempt.
  AssignmentCommand MakeAssignment(const JobTable& t, const JobRuntime& j,
                                   const RankPlacement& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // FailedPrecondition when the gang would span a loopback worker and one on another host.
  absl::Status CheckReachable(const JobTable& t, const std::vector<RankPlacement>& ranks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // True when the next attempt of a restarting job may be placed at `now` (steady): every rank of
  // the stopped attempt exited, is gone, or is past its dead_by_ms, and the recovered restart's
  // wait (restart_not_before_ms) is over.
  static bool PreviousAttemptGone(const JobRuntime& j, int64_t now);
  // The job re-planned for the smallest device of the gang being placed (Replan's placement
  // cause: what was decided for lack of a device is decided for it; the rest is kept while it
  // runs there). A change becomes the job's pending plan, saved and taken with the placement's
  // transition; returns it in one line for the event ("" when nothing changed).
  std::string ReplanForPlacement(const JobTable& t, JobRuntime& j,
                                 const std::vector<RankPlacement>& ranks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // ElasticResize::GrowAtCheckpoint: the job's checkpoint committed; true when it was stopped to
  // be re-placed at a larger world.
  bool GrowAtCheckpoint(JobTable& t, JobRuntime& j, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu) {
    return elastic_.GrowAtCheckpoint(t, j, out);
  }
  // A rank ran out of device memory: a job with train.recompute "auto" recomputes more layers
  // from its next attempt on (the plan is updated and saved with the restart), and `reason` says
  // so. Other jobs are left as they are.
  void RecomputeMoreAfterOutOfMemory(const JobTable& t, JobRuntime& j, std::string* reason) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

 private:
  const Clock* const clock_;
  RendezvousStore* const rendezvous_;
  const CpPlanner* const planner_;
  const JobAdmission* const admission_;
  JobLifecycle* const lifecycle_;
  Histogram* const scheduling_latency_seconds_;
  ElasticResize elastic_;
};

}  // namespace spindle
