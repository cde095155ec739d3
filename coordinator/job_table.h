// JobTable: the job manager's state, which its parts share: every job with what the coordinator
// knows of it beyond its stored record (the plan's decisions, the current attempt's ranks, kept
// events, fencing and recovery times), the worker registry, the job index, the version counter
// that wakes watchers, and the rendezvous address assignments carry. The parts change it:
// admission (job_admission.h), lifecycle (job_lifecycle.h), placement (job_placement.h) and worker
// sessions (worker_sessions.h); JobManager (job_manager.h) owns the table and the parts.
//
// Thread-safety: `mu` guards every field, and through them every JobRuntime and Worker. The
// JobManager locks it around each call into a part; every part function that reads or changes
// the table requires it (ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu)). A JobRuntime& or Worker& handed to
// a part belongs to the table the same call holds locked.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "coordinator/clock.h"
#include "coordinator/goodput.h"
#include "coordinator/job_index.h"
#include "coordinator/job_store.h"
#include "coordinator/moe_summary.h"
#include "coordinator/worker_messages.h"
#include "coordinator/worker_registry.h"
#include "planner/cp_planner.h"

namespace spindle {

// One rank of a job's current attempt.
struct RankRuntime {
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

// A transition the store refused, tried again at each Tick (JobLifecycle::TransitionOrRetry).
struct PendingTransition {
  JobState to;
  std::string message;
  int64_t add_restarts = 0;
};

// One job as the coordinator holds it.
struct JobRuntime {
  JobRecord rec;
  // The job as planned at submit (or since re-planned): what every assignment carries whole and
  // the store keeps in rec.plan. Null only for a stored job whose spec no longer parses.
  std::shared_ptr<const PlannedJob> planned;
  // planned->spec: the spec with every decision in place (JobAdmission::AdoptPlan keeps it).
  JobSpec spec;
  int64_t memory_per_rank = 0;
  int64_t host_bytes_per_rank = 0;  // pinned host memory a rank needs (train.offload)
  std::vector<RankRuntime> ranks;   // current attempt
  std::string token;
  int64_t queued_since_ms = 0;    // steady clock, as every timer here
  int64_t adopt_deadline_ms = 0;  // > 0 while waiting for re-adoption
  // Fencing: the next attempt is placed only when every rank of the stopped one is gone or past
  // its dead_by_ms, and not before this (a restart recovered from the store, its ranks unknown).
  int64_t restart_not_before_ms = 0;
  // A re-plan (planner/planned_job.h's Replan) that the next transition saves and then adopts.
  std::shared_ptr<const PlannedJob> pending_plan;
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
  GoodputLedger goodput;                        // from rank 0's reports (worker_sessions.cc)
};

// Messages to workers, collected under the table's lock and sent once it is released.
struct Outbox {
  std::vector<std::pair<std::string, WorkerCommand>> messages;
};

// PLACED or RUNNING: an attempt holds devices.
inline bool IsActive(JobState s) { return s == JobState::kPlaced || s == JobState::kRunning; }

// Appends an event to the job's kept events (the newest kMaxEventsPerJob), counting those it
// drops in events_dropped.
void AddEvent(JobRuntime& j, EventRecord ev);

// One line of the coordinator's log (stderr, "coordinator: <line>").
void LogCoordinatorLine(const std::string& line);

struct JobTable {
  // `store` and `clock` (for the registry) are not owned.
  JobTable(JobStore* store, const Clock* clock, RegistryLimits limits,
           std::string rendezvous_address)
      : registry(store, clock, limits), rendezvous_address(std::move(rendezvous_address)) {}
  JobTable(const JobTable&) = delete;
  JobTable& operator=(const JobTable&) = delete;

  // The job, or null.
  JobRuntime* Find(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  const JobRuntime* Find(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The job changed: a new version, which wakes its watchers (JobManager::WaitJob).
  void Bump(JobRuntime& j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { j.version = next_version++; }

  mutable absl::Mutex mu;
  std::map<std::string, std::unique_ptr<JobRuntime>> jobs ABSL_GUARDED_BY(mu);
  WorkerRegistry registry ABSL_GUARDED_BY(mu);
  uint64_t next_version ABSL_GUARDED_BY(mu) = 1;
  JobIndex index ABSL_GUARDED_BY(mu);
  // host:port given to ranks in assignments; "": the coordinator address their worker dials.
  std::string rendezvous_address ABSL_GUARDED_BY(mu);
};

}  // namespace spindle
