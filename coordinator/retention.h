// Retention of finished jobs: which SUCCEEDED, FAILED or CANCELLED jobs the coordinator deletes
// (their rows and events in the store, and their state in memory) so that the store and every
// scan over it stay bounded. Unfinished jobs are never pruned.
// Thread-safety: stateless functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spindle {

struct RetentionPolicy {
  // A finished job is kept this long after it finished (0: no age limit). --keep-finished-days.
  int64_t max_age_ms = int64_t{14} * 24 * 3600 * 1000;
  // At most this many finished jobs are kept, the most recently finished (0: no count limit).
  // --keep-finished-jobs.
  int64_t max_finished_jobs = 10000;
};

struct FinishedJob {
  std::string job_id;
  int64_t seq = 0;          // submission order (ties of finished_ms: the older one goes first)
  int64_t finished_ms = 0;  // when it reached its terminal state
};

// The ids of the finished jobs `policy` removes at `now_ms`: every job finished more than
// max_age_ms ago, and beyond the max_finished_jobs most recently finished, the rest.
std::vector<std::string> JobsToPrune(const RetentionPolicy& policy,
                                     std::vector<FinishedJob> finished, int64_t now_ms);

}  // namespace spindle
