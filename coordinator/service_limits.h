// ServiceLimits: what one client can hold of the coordinator through its long-lived calls, so
// that no number of clients makes it run out of threads or memory: concurrent Watch streams,
// how often and how rarely a stream is updated and how long one update may wait for a client that
// does not read, concurrent worker Session streams and what each may have queued either way,
// concurrent blocking rendezvous Gets, how long one waits and how many keys an attempt's
// rendezvous namespace holds. Most are coordinator flags (coordinator/main.cc).
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
  // Concurrent rendezvous Gets that wait (wait_timeout_ms > 0); one more is RESOURCE_EXHAUSTED.
  // --max-rendezvous-waits.
  int max_rendezvous_waits = 4096;
  // Concurrent ClusterService.Session streams, counted from their start (before the hello); one
  // more is RESOURCE_EXHAUSTED. --max-sessions.
  int max_sessions = 2048;
  // A Watch update, or a message to a worker, not taken by the client for this long ends the
  // stream (a client that does not read holds a thread and memory otherwise); so does a Session
  // whose hello has not come this long after it opened.
  int64_t stream_write_timeout_ms = 30000;
  // Messages queued for one worker's session; one more ends the session (the worker reconnects
  // and lists what it runs).
  int64_t max_session_outbound = 1024;
  // Reports of one worker's session read but not yet taken in by the job manager (heartbeats and
  // each rank's progress are coalesced); one more ends the session with RESOURCE_EXHAUSTED.
  int64_t max_session_inbound = 4096;
};

}  // namespace spindle
