// RankRunner: turns the coordinator's orders into trainer processes and the trainers' output into
// messages for the coordinator. For each Assignment it writes the job as planned (the
// Assignment's PlannedJob, a spindle.v1.PlannedJob) to <work_dir>/<job_id>/<attempt>/planned_job.pb
// and starts one `spindle-train` process, which runs it as given:
//
//   spindle-train --planned-job <work_dir>/<job>/<attempt>/planned_job.pb --rank R
//     --rendezvous HOST:PORT --job-id ID --attempt N [--resume-step S] [--token-file FILE]
//     [--replica-dir <replica_dir>/<job> --replica-host <worker id>]
//
// (the replica flags for jobs with checkpoint.replicas when the daemon has a replica directory:
// replica_dirs.h; a job's replicas there are removed once one of its ranks here exits 0)
// with, in its environment: SPINDLE_RENDEZVOUS_TOKEN (the attempt's rendezvous secret, kept off
// the command line), SPINDLE_TLS_CA_FILE (when the daemon talks TLS to the coordinator),
// CUDA_VISIBLE_DEVICES=<the device_index-th GPU this daemon sees> for "cuda" ranks (the index
// itself, or the entry at that position of the daemon's own CUDA_VISIBLE_DEVICES when that is
// set: the daemon discovered its GPUs through it), OMP_NUM_THREADS for "cpu" ranks (when
// configured and not already set), and OMP_WAIT_POLICY=passive for them where the options say
// the cores are over-subscribed (and it is not already set). The trainer's stderr is also appended
// to <work_dir>/<job>/<attempt>/rank-<R>.stderr.log.
//
// Before anything is written, the planned spec's checkpoint directory and data file are checked
// against the worker's roots (path_roots.h); a refused path ends the rank at once with a RankExit
// of exit code 2 (kExitInvalidInput: the job fails without restarts) whose stderr tail names the
// path and the root.
//
// Progress lines become RankProgress / CheckpointDone messages and metrics; the exit becomes one
// RankExit (exit code or signal, stderr tail, whether a stop caused it). A trainer that cannot be
// started is reported as a RankExit with exit code 127 and the reason as its stderr tail.
//
// Thread-safety: thread-safe. Messages go to the MessageSink from the calling thread (Start) or
// the supervisor thread (progress, exits); the sink must be thread-safe and must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spindle/v1/cluster.pb.h"
#include "worker/path_roots.h"
#include "worker/process_supervisor.h"
#include "worker/worker_metrics.h"

namespace spindle {

// Where the runner's messages for the coordinator go (the session, or a test's recorder).
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  virtual void Send(v1::WorkerMessage message) = 0;
};

struct RankRunnerOptions {
  std::string work_dir;        // must exist or be creatable
  std::string trainer_binary;  // absolute path of spindle-train
  std::string token_file;      // passed as --token-file when non-empty
  // Passed as --gloo-host when non-empty: the address trainers bind for Gloo and publish to their
  // peers (empty: the trainer's default, 127.0.0.1, which only reaches ranks on this host).
  std::string gloo_host;
  // The coordinator's worker address this daemon dials: the rendezvous address of assignments
  // that name none.
  std::string coordinator_address;
  // Passed as --pulse-ms: how often trainers print a pulse line (0: they do not).
  int64_t pulse_ms = 1000;
  std::string tls_ca_file;     // exported as SPINDLE_TLS_CA_FILE when non-empty
  int cpu_threads_per_rank = 0;  // OMP_NUM_THREADS for cpu ranks (0: leave unset)
  // OMP_WAIT_POLICY=passive for cpu ranks (when not already set): the slots' threads are more
  // than the host's cores (PassiveWaitForRanks, common/host_cores.h).
  bool cpu_passive_wait = false;
  PathRoots roots;               // where checkpoints and data files may be
  // The daemon's replica directory (replica_dirs.h; empty: its jobs keep no in-memory replicas)
  // and its worker id, which trainers use to tell ranks of different workers apart.
  std::string replica_dir;
  std::string worker_id;
  // Extra arguments appended to every trainer command line (tests use them for fake trainers).
  std::vector<std::string> extra_trainer_args;
  ProcessSupervisorOptions supervisor;
};

// The CUDA_VISIBLE_DEVICES value naming the daemon's `device_index`-th GPU for a trainer:
// entry `device_index` of `daemon_visible` (the daemon's own CUDA_VISIBLE_DEVICES, a comma
// separated list of indices or UUIDs) when that is set and long enough, else the index.
std::string TrainerVisibleDevice(int64_t device_index, const char* daemon_visible);

class RankRunner : public ProcessObserver {
 public:
  // `metrics` (may be null) and `sink` are not owned and must outlive the runner.
  RankRunner(RankRunnerOptions options, WorkerMetrics* metrics, MessageSink* sink);
  // Stops every trainer (SIGTERM, then SIGKILL after the grace period) and waits for them.
  ~RankRunner() override;
  RankRunner(const RankRunner&) = delete;
  RankRunner& operator=(const RankRunner&) = delete;

  // Starts the trainer of one rank and sends RankStarted (or, when it cannot start, RankExit with
  // exit code 127). A repeated assignment of a rank that is already running only re-sends
  // RankStarted. Ranks of older attempts of the same job still running here are killed first.
  // Errors: InvalidArgument for an unusable job id or attempt or a path outside the roots, or
  // the launch failure.
  absl::Status Start(const v1::Assignment& assignment) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops every rank of (job_id, attempt) (attempt 0: of every attempt of the job). Returns the
  // number of ranks asked to stop.
  int Stop(const std::string& job_id, int64_t attempt, absl::Duration grace)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stops every rank (coordinator lost, daemon shutting down).
  int StopAll(absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_);

  // Ranks whose trainers are alive now, with their last reported step.
  std::vector<v1::RunningRank> Running() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t running_count() const ABSL_LOCKS_EXCLUDED(mu_);

  // Stops everything and waits for every exit to be reported. Idempotent.
  void Shutdown();

 private:
  struct Rank {
    v1::RankRef ref;
    pid_t pid = 0;
    int64_t step = 0;
    bool pulsing = false;  // printed a pulse line
    double loss = 0;       // of its last step line
    int64_t resumed_from = 0;  // its start line's resumed_from_step
    std::chrono::steady_clock::time_point last_line = std::chrono::steady_clock::now();
  };

  // ProcessObserver (called on the supervisor thread).
  void OnStdoutLine(ProcessId id, std::string_view line) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnExit(ProcessId id, const ProcessExit& exit) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<std::string>> TrainerArgv(const v1::Assignment& a,
                                                       const std::string& job_path,
                                                       const std::string& replica_root) const;
  void ReportLaunchFailure(const v1::RankRef& ref, const absl::Status& status, int exit_code = 127);
  void UpdateRunningGauge() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RankRunnerOptions options_;
  WorkerMetrics* const metrics_;
  MessageSink* const sink_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<ProcessId, Rank> ranks_ ABSL_GUARDED_BY(mu_);
  // Serialises Start() so two assignments of one rank cannot both launch.
  absl::Mutex start_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  // Declared last: destroyed first, so its callbacks never see a half-destroyed runner.
  std::unique_ptr<ProcessSupervisor> supervisor_;
};

// Rejects job ids that are not safe as one path component.
absl::Status ValidateJobIdForPath(const std::string& job_id);

}  // namespace spindle
