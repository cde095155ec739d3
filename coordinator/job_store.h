// JobStore: the coordinator's durable state behind one interface: jobs, attempts with their rank
// placements, workers and the event history. Every write is atomic and durable when it returns
// OK, so a coordinator killed at any moment reopens with every acknowledged transition; a write
// that fails changed nothing. SqliteJobStore (sqlite_job_store.h) is the daemon's; unit tests use
// an in-memory one and a fault-injecting wrapper (tests/control/).
//
// Thread-safety: implementations are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/job_state.h"

namespace spindle {

struct JobRecord {
  std::string job_id;  // "j-000001"; assigned by CreateJob
  int64_t seq = 0;     // submission order; assigned by CreateJob
  std::string name;
  JobState state = JobState::kQueued;
  int64_t priority = 0;
  std::string spec_json;  // canonical spec JSON
  std::string plan;       // serialized spindle.v1.Plan
  int64_t submitted_ms = 0;
  int64_t updated_ms = 0;
  int64_t attempt = 0;  // 0: never placed
  int64_t restarts = 0;
  int64_t max_restarts = 0;
  std::string message;
  int64_t last_checkpoint_step = 0;
  std::string last_checkpoint_path;
  std::string request_id;  // the client's SubmitJobRequest.request_id; "" when none (unique)
  // Where a finished job ended (its ranks' lowest step and that step's loss), for a coordinator
  // restarted after it finished.
  int64_t final_step = 0;
  double final_loss = 0;
  std::string owner;  // the user who submitted it ("" when users are not named)
};

struct RankPlacement {
  int64_t rank = 0;
  std::string worker_id;
  int32_t device_index = 0;
};

struct AttemptRecord {
  std::string job_id;
  int64_t attempt = 0;
  std::vector<RankPlacement> ranks;  // indexed by rank
  std::string rendezvous_token;
  int64_t started_ms = 0;
  int64_t ended_ms = 0;  // 0 while live
  std::string outcome;   // "" while live; then the reason it ended
};

// A job keeps its newest events only: the store (SaveJob and CreateJob delete older ones) and the
// job manager's memory hold at most this many per job.
inline constexpr int64_t kMaxEventsPerJob = 1000;

struct EventRecord {
  std::string job_id;
  int64_t attempt = 0;
  int64_t unix_ms = 0;
  JobState state = JobState::kQueued;
  std::string message;
};

struct WorkerRecord {
  std::string worker_id;
  std::string hostname;
  std::string devices;  // serialized spindle.v1.RegisterRequest holding only `devices`
  std::string metrics_address;
  int64_t registered_ms = 0;
};

class JobStore {
 public:
  virtual ~JobStore() = default;

  // Inserts a new job with its first event; fills job->job_id and job->seq. Sequence numbers
  // (and so ids) are never reused, not even those of deleted jobs.
  virtual absl::Status CreateJob(JobRecord* job, const EventRecord& event) = 0;
  // Writes the whole job row, and (if given) an event and an attempt, in one transaction.
  virtual absl::Status SaveJob(const JobRecord& job, const EventRecord* event = nullptr,
                               const AttemptRecord* attempt = nullptr) = 0;

  virtual absl::StatusOr<std::vector<JobRecord>> LoadJobs() = 0;
  // Events of one job, oldest first.
  virtual absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& job_id) = 0;
  // NotFound when the attempt was never stored.
  virtual absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& job_id, int64_t attempt) = 0;

  // Deletes the jobs with their attempts, rank placements and events, in one transaction
  // (unknown ids are no error).
  virtual absl::Status DeleteJobs(const std::vector<std::string>& job_ids) = 0;

  virtual absl::Status SaveWorker(const WorkerRecord& worker) = 0;
  virtual absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() = 0;
};

}  // namespace spindle
