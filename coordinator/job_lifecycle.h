// JobLifecycle: the states a job moves through (QUEUED -> PLACED -> RUNNING -> SUCCEEDED | FAILED
// | CANCELLED, RESTARTING back to PLACED) and what a client reads of them. Every transition is
// written to the JobStore, with its event, before the job in memory takes it (Transition): a
// refused write changes nothing, and a transition that must happen (ranks already stopped) is
// kept and tried again at each Tick (TransitionOrRetry). Ending an attempt (StopAttempt) stops its
// ranks, sets their fencing deadlines and drains their devices; FailAttempt then restarts the gang
// (one of max_restarts) or fails the job. Also: Cancel, Recover (jobs reloaded after a coordinator
// restart, live attempts waiting recovery_grace for their workers), Tick's checks of recovery
// windows, hangs and retries (TickJobs), pruning of finished jobs, and Get / List / Wait with
// their event and job pages.
//
// Thread-safety: thread-compatible; functions taking a JobTable require its mutex (job_table.h).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/health_monitor.h"
#include "coordinator/job_manager_options.h"
#include "coordinator/job_store.h"
#include "coordinator/job_table.h"
#include "coordinator/job_view.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/users.h"
#include "planner/cp_planner.h"

namespace spindle {

class JobLifecycle {
 public:
  // Every pointer is not owned and must outlive it.
  JobLifecycle(JobStore* store, const Clock* clock, RendezvousStore* rendezvous,
               const CpPlanner* planner, const HealthMonitor* health,
               const JobManagerOptions* options, const JobManagerMetrics* metrics)
      : store_(store),
        clock_(clock),
        rendezvous_(rendezvous),
        planner_(planner),
        health_(health),
        options_(options),
        metrics_(metrics) {}

  // Takes the stored jobs (with their events and live attempts) and workers into an empty table.
  // Live attempts wait recovery_grace for their workers to re-adopt them; a restart the previous
  // process began waits out the fencing time before its next attempt.
  absl::Status Recover(JobTable& t, std::vector<JobRecord> jobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  // Persists `next` (default: j.rec) in state `to`, with the job's pending plan, plus an event;
  // only once the store has it does the job in memory take it (and bump its version): a failed
  // write changes nothing.
  absl::Status Transition(JobTable& t, JobRuntime& j, JobState to, const std::string& message,
                          const AttemptRecord* attempt = nullptr,
                          std::optional<JobRecord> next = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Transition, and when the store refuses it, kept to be tried again by TickJobs: a job whose
  // ranks were stopped never stays RUNNING because one write failed. `add_restarts` is added to
  // the record's restarts when the write is made.
  void TransitionOrRetry(JobTable& t, JobRuntime& j, JobState to, const std::string& message,
                         int64_t add_restarts = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // PLACED -> RUNNING once every rank of the attempt runs (or has exited), unless the attempt
  // still waits for re-adoption.
  void CheckRunning(JobTable& t, JobRuntime& j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Stops every rank of the job's current attempt, ends its rendezvous scope and holds its
  // devices until the ranks exit (or stop_grace + heartbeat_timeout passes).
  void StopAttempt(JobTable& t, JobRuntime& j, const std::string& reason, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Stops the attempt and moves the job to RESTARTING, or FAILED when out of restarts or
  // `fatal`. `kind` (may be null) picks the restart counter.
  void FailAttempt(JobTable& t, JobRuntime& j, const std::string& reason, bool fatal, Counter* kind,
                   Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Queues a Stop of (job_id, attempt) to worker_id, with the stop grace.
  void SendStop(const std::string& worker_id, const std::string& job_id, int64_t attempt,
                const std::string& reason, Outbox* out) const;

  // JobManager::Cancel without its scheduling pass: true when the job was cancelled now (its
  // devices may be free), false when it had already finished. `out` gets the job and the first
  // page of its events.
  absl::StatusOr<bool> Cancel(JobTable& t, const std::string& job_id, const std::string& reason,
                              const User* by, JobView* out, Outbox* box)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Tick's work on jobs at `now` (steady): retries the transitions the store refused, and
  // restarts the attempts whose recovery window expired with ranks not re-adopted and those
  // whose ranks hang (HealthMonitor::Hung).
  void TickJobs(JobTable& t, int64_t now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Deletes the finished jobs options.retention no longer keeps, from the store, then from the
  // table; returns how many.
  absl::StatusOr<int64_t> PruneFinishedJobs(JobTable& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  // JobManager::GetJob, JobManager::ListJobPage and JobManager::WaitJob (their contracts).
  absl::Status GetJob(const JobTable& t, const std::string& job_id, bool with_events, JobView* out,
                      const EventPageRequest& page) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  absl::Status ListJobPage(const JobTable& t, const std::set<JobState>& states, int page_size,
                           const std::string& page_token, std::vector<JobView>* jobs,
                           std::string* next_page_token, const std::string* owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Waits on t.mu (released while waiting, held again when it returns).
  absl::Status WaitJob(JobTable& t, const std::string& job_id, uint64_t* version,
                       size_t* events_seen, absl::Duration max_wait, JobView* out,
                       std::vector<EventRecord>* new_events) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The job as a client sees it. With events: those from position `events_from` (among all the
  // job ever had), at most `events_page`, and the token of the next page. `j` is a job of the
  // table the caller holds locked.
  void FillJob(const JobRuntime& j, bool with_events, JobView* out, int64_t events_from = 0,
               int events_page = kDefaultEventPageSize) const;

 private:
  JobStore* const store_;
  const Clock* const clock_;
  RendezvousStore* const rendezvous_;
  const CpPlanner* const planner_;
  const HealthMonitor* const health_;
  const JobManagerOptions* const options_;
  const JobManagerMetrics* const metrics_;
};

}  // namespace spindle
