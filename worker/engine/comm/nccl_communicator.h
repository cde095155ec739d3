// NcclCommunicator: the GPU backend of Communicator over NCCL (built only when CUDA and NCCL are
// found; SPINDLE_HAVE_NCCL). Bootstraps from the same KvStore as Gloo: rank 0 creates the NCCL
// unique id and publishes it under "<prefix>/nccl_id"; the others read it.
//
// Buffers are device pointers on the communicator's device. Collectives run on the
// communicator's own CUDA stream, enqueued from the communicator thread, which then waits for the
// stream, so a handle's Wait() means the data is in place (the engine's compute stream needs no
// extra event). CommType::kByte is not summable (all-reduce of bytes is refused). A group of one
// runs through NCCL too (its buffers are device memory; no host shortcut).
// Every CUDA/NCCL call is checked; failures return absl::Status naming the call and the error:
// InvalidArgument for a negative or overflowing size, a root outside the group, or a buffer that
// is not device memory of the communicator's device (checked before NCCL sees it);
// Unavailable for an NCCL error raised while a collective runs (a peer gone); DeadlineExceeded
// when a collective does not finish within `timeout`. Both of the latter abort the NCCL
// communicator, and every later collective on it returns FailedPrecondition.
//
// Thread-safety: as Communicator (thread-safe); the NCCL communicator and stream are used only by
// the communicator thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/kv_store.h"

namespace spindle {

// Joins `size` ranks calling this with the same `prefix` over `store`; this rank uses CUDA device
// `device` (several ranks may live in one process, one thread and one device each). `timeout`
// bounds the wait for rank 0's id and each collective. Every rank waits in ncclCommInitRank until
// all ranks joined (no deadline there: NCCL's bootstrap has none).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(KvStore& store,
                                                                     const std::string& prefix,
                                                                     int rank, int size, int device,
                                                                     absl::Duration timeout);

}  // namespace spindle
