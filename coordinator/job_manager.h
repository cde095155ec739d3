// JobManager: the job lifecycle of the coordinator: submission, placement of gangs, restarts,
// events, every transition persisted in the JobStore before it is acknowledged. Its parts: the
// WorkerRegistry (worker_registry.h: registration, sessions, slots) and the HealthMonitor
// (health_monitor.h: heartbeats, hangs, silences and fencing deadlines, as decisions). Transport-
// free: its API speaks the coordinator's own types (job_view.h for clients, worker_messages.h for
// workers), which grpc_services.cc converts to and from the wire (job_proto.h, worker_proto.h,
// plan_proto.h); the manager reaches workers only through a WorkerChannel, so the whole state
// machine is unit-tested with a FakeClock, a fake channel and a real SQLite file (or the test
// stores).
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
// and re-places it as attempt+1, resuming from the last checkpoint every rank completed.
// Fencing: a restart's next attempt is placed only once every rank of the stopped attempt is
// gone (its exit reported, or its worker back without it) or must be (HealthMonitor::DeadBy: the
// worker's last word plus heartbeat_timeout + stop_grace + heartbeat_interval, by when a worker
// cut off from the coordinator has stopped its ranks itself). Timers run on Clock::SteadyMs.
// Addresses: assignments carry each worker's address (the ranks' Gloo address) and an empty
// rendezvous address unless one was configured (the worker then uses the coordinator address it
// dials). A gang across a loopback worker and a worker on another host fails at placement.
//
// Thread-safety: thread-safe; one mutex guards all state, the registry's included. Store writes
// happen under it (so transitions are ordered and durable before any caller sees them); messages
// to workers are collected under it and sent after it is released.
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
#include "coordinator/job_index.h"
#include "coordinator/job_store.h"
#include "coordinator/job_view.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/retention.h"
#include "coordinator/users.h"
#include "coordinator/worker_channel.h"
#include "coordinator/worker_messages.h"
#include "coordinator/worker_registry.h"
#include "planner/cp_planner.h"

namespace spindle {

class Counter;
class Histogram;

struct JobManagerOptions {
  int64_t heartbeat_interval_ms = 1000;
  int64_t heartbeat_timeout_ms = 10000;
  // No step progress for this long, or for 3 of the rank's own last step time when that is
  // longer (steps over long sequences): hung.
  int64_t hang_timeout_ms = 120000;
  // A rank whose trainer pulses (RunningRank.pulsing) and has printed nothing for this long has
  // stopped: its gang restarts.
  int64_t silence_timeout_ms = 5000;
  int64_t start_timeout_ms = 600000;  // placement to first step
  int64_t stop_grace_ms = 10000;      // Stop: SIGTERM, then SIGKILL after this
  // After a coordinator restart, how long placed ranks wait for their worker to reconnect.
  int64_t recovery_grace_ms = 20000;
  // host:port of the RendezvousService that workers are told to use.
  std::string rendezvous_address;
  // Which finished jobs PruneFinishedJobs deletes.
  RetentionPolicy retention;
  // How many workers, and slots of one, the registry holds.
  RegistryLimits registry;
};

// Optional metric children the manager updates (not owned; any may be null).
struct JobManagerMetrics {
  Histogram* scheduling_latency_seconds = nullptr;
  Counter* restarts_worker_lost = nullptr;
  Counter* restarts_worker_left = nullptr;  // a worker shutting down on purpose (Leaving)
  Counter* restarts_rank_failed = nullptr;
  Counter* restarts_hang = nullptr;
  Counter* restarts_recovery = nullptr;
  Counter* jobs_submitted = nullptr;
  // Ranks a worker listed (hello, heartbeat) or reported on that it was never given: ignored.
  Counter* ignored_rank_reports = nullptr;
};

// Which of a job's events a Get returns: kept events (the newest kMaxEventsPerJob) oldest first,
// from the position `page_token` names ("": the oldest kept), at most `page_size` (0: 100; more
// than 1000: 1000).
struct EventPageRequest {
  int page_size = 0;
  std::string page_token;
};
inline constexpr int kDefaultEventPageSize = 100;
inline constexpr int kMaxEventPageSize = 1000;

// What a registered worker is told (cluster.proto's RegisterResponse).
struct RegistrationReply {
  int64_t heartbeat_interval_ms = 0;
  int64_t heartbeat_timeout_ms = 0;
  int64_t stop_grace_ms = 0;
  std::string observed_host;
};

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
  absl::Status Recover() ABSL_LOCKS_EXCLUDED(mu_);

  // --- Client API -------------------------------------------------------------------------
  // Parses, plans and stores a job. InvalidArgument for a bad spec; FailedPrecondition listing
  // every plan problem ("job cannot run: <p1>; <p2>") or why it can never fit.
  // A non-empty `request_id` (see kMaxRequestIdLength) makes the submit idempotent: an id that
  // created a job still kept returns that job (and its stored plan) without checking anything
  // again; the same id with a different spec is AlreadyExists naming the job.
  // `plan_out` (may be null) receives the plan, also when the plan refuses the job. `owner` is
  // the submitting user ("": users are not named); the job records it and its first event says
  // "submitted by <owner>".
  absl::StatusOr<std::string> Submit(const std::string& spec_json, CpPlan* plan_out,
                                     const std::string& request_id = "",
                                     const std::string& owner = "") ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr size_t kMaxRequestIdLength = 128;
  // Plans against the registered workers. InvalidArgument for a bad spec; why the job could
  // never be placed on them (what Submit would refuse) is one of the plan's problems.
  absl::Status PlanSpec(const std::string& spec_json, CpPlan* plan_out) ABSL_LOCKS_EXCLUDED(mu_);
  // NotFound "job j-000009 not found". With events: one page of them (`page`), and
  // out->next_events_page_token. InvalidArgument for a page token this manager did not make.
  absl::Status GetJob(const std::string& job_id, bool with_events, JobView* out,
                      const EventPageRequest& page = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Most recently submitted first; `states` empty = all; limit 0 = all.
  std::vector<JobView> ListJobs(const std::set<JobState>& states, int limit)
      ABSL_LOCKS_EXCLUDED(mu_);
  // One page of ListJobs: at most `page_size` (> 0) jobs in `states`, submitted before the
  // position `page_token` names ("": the newest). `next_page_token` is "" after the last page.
  // InvalidArgument for a token job_pages.h did not make. Costs O(page), not O(jobs stored),
  // unless `owner` (non-null: only the jobs of that owner) skips jobs.
  absl::Status ListJobPage(const std::set<JobState>& states, int page_size,
                           const std::string& page_token, std::vector<JobView>* jobs,
                           std::string* next_page_token, const std::string* owner = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels the job for user `by` (null: the coordinator itself, or a caller that checked).
  // PermissionDenied when `by` is neither the job's owner nor an admin ("job J belongs to O;
  // only its owner or an admin may cancel it"). The event names the user: "cancelled by U" or
  // "cancelled by U: <reason>" ("cancelled by user" / "cancelled: <reason>" without a name).
  // `reason` is cut to kMaxReasonBytes. `out` gets the first page of events.
  absl::Status Cancel(const std::string& job_id, const std::string& reason, JobView* out,
                      const User* by = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until the job's version differs from `*version` or `max_wait` (real time) passes;
  // then fills `out` (events after `*events_seen` in new_events) and updates both cursors.
  // Returns NotFound for an unknown job (also one pruned while waiting).
  absl::Status WaitJob(const std::string& job_id, uint64_t* version, size_t* events_seen,
                       absl::Duration max_wait, JobView* out, std::vector<EventRecord>* new_events)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<WorkerView> ListWorkers() ABSL_LOCKS_EXCLUDED(mu_);

  // --- Worker API -------------------------------------------------------------------------
  // The worker's session delivered a message (any message: a sign of life), recorded without
  // waiting for the manager's mutex, which store writes hold: a worker whose heartbeats arrive is
  // never taken for lost because the store was slow. The session acknowledges a heartbeat once
  // this returns; the fencing arithmetic (HealthMonitor::DeadBy) counts from these times.
  void HeardFrom(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(heard_mu_);
  // What SessionOpened would refuse for `hello` (unregistered worker, another daemon instance),
  // changing nothing: checked before the new stream replaces the worker's current one.
  absl::Status CheckHello(const WorkerHello& hello) ABSL_LOCKS_EXCLUDED(mu_);
  // Registers (or re-registers) a worker (WorkerRegistry::Register's errors).
  absl::StatusOr<RegistrationReply> RegisterWorker(const WorkerRegistration& reg)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A Session opened with `hello`. `session_id` distinguishes this stream from earlier ones of
  // the same worker. NotFound for an unregistered worker.
  absl::Status SessionOpened(const WorkerHello& hello, uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session ended (the worker is not lost until heartbeat_timeout passes).
  void SessionClosed(const std::string& worker_id, uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A report on the worker's session (any report also counts as a sign of life).
  void HandleWorkerMessage(const std::string& worker_id, const WorkerReport& report)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Sets the rendezvous address given to workers in later assignments (the daemon learns its
  // bound port after the manager is built).
  void SetRendezvousAddress(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

  // --- Periodic work ----------------------------------------------------------------------
  // Detects lost workers, hung ranks and expired recovery windows, frees drained devices and
  // places queued jobs. The daemon calls it every ~100 ms; tests call it after moving the clock.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // Deletes the finished jobs options.retention no longer keeps, from the store and from
  // memory; returns how many. The daemon calls it after Recover and then periodically.
  absl::StatusOr<int64_t> PruneFinishedJobs() ABSL_LOCKS_EXCLUDED(mu_);

  // For metrics: jobs per state, workers by WorkerInfo.state, devices "used"/"free".
  std::map<JobState, int64_t> JobCounts() const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::string, int64_t> WorkerCounts() const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::string, int64_t> DeviceCounts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct RankRuntime;
  struct JobRuntime;
  struct Outbox;
  struct ReportContext;  // the worker a report came from, the clocks, the outbox
  struct PendingTransition;

  JobRuntime* FindJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The plan against the largest registered device of the job's kind.
  CpPlan PlanLocked(const JobSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the cost model estimates with: the rates of the worker plans are sized to (built-in
  // ones when it measured none), its link when the gang fits on it, else the network.
  Topology TopologyLocked(const JobSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With events: those from position `events_from` (among all the job ever had), at most
  // `events_page`.
  void FillJob(const JobRuntime& j, bool with_events, JobView* out, int64_t events_from = 0,
               int events_page = kDefaultEventPageSize) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Persists `next` (default: j.rec) in state `to`, with the job's pending plan, plus an event;
  // only once the store has it does the job in memory take it (and bump its version): a failed
  // write changes nothing.
  absl::Status Transition(JobRuntime& j, JobState to, const std::string& message,
                          const AttemptRecord* attempt = nullptr,
                          std::optional<JobRecord> next = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops every rank of the job's current attempt, ends its rendezvous scope and holds its
  // devices until the ranks exit (or stop_grace + heartbeat_timeout passes).
  void StopAttempt(JobRuntime& j, const std::string& reason, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a plan's decisions: the CP modes, the layers that recompute, the memory per rank.
  static void AdoptPlan(JobRuntime& j, const CpPlan& plan);
  // Submit's admission check (CheckCanEverFit) of a planned job against the registered workers.
  absl::Status CheckCanEverFitLocked(const std::string& kind, int64_t world,
                                     const CpPlan& plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // train.recompute "auto" planned while no device of the job's kind was registered: sized to
  // the smallest device of the gang being placed (the plan is updated and saved with the
  // placement).
  void DecideRecomputeAtPlacement(JobRuntime& j, const std::vector<RankPlacement>& ranks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank ran out of device memory: a job with train.recompute "auto" recomputes more layers
  // from its next attempt on (the plan is updated and saved with the restart), and `reason` says
  // so. Other jobs are left as they are.
  void RecomputeMoreAfterOutOfMemory(JobRuntime& j, std::string* reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops the attempt and moves the job to RESTARTING, or FAILED when out of restarts or
  // `fatal`. `kind` picks the restart counter.
  void FailAttempt(JobRuntime& j, const std::string& reason, bool fatal, Counter* kind,
                   Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Schedule(Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlaceJob(JobRuntime& j, const std::vector<RankPlacement>& ranks, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A lost worker whose session is still open spoke again (the coordinator, or the network, had
  // paused): it is alive again, and what it still runs of the restarted gangs is stopped.
  void WorkerBack(Worker& w, int64_t now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when the next attempt of a restarting job may be placed (see Fencing above).
  bool PreviousAttemptGone(const JobRuntime& j, int64_t now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  AssignmentCommand MakeAssignment(const JobRuntime& j, const RankPlacement& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FailedPrecondition when the gang would span a loopback worker and one on another host.
  absl::Status CheckReachable(const std::vector<RankPlacement>& ranks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a Stop of (job_id, attempt) to worker_id, with the stop grace.
  void SendStop(const std::string& worker_id, const std::string& job_id, int64_t attempt,
                const std::string& reason, Outbox* out) const;
  void MarkWorkerLost(Worker& w, const std::string& why, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FailedPrecondition naming the unfinished job whose checkpoint.dir is spec's.
  absl::Status CheckCheckpointDirFreeLocked(const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "worker W disconnected with rank R" for the first rank of j other than `failed` still
  // running on a worker whose session is closed; "" when there is none.
  std::string DisconnectedPeer(const JobRuntime& j, const RankRuntime& failed) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckRunning(JobRuntime& j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // HandleWorkerMessage, one report kind each.
  void OnReport(ReportContext& c, const HeartbeatReport& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const RankStartedReport& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const RankProgressReport& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const CheckpointDoneReport& d)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const RankExitReport& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const LeavingReport& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReport(ReportContext& c, const RankNoteReport& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The current attempt's rank a report from `worker_id` is about, or {null, null} (a stale
  // attempt, an unknown job, a rank placed elsewhere).
  std::pair<JobRuntime*, RankRuntime*> CurrentRank(const std::string& worker_id,
                                                   const RankKey& ref)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Flush(Outbox& out) ABSL_LOCKS_EXCLUDED(mu_);
  void Bump(JobRuntime& j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a rank `worker_id` lists (in a hello or heartbeat) or reports on may be one the
  // coordinator gave it: false for a job it knows whose attempt or rank never existed, or whose
  // current attempt placed that rank elsewhere (older attempts' placements are not kept, and a
  // job it does not know may be one a previous database held: both may be). A report about a rank
  // never given is ignored and counted, never answered.
  bool MayHaveGiven(const std::string& worker_id, const RankKey& ref) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops answered to one hello or heartbeat for ranks of jobs the coordinator does not know;
  // further ones are ignored (and counted).
  static constexpr int kMaxUnknownJobStopsPerReport = 8;
  // Appends an event to the job's kept events (the newest kMaxEventsPerJob).
  static void AddEvent(JobRuntime& j, EventRecord ev);
  // Transition, and when the store refuses it, kept to be tried again by Tick: a job whose ranks
  // were stopped never stays RUNNING because one write failed. `add_restarts` is added to the
  // record's restarts when the write is made.
  void TransitionOrRetry(JobRuntime& j, JobState to, const std::string& message,
                         int64_t add_restarts = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the times HeardFrom recorded into the registry's workers.
  void SyncHeardLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(heard_mu_);
  // Counts a rank report the worker had no business making.
  void IgnoredRankReport() const;

  JobStore* const store_;
  const Clock* const clock_;
  WorkerChannel* const channel_;
  RendezvousStore* const rendezvous_;
  const JobManagerOptions options_;
  const JobManagerMetrics metrics_;
  const CpPlanner planner_{};
  const HealthMonitor health_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobRuntime>> jobs_ ABSL_GUARDED_BY(mu_);
  WorkerRegistry registry_ ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  JobIndex index_ ABSL_GUARDED_BY(mu_);
  std::string rendezvous_address_ ABSL_GUARDED_BY(mu_);

  // HeardFrom's record: worker id -> (steady, wall) time of its session's last message. Taken
  // after mu_ when both are held, never before.
  mutable absl::Mutex heard_mu_;
  std::map<std::string, std::pair<int64_t, int64_t>> heard_ ABSL_GUARDED_BY(heard_mu_);
};

}  // namespace spindle
