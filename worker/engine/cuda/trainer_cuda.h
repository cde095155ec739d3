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

// FailedPrecondition for a model shape the CUDA kernels cannot run (CudaShapeProblem, named in
// the message), before any device work; Unavailable when no CUDA device is usable (no GPU, no
// driver); otherwise CudaModel::Create's errors.
absl::StatusOr<std::unique_ptr<StepBackend>> CreateCudaStepBackend(const ModelConfig& config,
                                                                   uint64_t seed, int64_t cp,
                                                                   int64_t ep, int64_t ep_rank);

}  // namespace spindle
