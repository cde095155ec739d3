// WorkerSessions: the coordinator's side of each worker's session and what the worker reports on
// it. Registration (the registry's checks, the reply with the heartbeat settings), the hello that
// opens a session (the ranks the worker still runs are re-adopted, resent when never started, or
// stopped when not expected; placed ranks it no longer runs restart their gang), a session closed
// (a leaving worker's slots are freed), signs of life (HeardFrom, taken without the job manager's
// mutex), lost workers and workers back after a silence. Each report changes the current attempt
// it is about (OnReport, one per kind): heartbeats (silent pulsing ranks restart their gang,
// unexpected ranks are stopped), rank started, progress (steps, the ETA's reference), checkpoint
// complete once every rank wrote it, rank exit (success, restart, fatal input, out of memory),
// worker leaving, rank notes. A report about a rank the coordinator never gave that worker
// (MayHaveGiven) is ignored and counted, never answered.
//
// Thread-safety: functions taking a JobTable require its mutex (job_table.h); HeardFrom is
// thread-safe and takes only its own mutex, which is taken after the table's when both are held.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/clock.h"
#include "coordinator/health_monitor.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/job_manager_options.h"
#include "coordinator/job_placement.h"
#include "coordinator/job_store.h"
#include "coordinator/job_table.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/worker_messages.h"
#include "coordinator/worker_registry.h"

namespace spindle {

class WorkerSessions {
 public:
  // Stops answered to one hello or heartbeat for ranks of jobs the coordinator does not know;
  // further ones are ignored (and counted).
  static constexpr int kMaxUnknownJobStopsPerReport = 8;
  // Checkpoint steps of a job's attempt that some but not all of its ranks reported, kept at most
  // (the oldest given up first); reports of steps at or before the last complete one are ignored.
  static constexpr int64_t kMaxPendingCheckpoints = 64;

  // Every pointer is not owned and must outlive it.
  WorkerSessions(JobStore* store, const Clock* clock, RendezvousStore* rendezvous,
                 const HealthMonitor* health, const JobManagerOptions* options,
                 const JobManagerMetrics* metrics, JobLifecycle* lifecycle, JobPlacement* placement)
      : store_(store),
        clock_(clock),
        rendezvous_(rendezvous),
        health_(health),
        options_(options),
        metrics_(metrics),
        lifecycle_(lifecycle),
        placement_(placement) {}

  // Registers (or re-registers) a worker (WorkerRegistry::Register's errors).
  absl::StatusOr<RegistrationReply> RegisterWorker(JobTable& t, const WorkerRegistration& reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // What SessionOpened would refuse for `hello`, changing nothing.
  absl::Status CheckHello(const JobTable& t, const WorkerHello& hello) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // A session opened with `hello` (JobManager::SessionOpened's contract); ends with a scheduling
  // pass. NotFound for an unregistered worker.
  absl::Status SessionOpened(JobTable& t, const WorkerHello& hello, uint64_t session_id,
                             Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu)
      ABSL_LOCKS_EXCLUDED(heard_mu_);
  // The session ended (the worker is not lost until heartbeat_timeout passes); a stale session
  // id changes nothing.
  void SessionClosed(JobTable& t, const std::string& worker_id, uint64_t session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The worker's certificates were revoked by `by` ("" when users are not named): each placed or
  // running job with a rank on it records "worker W revoked by U" in its events, so that the
  // restart that follows once the worker is lost is traced to the user who caused it. A job
  // whose event cannot be stored is skipped (the store's error is logged).
  void WorkerRevoked(JobTable& t, const std::string& worker_id, const std::string& by)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // A report on the worker's session; a lost worker speaking again is back first.
  void HandleWorkerMessage(JobTable& t, const std::string& worker_id, const WorkerReport& report,
                           Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu)
      ABSL_LOCKS_EXCLUDED(heard_mu_);

  // Records that the worker's session delivered a message now (steady and wall clock).
  void HeardFrom(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(heard_mu_);
  // Takes the times HeardFrom recorded into the registry's workers.
  void SyncHeardLocked(JobTable& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu)
      ABSL_LOCKS_EXCLUDED(heard_mu_);
  // Tick's work on workers: every worker silent past the heartbeat timeout at `now` (steady) is
  // lost, and the gangs with a rank on it restart.
  void MarkLostWorkers(JobTable& t, int64_t now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  // Whether a rank `worker_id` lists (in a hello or heartbeat) or reports on may be one the
  // coordinator gave it: false for a job it knows whose attempt or rank never existed, or whose
  // current attempt placed that rank elsewhere (older attempts' placements are not kept, and a
  // job it does not know may be one a previous database held: both may be).
  static bool MayHaveGiven(const JobTable& t, const std::string& worker_id, const RankKey& ref)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

 private:
  struct ReportContext;   // the worker a report came from, the clocks, the outbox
  struct ReportDispatch;  // calls the OnReport of a report's kind

  // HandleWorkerMessage, one report kind each.
  void OnReport(JobTable& t, ReportContext& c, const HeartbeatReport& h)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const RankStartedReport& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const RankProgressReport& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const CheckpointDoneReport& d)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const RankExitReport& e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const LeavingReport& l)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void OnReport(JobTable& t, ReportContext& c, const RankNoteReport& n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The current attempt's rank a report from `worker_id` is about, or {null, null} (a stale
  // attempt, an unknown job, a rank placed elsewhere).
  static std::pair<JobRuntime*, RankRuntime*> CurrentRank(JobTable& t, const std::string& worker_id,
                                                          const RankKey& ref)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // "worker W disconnected with rank R" for the first rank of j other than `failed` still
  // running on a worker whose session is closed; "" when there is none.
  static std::string DisconnectedPeer(const JobTable& t, const JobRuntime& j,
                                      const RankRuntime& failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  void MarkWorkerLost(JobTable& t, Worker& w, const std::string& why, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // A lost worker whose session is still open spoke again (the coordinator, or the network, had
  // paused): it is alive again, and what it still runs of the restarted gangs is stopped.
  void WorkerBack(JobTable& t, Worker& w, int64_t now, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Counts a rank report the worker had no business making.
  void IgnoredRankReport() const;

  JobStore* const store_;
  const Clock* const clock_;
  RendezvousStore* const rendezvous_;
  const HealthMonitor* const health_;
  const JobManagerOptions* const options_;
  const JobManagerMetrics* const metrics_;
  JobLifecycle* const lifecycle_;
  JobPlacement* const placement_;

  // HeardFrom's record: worker id -> (steady, wall) time of its session's last message.
  absl::Mutex heard_mu_;
  std::map<std::string, std::pair<int64_t, int64_t>> heard_ ABSL_GUARDED_BY(heard_mu_);
};

}  // namespace spindle
