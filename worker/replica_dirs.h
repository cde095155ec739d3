// The worker's replica directory (checkpoint.replicas, worker/engine/replica_store.h): one
// subdirectory per job, where that job's ranks on this worker keep their in-memory replicas (the
// daemon's --replica_dir, on tmpfs: RAM, not the checkpoint volume). The daemon owns it: it
// empties it at start (a daemon that starts holds no replicas), bounds it to the replicas of
// kMaxReplicaJobs jobs (those of jobs that ran longest ago go first, never those of a job with a
// rank running here), and removes a job's replicas once one of its ranks here has finished the
// job. Within a job's directory the trainers keep at most two replicas (replica_store.h).
// Stateless functions; the daemon calls them from the runner's threads under its own lock.
#pragma once

#include <set>
#include <string>

#include "absl/status/status.h"

namespace spindle {

inline constexpr int kMaxReplicaJobs = 4;

// /dev/shm/spindle-replicas-<worker_id> when /dev/shm is a directory, else <work_dir>/replicas.
std::string DefaultReplicaDir(const std::string& worker_id, const std::string& work_dir);

// Creates `dir` and removes everything in it.
absl::Status ResetReplicaDir(const std::string& dir);

// <dir>/<job_id> (job_id is a valid path component), after removing the directories of other jobs
// that are not in `running` beyond the newest kMaxReplicaJobs - 1 (by modification time).
std::string ReplicaJobRoot(const std::string& dir, const std::string& job_id,
                           const std::set<std::string>& running);

// Removes <dir>/<job_id> and everything in it.
void RemoveReplicaJob(const std::string& dir, const std::string& job_id);

}  // namespace spindle
