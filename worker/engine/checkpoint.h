// Checkpoints: one directory per step under the job's checkpoint root,
//   <root>/step_00000120/model.safetensors      parameters, DESIGN.md names, [out, in] layout
//   <root>/step_00000120/optimizer.safetensors  "exp_avg.<name>", "exp_avg_sq.<name>" (AdamW) or
//                                               "momentum_buffer.<name>" (SGD with momentum)
//   <root>/step_00000120/state.json             step, data position, RNG state, model config,
//                                               size + CRC-32 of both tensor files
//   <root>/latest                               name of the newest complete checkpoint
//   <root>/.writer.lock                         flock held while a checkpoint is written
// A checkpoint is written into a temporary directory, fsynced, then renamed into place, so a
// crash leaves either the old or the new checkpoint, never half of one. A failed write removes
// its temporary directory; the writer holding the lock removes any a killed writer left. The tensor
// files stream from and into the parameter and optimizer buffers (no second copy in memory).
// Loading verifies sizes, checksums (a streamed pass over each file), headers, names and shapes
// before it reads any value into place, so a bad checkpoint changes nothing; only a read failure
// after all that (the disk failing mid-load) can leave the buffers partly written. Stateless;
// thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/engine/optimizer.h"
#include "worker/engine/params.h"

namespace spindle {

struct TrainState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // sequences consumed from the data source (all ranks together)
  uint64_t seed = 0;
  uint64_t rng_counter = 0;  // draws taken from the trainer's generator
};

// Writes <root>/step_<step>/ atomically and points <root>/latest at it; keeps the newest `keep`.
// Returns the checkpoint directory.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, ParamSet& params,
                                           Optimizer* optimizer, const ModelConfig& config,
                                           const TrainState& state, int64_t keep);

// Creates `root` when missing and checks that files can be written in it, so that a job learns
// at its start, not at its first checkpoint, that it could not keep one.
absl::Status CheckCheckpointRoot(const std::string& root);

// The error of a failed file operation (`what` on `path`, errno `err`): FailedPrecondition, which
// fails the job without restarts, when the volume is full (ENOSPC, EDQUOT); Internal otherwise.
absl::Status CheckpointIoError(const std::string& what, const std::string& path, int err);

// The newest complete checkpoint under root: NotFound when there is none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// Loads a checkpoint directory into params (and optimizer when non-null, with its state
// allocated) after validating all of it; on a validation error nothing was modified.
absl::StatusOr<TrainState> LoadCheckpoint(const std::string& dir, ParamSet& params,
                                          Optimizer* optimizer, const ModelConfig& config);

// Reads the model config recorded in a checkpoint (for evaluation without a job spec).
absl::StatusOr<nlohmann::json> ReadCheckpointState(const std::string& dir);

// Parses the text of a state.json (`path` names it in errors): DataLoss for nesting deeper than
// kMaxJsonDepth (checked before parsing), text that is not a JSON object with step, files and
// model, or a field of the wrong type (step and the other counters integers, model and each
// files entry objects, their bytes and crc32 unsigned).
absl::StatusOr<nlohmann::json> ParseCheckpointState(std::string_view text, const std::string& path);

}  // namespace spindle
