// StagedCommunicator: a Communicator on device buffers over one on host buffers (Gloo), for GPU
// ranks that cannot use NCCL (several ranks sharing one GPU, or a device job on hosts without
// it). Each collective copies its inputs from the device into pinned host staging, runs the host
// communicator's collective, and copies the results back, on a CUDA stream of its own, from the
// communicator thread; a handle's Wait() means the data is in place on the device, as with NCCL.
// So the engine issues the same calls on device buffers whichever backend serves them; as with
// NCCL, the caller makes sure the work that writes a buffer has finished before it issues.
//
// The host communicator (not owned) must outlive this one; it records the amounts under each
// collective's layer type (TakeStats on it reports them); this one's own records count the same
// collectives again.
// The staging is two pinned blocks, grown to the largest collective seen and kept. Built only
// with CUDA. Thread-safety: as Communicator.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"

namespace spindle {

// `host`: a communicator on host memory (rank and size are its own). `device`: the CUDA device
// whose memory the buffers are on.
absl::StatusOr<std::unique_ptr<Communicator>> CreateStagedCommunicator(Communicator* host,
                                                                       int device);

}  // namespace spindle
