// Link probe: what two ranks of this host exchange over Gloo's TCP transport on 127.0.0.1, the
// link of CPU slots ("loopback") and of ranks sharing one GPU ("same-device", whose collectives
// stage through the host and then take the same transport), for the planner's cost model
// (planner/cp_cost_model.h, LinkRates). The two ranks are threads of this process meeting over an
// in-memory store; they time SendRecv exchanges like a ring step's: first `pings` of 8 bytes (the
// per-message latency), then `rounds` of `bytes` each way at once (the bandwidth per rank and
// direction). The fastest of each counts, as in the kernel rate probe (rate_probe.h): what the
// link does when nothing else runs. About 0.1 s on an idle host; every wait is bounded by
// `timeout`. Not thread-safe (one probe at a time per process).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace spindle {

struct LinkProbeOptions {
  int64_t bytes = int64_t{4} << 20;
  int rounds = 4;
  int pings = 32;
  absl::Duration timeout = absl::Seconds(5);
};

struct MeasuredLink {
  double bytes_per_s = 0;  // per rank, each direction
  double latency_s = 0;    // per message
  // {"bytes_per_s", "latency_s"}
  nlohmann::json ToJson() const;
};

// InvalidArgument for options out of range (bytes in [1 KiB, 256 MiB], rounds and pings in
// [1, 1000]); the communicators' errors (a rendezvous or exchange that timed out) otherwise.
absl::StatusOr<MeasuredLink> MeasureLoopbackLink(const LinkProbeOptions& options = {});

}  // namespace spindle
