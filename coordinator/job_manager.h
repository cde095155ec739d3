// JobManager: the job lifecycle of the coordinator: submission, placement of gangs, restarts,
// events, every transition persisted in the JobStore before it is acknowledged. A thin facade: it
// owns the mutex and the state (JobTable, job_table.h) and calls its parts under that mutex, each
// one concern, lowest first (a part calls only those before it):
//   - JobAdmission (job_admission.h): parse, check, plan at submit, idempotent request ids, the
//     checkpoint directory rule, store the job QUEUED.
//   - JobLifecycle (job_lifecycle.h): transitions and events, stopping, failing and restarting
//     attempts, cancel, recovery, pruning, and what clients read (Get, List, Wait).
//   - JobPlacement (job_placement.h): scheduling passes, fencing of the previous attempt,
//     reachability, assignments, the recompute decisions a placement takes.
//   - WorkerSessions (worker_sessions.h): registration, sessions, signs of life, lost workers and
//     every worker report.
// Beside them the WorkerRegistry (worker_registry.h: registration, sessions, slots) and the
// HealthMonitor (health_monitor.h: heartbeats, hangs, silences and fencing deadlines, as
// decisions). Transport-free: its API speaks the coordinator's own types (job_view.h for clients,
// worker_messages.h for workers), which grpc_services.cc converts to and from the wire
// (job_proto.h, worker_proto.h, plan_proto.h); the manager reaches workers only through a
// WorkerChannel, so the whole state machine is unit-tested with a FakeClock, a fake channel and a
// real SQLite file (or the test stores), and each part on its own.
//
// Failure handling (each restart uses one of the job's max_restarts; past it the job FAILS):
//   - rank exit != 0 (not caused by a stop): exit code 2 (invalid input) fails the job at once;
//     any other code restarts the gang.
//   - worker lost: no message for heartbeat_timeout: every gang with a rank on it restarts. A
//     lost worker that speaks again on its session is alive again; its old ranks are stopped.
//   - hung rank: a rank that has not advanced its step for hang_timeout (start_timeout before
//     its first step) restarts the gang; the reason names the rank with the lowest step. A rank
//     whose trainer pulses and has been silent for silence_timeout restarts it too.
//   - coordinator restart: jobs are reloaded; placed ranks are re-adopted when their worker
//     reconnects and lists them in its hello within recovery_grace, otherwise the gang restarts.
// A restart stops every rank of the attempt (Stop to each worker), marks the job RESTARTING
// and re-places it as attempt+1, resuming from the last checkpoint every rank completed. An
// elastic job (parallel.elastic) that cannot be placed within its wait_s is re-planned at the
// largest world that can, and grows back at a checkpoint once devices are free (elastic_resize.h).
// Fencing: a restart's next attempt is placed only once every rank of the stopped attempt is
// gone (its exit reported, or its worker back without it) or must be (HealthMonitor::DeadBy: the
// worker's last word plus heartbeat_timeout + stop_grace + heartbeat_interval, by when a worker
// cut off from the coordinator has stopped its ranks itself). Timers run on Clock::SteadyMs.
// Addresses: assignments carry each worker's address (the ranks' Gloo address) and an empty
// rendezvous address unless one was configured (the worker then uses the coordinator address it
// dials). A gang across a loopback worker and a worker on another host fails at placement.
//
// Thread-safety: thread-safe; one mutex (the JobTable's) guards all state, the registry's
// included. Store writes happen under it (so transitions are ordered and durable before any caller
// sees them); messages to workers are collected under it and sent after it is released.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/clock.h"
#include "coordinator/health_monitor.h"
#include "coordinator/job_admission.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/job_manager_options.h"
#include "coordinator/job_placement.h"
#include "coordinator/job_store.h"
#include "coordinator/job_table.h"
#include "coordinator/job_view.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/users.h"
#include "coordinator/worker_channel.h"
#include "coordinator/worker_messages.h"
#include "coordinator/worker_registry.h"
#include "coordinator/worker_sessions.h"
#include "planner/cp_planner.h"

namespace spindle {

class JobManager {
 public:
  // `store`, `clock`, `channel` and `rendezvous` are not owned and must outlive the manager.
  JobManager(JobStore* store, const Clock* clock, WorkerChannel* channel,
             RendezvousStore* rendezvous, JobManagerOptions options,
             JobManagerMetrics metrics = {});
  ~JobManager();
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  // Loads workers and jobs from the store (call once, before serving). Live attempts wait
  // recovery_grace for their workers to re-adopt them.
  absl::Status Recover() ABSL_LOCKS_EXCLUDED(table_.mu);

  // --- Client API -------------------------------------------------------------------------
  // Parses, plans and stores a job. InvalidArgument for a bad spec; FailedPrecondition listing
  // every plan problem ("job cannot run: <p1>; <p2>") or why it can never fit.
  // A non-empty `request_id` (see kMaxRequestIdLength) makes the submit idempotent: an id that
  // created a job still kept returns that job (and its stored plan) without checking anything
  // again; the same id with a different spec is AlreadyExists naming the job, and an id of
  // another owner's job AlreadyExists without naming it.
  // `plan_out` (may be null) receives the plan, also when the plan refuses the job. `owner` is
  // the submitting user ("": users are not named); the job records it and its first event says
  // "submitted by <owner>".
  absl::StatusOr<std::string> Submit(const std::string& spec_json, CpPlan* plan_out,
                                     const std::string& request_id = "",
                                     const std::string& owner = "") ABSL_LOCKS_EXCLUDED(table_.mu);
  static constexpr size_t kMaxRequestIdLength = JobAdmission::kMaxRequestIdLength;
  // Plans against the registered workers. InvalidArgument for a bad spec; why the job could
  // never be placed on them (what Submit would refuse) is one of the plan's problems.
  absl::Status PlanSpec(const std::string& spec_json, CpPlan* plan_out)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // NotFound "job j-000009 not found". With events: one page of them (`page`), and
  // out->next_events_page_token. InvalidArgument for a page token this manager did not make.
  absl::Status GetJob(const std::string& job_id, bool with_events, JobView* out,
                      const EventPageRequest& page = {}) ABSL_LOCKS_EXCLUDED(table_.mu);
  // Most recently submitted first; `states` empty = all; limit 0 = all.
  std::vector<JobView> ListJobs(const std::set<JobState>& states, int limit)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // One page of ListJobs: at most `page_size` (> 0) jobs in `states`, submitted before the
  // position `page_token` names ("": the newest). `next_page_token` is "" after the last page.
  // InvalidArgument for a token job_pages.h did not make. Costs O(page), not O(jobs stored),
  // unless `owner` (non-null: only the jobs of that owner) skips jobs.
  absl::Status ListJobPage(const std::set<JobState>& states, int page_size,
                           const std::string& page_token, std::vector<JobView>* jobs,
                           std::string* next_page_token, const std::string* owner = nullptr)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // Cancels the job for user `by` (null: the coordinator itself, or a caller that checked).
  // PermissionDenied when `by` is neither the job's owner nor an admin ("job J belongs to O;
  // only its owner or an admin may cancel it"). The event names the user: "cancelled by U" or
  // "cancelled by U: <reason>" ("cancelled by user" / "cancelled: <reason>" without a name).
  // `reason` is cut to kMaxReasonBytes. `out` gets the first page of events.
  absl::Status Cancel(const std::string& job_id, const std::string& reason, JobView* out,
                      const User* by = nullptr) ABSL_LOCKS_EXCLUDED(table_.mu);
  // Blocks until the job's version differs from `*version` or `max_wait` (real time) passes;
  // then fills `out` (events after `*events_seen` in new_events) and updates both cursors.
  // Returns NotFound for an unknown job (also one pruned while waiting).
  absl::Status WaitJob(const std::string& job_id, uint64_t* version, size_t* events_seen,
                       absl::Duration max_wait, JobView* out, std::vector<EventRecord>* new_events)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  std::vector<WorkerView> ListWorkers() ABSL_LOCKS_EXCLUDED(table_.mu);

  // --- Worker API -------------------------------------------------------------------------
  // The worker's session delivered a message (any message: a sign of life), recorded without
  // waiting for the manager's mutex, which store writes hold: a worker whose heartbeats arrive is
  // never taken for lost because the store was slow. The session acknowledges a heartbeat once
  // this returns; the fencing arithmetic (HealthMonitor::DeadBy) counts from these times.
  void HeardFrom(const std::string& worker_id);
  // What SessionOpened would refuse for `hello` (unregistered worker, another daemon instance),
  // changing nothing: checked before the new stream replaces the worker's current one.
  absl::Status CheckHello(const WorkerHello& hello) ABSL_LOCKS_EXCLUDED(table_.mu);
  // Registers (or re-registers) a worker (WorkerRegistry::Register's errors).
  absl::StatusOr<RegistrationReply> RegisterWorker(const WorkerRegistration& reg)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // A Session opened with `hello`. `session_id` distinguishes this stream from earlier ones of
  // the same worker. NotFound for an unregistered worker.
  absl::Status SessionOpened(const WorkerHello& hello, uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // The session ended (the worker is not lost until heartbeat_timeout passes).
  void SessionClosed(const std::string& worker_id, uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // An admin (`by`, "" when users are not named) revoked the worker's certificates (its session
  // was ended): each job with a rank on it says so in its events (WorkerSessions::WorkerRevoked).
  void WorkerRevoked(const std::string& worker_id, const std::string& by)
      ABSL_LOCKS_EXCLUDED(table_.mu);
  // A report on the worker's session (any report also counts as a sign of life).
  void HandleWorkerMessage(const std::string& worker_id, const WorkerReport& report)
      ABSL_LOCKS_EXCLUDED(table_.mu);

  // Sets the rendezvous address given to workers in later assignments (the daemon learns its
  // bound port after the manager is built).
  void SetRendezvousAddress(const std::string& address) ABSL_LOCKS_EXCLUDED(table_.mu);

  // --- Periodic work ----------------------------------------------------------------------
  // Detects lost workers, hung ranks and expired recovery windows, frees drained devices and
  // places queued jobs. The daemon calls it every ~100 ms; tests call it after moving the clock.
  void Tick() ABSL_LOCKS_EXCLUDED(table_.mu);

  // Deletes the finished jobs options.retention no longer keeps, from the store and from
  // memory; returns how many. The daemon calls it after Recover and then periodically.
  absl::StatusOr<int64_t> PruneFinishedJobs() ABSL_LOCKS_EXCLUDED(table_.mu);

  // For metrics: jobs per state, workers by WorkerInfo.state, devices "used"/"free".
  std::map<JobState, int64_t> JobCounts() const ABSL_LOCKS_EXCLUDED(table_.mu);
  std::map<std::string, int64_t> WorkerCounts() const ABSL_LOCKS_EXCLUDED(table_.mu);
  std::map<std::string, int64_t> DeviceCounts() const ABSL_LOCKS_EXCLUDED(table_.mu);
  // The world (dp x cp ranks) each unfinished job is planned at now: an elastic job's changes
  // with each resize (spindle_job_world).
  std::map<std::string, int64_t> JobWorlds() const ABSL_LOCKS_EXCLUDED(table_.mu);
  // The goodput (coordinator/goodput.h) of every job that has one.
  std::map<std::string, double> JobGoodputs() const ABSL_LOCKS_EXCLUDED(table_.mu);

 private:
  // Sends what the parts queued, once the mutex is released.
  void Flush(Outbox& out) ABSL_LOCKS_EXCLUDED(table_.mu);

  JobStore* const store_;
  const Clock* const clock_;
  WorkerChannel* const channel_;
  const JobManagerOptions options_;
  const JobManagerMetrics metrics_;
  const CpPlanner planner_{};
  const HealthMonitor health_;

  JobTable table_;  // its mutex guards all state
  JobAdmission admission_;
  JobLifecycle lifecycle_;
  JobPlacement placement_;
  WorkerSessions sessions_;
};

}  // namespace spindle
