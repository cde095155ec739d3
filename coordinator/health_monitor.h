// HealthMonitor: the coordinator's failure detector, as decisions over what the job manager knows
// (pure functions of the times they are given; no state, no I/O). Heartbeats: a worker silent past
// the heartbeat timeout is lost. Hangs: a rank that made no step progress for the hang timeout (or
// for kHangStepMultiple of its own last step time, when longer; the start timeout before its first
// step) hangs its gang; a rank whose trainer pulses and has printed nothing for the silence timeout
// has stopped. Fencing: when a rank stopped at `now` on a worker must be dead, whether or not the
// stop reaches it (a worker cut off from the coordinator stops its ranks itself a heartbeat timeout
// after its last acknowledged heartbeat, then takes up to the stop grace).
// Thread-safety: immutable after construction; safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/worker_registry.h"

namespace spindle {

struct HealthOptions {
  int64_t heartbeat_interval_ms = 1000;
  int64_t heartbeat_timeout_ms = 10000;
  int64_t hang_timeout_ms = 120000;
  int64_t start_timeout_ms = 600000;
  int64_t silence_timeout_ms = 5000;
  int64_t stop_grace_ms = 10000;
};

// What the monitor needs of one rank of a running attempt.
struct RankHealth {
  int64_t rank = 0;
  std::string worker_id;
  bool exited = false;
  int64_t step = 0;
  int64_t last_progress_ms = 0;  // steady clock
  int64_t step_ms = 0;           // its last step time; 0: none yet
};

class HealthMonitor {
 public:
  // A rank is hung after max(hang timeout, this many of its own last step time) without a step.
  static constexpr int64_t kHangStepMultiple = 3;

  explicit HealthMonitor(HealthOptions options) : o_(options) {}

  // Why the worker is lost at `now` ("no heartbeat for 3.5 s"), or "" when it is not.
  std::string Lost(const Worker& w, int64_t now) const;
  // Why the gang is hung at `now`, or "". Names the rank behind the others; when every rank
  // stands at the same step (one holds the rest in a collective), says so instead.
  std::string Hung(const std::vector<RankHealth>& ranks, int64_t now) const;
  // Why a pulsing rank silent for `silent_ms` has stopped, or "" while it is within the limit.
  std::string Silent(int64_t rank, const std::string& worker_id, int64_t silent_ms,
                     int64_t step) const;
  // By when a rank stopped at `now` on `w` is dead (fencing).
  int64_t DeadBy(const Worker& w, int64_t now) const;
  // The heartbeat timeout + stop grace + one heartbeat interval of margin: how long after the
  // coordinator's last word from a worker its ranks must have stopped.
  int64_t FenceMs() const;

  const HealthOptions& options() const { return o_; }

 private:
  const HealthOptions o_;
};

// "3.5 s".
std::string Seconds(int64_t ms);

}  // namespace spindle
