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

// The refusal of context parallelism (cp > 1) until CudaModel's CP passes have run on a GPU; the
// factory (before any device work) and SetCp() return it as Unimplemented.
extern const char kCudaCpNotEnabled[];

// Unimplemented for cp > 1 (kCudaCpNotEnabled); Unavailable when no CUDA device is usable (no GPU,
// no driver); otherwise CudaModel::Create's errors.
absl::StatusOr<std::unique_ptr<StepBackend>> CreateCudaStepBackend(const ModelConfig& config,
                                                                   uint64_t seed, int64_t cp);

}  // namespace spindle
