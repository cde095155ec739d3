// Gang scheduling: places all dp*cp ranks of a job at once or none, in priority order (higher
// first), then submission order. Pure functions over snapshots, so the policy is unit-tested
// without the rest of the coordinator.
//
// Policy:
//   - A job is eligible on workers of its resource kind ("cuda"/"cpu") whose device memory is at
//     least the job's per-rank estimate (when the estimate is known).
//   - A job that pins host memory (train.offload: host_bytes_per_rank) places on a worker no more
//     ranks than kHostPinFill of its host memory holds beside what the ranks already running
//     there pin (when the worker's host memory is known).
//   - One rank per device (GPU or CPU slot). A gang that fits on one worker goes to the worker
//     with the fewest free devices that still holds it (best fit, keeps big holes for big
//     jobs); otherwise ranks fill workers in order of most free devices, consecutive ranks on
//     the same worker (CP groups stay local).
//   - No backfill: when the first job of a resource kind in priority order does not fit, no
//     later job of that kind is placed in that round, so large jobs are never starved by
//     smaller ones submitted after them.
//   - Admission (CheckCanEverFit): with at least one worker registered (alive or not), a job
//     is rejected when the devices of all registered workers of its kind and memory (device and
//     host) could not hold its world even when idle. With no worker registered at all, every job
//     is accepted and waits.
// Thread-safety: stateless functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/job_store.h"

namespace spindle {

// The share of a worker's host memory that offloading ranks may pin together (the rest is the
// system's, the daemons' and each trainer's host copy of the model).
inline constexpr double kHostPinFill = 0.8;

struct SchedulableWorker {
  std::string worker_id;
  std::string kind;  // "cuda" | "cpu"
  int64_t device_memory_bytes = 0;
  int64_t host_memory_bytes = 0;  // 0: unknown, not checked
  int64_t host_pinned_bytes = 0;  // pinned by the ranks running there (train.offload)
  int32_t total_devices = 0;
  std::vector<int32_t> free_devices;  // device indices not occupied
};

struct SchedulableJob {
  std::string job_id;
  int64_t priority = 0;
  int64_t seq = 0;
  int64_t world = 1;
  std::string kind;                // "cuda" | "cpu"
  int64_t memory_bytes_per_rank = 0;  // 0: not checked
  int64_t host_bytes_per_rank = 0;    // pinned host memory a rank needs (train.offload); 0: none
};

struct GangPlacement {
  std::string job_id;
  std::vector<RankPlacement> ranks;  // ranks[r].rank == r
};

// Places as many jobs as the policy allows; returns the placements in the order made.
std::vector<GangPlacement> ScheduleGangs(std::vector<SchedulableJob> jobs,
                                         std::vector<SchedulableWorker> workers);

// OK, or FailedPrecondition with the reason the job can never run on the registered workers,
// e.g. "job needs 16 cpu devices (world = dp*cp = 16) but the 2 registered cpu workers have 8".
absl::Status CheckCanEverFit(const SchedulableJob& job,
                             const std::vector<SchedulableWorker>& registered);

}  // namespace spindle
