// ServiceLimits: what one client can hold of the coordinator through its long-lived calls, so
// that no number of clients makes it run out of threads or memory: concurrent Watch streams,
// how often and how rarely a stream is updated, how long one rendezvous Get waits and how many
// keys an attempt's rendezvous namespace holds. Each is a coordinator flag (coordinator/main.cc).
#pragma once

#include <cstdint>

namespace spindle {

struct ServiceLimits {
  // Concurrent JobService.Watch streams; one more is RESOURCE_EXHAUSTED. --max-watch-streams.
  int max_watch_streams = 256;
  // WatchJobRequest.min_interval_ms is clamped to [min, max].
  int64_t min_watch_interval_ms = 100;
  int64_t max_watch_interval_ms = 10000;
  // Longest wait of one RendezvousService.Get (clients call again to wait longer).
  int64_t max_rendezvous_wait_ms = 60000;
  // Keys in one attempt's rendezvous namespace. --max-rendezvous-keys.
  int64_t max_rendezvous_keys = 4096;
};

}  // namespace spindle
