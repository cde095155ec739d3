// What workers and the coordinator say to each other on a session, as the coordinator's own
// types: a worker's hello and reports (cluster.proto's SessionHello and WorkerMessage) and the
// coordinator's commands (Assignment, Stop); and what a registered worker is told. worker_proto.h converts them to and from the wire;
// the job manager and its parts speak only these. Plain data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "common/job_spec.h"
#include "coordinator/moe_summary.h"
#include "planner/planned_job.h"

namespace spindle {

// One rank of one attempt of a job.
struct RankKey {
  std::string job_id;
  int64_t attempt = 0;
  int64_t rank = 0;
};

// A rank a worker's trainer process runs, as its hello and heartbeats list it.
struct RunningRankReport {
  RankKey ref;
  int64_t step = 0;  // last step it reported
  int64_t pid = 0;
  bool pulsing = false;    // its trainer prints a pulse every second
  int64_t silent_ms = 0;   // since its last line (meaningful when pulsing)
  double loss = 0;         // of `step`
};

// The first message of a session.
struct WorkerHello {
  std::string worker_id;
  std::string instance_id;  // the worker process; must be the one that registered
  std::vector<RunningRankReport> running;
};

struct HeartbeatReport {
  int64_t unix_ms = 0;
  int64_t seq = 0;  // acknowledged by the session (the worker's fencing counts from the ack)
  std::vector<RunningRankReport> running;
};

struct RankStartedReport {
  RankKey ref;
  int64_t pid = 0;
};

struct RankProgressReport {
  RankKey ref;
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double tokens_per_s = 0;
  double lr = 0;
  double grad_norm = 0;
  double elapsed_s = 0;
  double mfu = 0;
  double memory_bytes = 0;
  MoeSummary moe;
  int64_t resumed_from_step = 0;  // 0: from scratch or not reported
};

struct CheckpointDoneReport {
  RankKey ref;
  int64_t step = 0;
  std::string path;
};

struct RankExitReport {
  RankKey ref;
  int32_t exit_code = 0;
  int32_t signal = 0;  // 0: exited by itself
  std::vector<std::string> stderr_tail;
  bool stopped = false;  // it was stopped on purpose
  double last_loss = 0;  // of its last step (0: unknown)
};

// The worker is shutting down on purpose.
struct LeavingReport {
  std::string reason;
};

// One line a rank wants among its job's events.
struct RankNoteReport {
  RankKey ref;
  std::string text;
};

using WorkerReport = std::variant<HeartbeatReport, RankStartedReport, RankProgressReport,
                                  CheckpointDoneReport, RankExitReport, LeavingReport,
                                  RankNoteReport>;

// Start one rank of an attempt.
struct AssignmentCommand {
  RankKey ref;
  // The job as planned, shared by its ranks' assignments (never null).
  std::shared_ptr<const PlannedJob> job;
  std::string rendezvous_address;  // "" : the coordinator address the worker dials
  std::string rendezvous_token;
  int64_t resume_step = 0;
  std::string resume_path;
  int32_t device_index = 0;
  std::string host_address;  // the ranks' Gloo address: the worker's own
};

// Stop every rank of (job_id, attempt): SIGTERM, then SIGKILL after the grace period.
struct StopCommand {
  std::string job_id;
  int64_t attempt = 0;
  std::string reason;
  int64_t grace_period_ms = 0;
};

using WorkerCommand = std::variant<AssignmentCommand, StopCommand>;

// What a registered worker is told (cluster.proto's RegisterResponse).
struct RegistrationReply {
  int64_t heartbeat_interval_ms = 0;
  int64_t heartbeat_timeout_ms = 0;
  int64_t stop_grace_ms = 0;
  std::string observed_host;
};

}  // namespace spindle
