// GlooCommunicator: the CPU backend of Communicator over Gloo's TCP transport, bootstrapped from a
// KvStore (the coordinator's rendezvous service in a cluster run, a file or in-memory store
// otherwise). Several communicators (the world, each CP group) can be built over one store; each
// uses its own key prefix and its own Gloo context, so their collectives may run concurrently.
//
// Thread-safety: as Communicator (thread-safe); the Gloo context is used only by the
// communicator thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/kv_store.h"

namespace spindle {

struct GlooOptions {
  // Address this rank listens on (its peers connect to it). 127.0.0.1 for single-host runs.
  std::string hostname = "127.0.0.1";
  // Rendezvous wait and per-collective timeout.
  absl::Duration timeout = absl::Seconds(300);
};

// Connects `size` ranks that call this with the same `prefix` over `store` (blocking until all
// have arrived or the timeout passed). The store must outlive this call only.
// DeadlineExceeded / Unavailable name the prefix when the rendezvous fails. The process ignores
// SIGPIPE from then on (unless it has a handler), so that a peer that goes away fails a
// collective with a status rather than ending the process.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(KvStore& store,
                                                                     const std::string& prefix,
                                                                     int rank, int size,
                                                                     const GlooOptions& options);

}  // namespace spindle
