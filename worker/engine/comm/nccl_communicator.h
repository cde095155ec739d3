// NcclCommunicator: the GPU backend of Communicator over NCCL (built only when CUDA and NCCL are
// found; SPINDLE_HAVE_NCCL). Bootstraps from the same KvStore as Gloo: rank 0 creates the NCCL
// unique id and publishes it under "<prefix>/nccl_id"; the others read it.
//
// Buffers are device pointers on the communicator's device. Collectives run on the
// communicator's own CUDA stream, enqueued from the communicator thread, which then waits for the
// stream, so a handle's Wait() means the data is in place (the engine's compute stream needs no
// extra event). CommType::kByte is not summable (all-reduce of bytes is refused).
// Every CUDA/NCCL call is checked; failures return absl::Status naming the call and the error.
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

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(KvStore& store,
                                                                     const std::string& prefix,
                                                                     int rank, int size, int device,
                                                                     absl::Duration timeout);

}  // namespace spindle
