// The largest gRPC message any Spindle server or client sends or accepts. Every server builder and
// every channel sets it explicitly (send and receive), so that no default of the gRPC version in
// use decides it, and so that one oversized field is refused where it enters instead of making
// every later reply that carries it too large to deliver. It leaves room for the largest message
// the protocol itself carries: a rendezvous value (RendezvousStore::kMaxValueBytes, 4 MiB) and a
// page of a job's events or of the job list.
#pragma once

namespace spindle {

inline constexpr int kMaxGrpcMessageBytes = 8 << 20;

}  // namespace spindle
