// The parity canary of a job without a cluster (`spindle-train --verify-only`, which `spindle
// plan --verify` runs): the job's whole world as threads of this process, on the CPU engine, over
// an in-memory store and Gloo on 127.0.0.1; each rank a Trainer of the job at its fresh initial
// parameters that runs the canary once (Trainer::Verify) on the job's first sequence and trains
// nothing. A GPU job is checked at its layout on the CPU engine with the GPU's number formats
// emulated (LocalParitySpec): what is verified is the layout, which both engines share, not the
// GPU's kernels. Thread-safe (no shared state); blocking.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "worker/engine/parity_canary.h"

namespace spindle {

// The most ranks a local check runs as threads.
inline constexpr int64_t kMaxLocalParityRanks = 64;

struct LocalParityOptions {
  // OpenMP threads for all ranks together (each rank gets threads / world, at least 1); 0: the
  // cores this process may run on (HostCores: its affinity mask).
  int64_t threads = 0;
  // Rendezvous and per-collective bound.
  absl::Duration timeout = absl::Seconds(120);
  // Rank 0's events (its parity event).
  std::function<void(const nlohmann::json&)> on_event;
};

// `spec` as the local check runs it: resources "cpu" ("auto" precision of a "cuda" job becomes
// "bf16", the GPU's storage), no offload, no checkpoint directory (fresh parameters, nothing
// written).
JobSpec LocalParitySpec(const JobSpec& spec);

// Runs the canary of `planned` (a planned spec: PlannedSpec in planner/cp_planner.h) and returns
// rank 0's result (every rank reaches the same verdict). InvalidArgument for a world larger than
// kMaxLocalParityRanks; otherwise the first failing rank's error, named by rank (a rank's own
// error before its peers' Aborted).
absl::StatusOr<ParityResult> VerifyLayoutInProcess(const JobSpec& planned,
                                                   const LocalParityOptions& options);

}  // namespace spindle
