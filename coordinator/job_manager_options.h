// What the job manager and its parts are configured with: timeouts, the rendezvous address given
// to workers, retention and registry limits (JobManagerOptions), and the metric children they
// update (JobManagerMetrics). Plain data; the daemon fills both from its flags.
#pragma once

#include <cstdint>
#include <string>

#include "coordinator/retention.h"
#include "coordinator/worker_registry.h"

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

}  // namespace spindle
