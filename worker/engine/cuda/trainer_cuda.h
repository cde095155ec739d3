// The trainer's GPU model: a StepBackend (worker/engine/step_backend.h) over CudaModel on device 0
// of the process (the worker daemon points CUDA_VISIBLE_DEVICES at the rank's GPU). spindle-train
// passes CreateCudaStepBackend as TrainerOptions::cuda_backend when built with the CUDA engine
// (SPINDLE_HAVE_CUDA_ENGINE). No CUDA types in this header.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "worker/engine/step_backend.h"

namespace spindle {

// FailedPrecondition for a cp > 1 that does not divide n_heads when the model's Lightning layers
// have no allgather mode on CUDA (head sizes other than 64 or 128; CudaModel::SetCp refuses a
// forced one likewise); Unavailable when no CUDA device is usable (no GPU, no driver);
// otherwise CudaModel::Create's errors.
absl::StatusOr<std::unique_ptr<StepBackend>> CreateCudaStepBackend(const ModelConfig& config,
                                                                   uint64_t seed, int64_t cp);

}  // namespace spindle
