// Checkpoints: one directory per step under the job's checkpoint root,
//   <root>/step_00000120/model.safetensors      parameters, DESIGN.md names, [out, in] layout
//   <root>/step_00000120/optimizer.safetensors  "exp_avg.<name>", "exp_avg_sq.<name>" (AdamW) or
//                                               "momentum_buffer.<name>" (SGD with momentum)
//   <root>/step_00000120/state.json             step, data position, RNG state, model config,
//                                               size + CRC-32 of both tensor files
//   <root>/latest                               name of the newest complete checkpoint
//   <root>/.writer.lock                         flock held while a checkpoint is written
//   <root>/fence                                the newest attempt of the job that took the
//                                               root over (cluster jobs; see FenceCheckpointRoot)
//   <root>/commits.log                          one JSON line per fence ({"fence": N}) and commit
//                                               ({"commit": step, "attempt": N}), with "unix_ms",
//                                               in the order they held the writer lock
// A checkpoint is written into a temporary directory, fsynced, then renamed into place, so a
// crash leaves either the old or the new checkpoint, never half of one. A failed write removes
// its temporary directory; the writer holding the lock removes any a killed writer left. The tensor
// files stream from and into the parameter and optimizer buffers (SaveCheckpoint: no second copy
// in memory), or from a host snapshot of them (CommitCheckpoint, as the background writer of
// checkpoint_writer.h calls it).
// Loading verifies sizes, checksums (a streamed pass over each file), headers, names and shapes
// before it reads any value into place, so a bad checkpoint changes nothing; only a read failure
// after all that (the disk failing mid-load) can leave the buffers partly written. Stateless;
// thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/engine/optimizer.h"
#include "worker/engine/params.h"
#include "worker/engine/safetensors.h"

namespace spindle {

struct TrainState {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // sequences consumed from the data source (all ranks together)
  uint64_t seed = 0;
  uint64_t rng_counter = 0;  // draws taken from the trainer's generator
  double loss = 0;           // the loss of step `step` (0: not recorded)
  // The layout (ParityLayoutKey, parity_canary.h) the parity canary last passed at, so that a
  // restart at that layout does not verify it again; empty: none (or written before the field).
  std::string verified_layout;
};

// The whole tensors of a ParamSet's sharded parameters (ParamInfo::sharded, expert parallelism),
// gathered from the ranks that hold their shards, by parameter index: the values, then the
// optimizer's state0 and state1 (empty where the optimizer keeps none), each full_shape's size.
struct GatheredShards {
  std::map<int, std::array<std::vector<float>, 3>> tensors;
};

// The tensors one checkpoint writes, by name (SafetensorsEntry::data: where each one's values
// are read from), and what state.json says of the optimizer.
struct CheckpointTensors {
  std::map<std::string, SafetensorsEntry> model, optimizer;
  std::string optimizer_name = "none";  // the optimizer.safetensors metadata
  int64_t optimizer_steps = 0;
};

// What the optimizer's part of a checkpoint is: its spec().optimizer, is_adamw(), steps_taken().
struct OptimizerKind {
  std::string name;
  bool adamw = false;
  int64_t steps = 0;
};

// The checkpoint tensors of `params` with the values at `values` (the flat layout of params) and
// the optimizer state at `state0` / `state1` (the same layout; null where the optimizer keeps
// none; `optimizer` null: no optimizer). Sharded parameters are taken whole from `gathered`
// (FailedPrecondition when it lacks one or holds the wrong size).
absl::StatusOr<CheckpointTensors> CollectCheckpointTensors(const ParamSet& params,
                                                           const float* values, const float* state0,
                                                           const float* state1,
                                                           const OptimizerKind* optimizer,
                                                           const GatheredShards* gathered);

// Commits `tensors` as <root>/step_<state.step>/ with the crash-safe protocol SaveCheckpoint
// describes (writer lock, fence, temporary directory, fsync, rename, latest, pruning to `keep`,
// commits.log). `pause_between_files_ms` > 0 is a test hook: the writer sleeps that long after
// each file it writes into the temporary directory (so that a test can kill it mid-write).
absl::StatusOr<std::string> CommitCheckpoint(const std::string& root,
                                             const CheckpointTensors& tensors,
                                             const ModelConfig& config, const TrainState& state,
                                             int64_t keep, int64_t attempt,
                                             int64_t pause_between_files_ms = 0);

// A checkpoint's files as bytes in memory (the in-memory replicas of replica_store.h): the same
// model.safetensors, optimizer.safetensors and state.json that CommitCheckpoint writes.
struct CheckpointFiles {
  std::string model, optimizer, state;
};

// The files CommitCheckpoint would write for `tensors`, in memory (the strings of `reuse` keep
// their capacity: a trainer serialises into the same buffers every time).
CheckpointFiles SerializeCheckpoint(const CheckpointTensors& tensors, const ModelConfig& config,
                                    const TrainState& state, CheckpointFiles reuse = {});

// DataLoss (naming `what`) unless files.state is a valid state.json whose sizes and CRC-32s are
// those of files.model and files.optimizer.
absl::Status VerifyCheckpointFiles(const CheckpointFiles& files, const std::string& what);

// The three files of a checkpoint directory, read whole (NotFound when one is missing).
absl::StatusOr<CheckpointFiles> ReadCheckpointFiles(const std::string& dir);

// Commits the given files (name, bytes) as <root>/step_<step>/ with CommitCheckpoint's
// crash-safe protocol (writer lock, fence, temporary directory, fsync, rename, latest, pruning
// to `keep`); state.json is written last. Unlike CommitCheckpoint it adds no commits.log line
// (in-memory replicas commit often, and their root would grow by a line each time).
absl::StatusOr<std::string> CommitCheckpointFiles(
    const std::string& root, int64_t step,
    const std::vector<std::pair<std::string, std::string_view>>& files, int64_t keep,
    int64_t attempt);

// Writes <root>/step_<step>/ atomically and points <root>/latest at it; keeps the newest `keep`.
// Returns the checkpoint directory. `attempt` > 0 (a cluster job's attempt) fences the commit:
// Aborted, with nothing written, when a newer attempt has fenced the root. Sharded parameters are
// written whole from `gathered` (FailedPrecondition when it lacks one), so a checkpoint never
// depends on the layout that wrote it.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, ParamSet& params,
                                           Optimizer* optimizer, const ModelConfig& config,
                                           const TrainState& state, int64_t keep,
                                           int64_t attempt = 0,
                                           const GatheredShards* gathered = nullptr);

// Fencing: attempt N of a cluster job takes the root over before it loads anything, under the
// writer lock that every commit holds. From then on a rank 0 of an older attempt still running
// (a host cut off from the coordinator, say) can neither commit a checkpoint, move `latest` nor
// delete one. Aborted when a newer attempt than `attempt` holds the root already; writing the
// same attempt again is a no-op.
absl::Status FenceCheckpointRoot(const std::string& root, int64_t attempt);

// The attempt the root is fenced by; 0 when it has no fence.
absl::StatusOr<int64_t> ReadFence(const std::string& root);

// The complete checkpoint directories under root (those with a state.json), newest first.
std::vector<std::string> CompleteCheckpoints(const std::string& root);

// The step a checkpoint directory's name (".../step_NNNNNNNN") says; -1 for any other name.
int64_t CheckpointStepOf(const std::string& dir);

// Creates `root` when missing and checks that files can be written in it, so that a job learns
// at its start, not at its first checkpoint, that it could not keep one.
absl::Status CheckCheckpointRoot(const std::string& root);

// The error of a failed file operation (`what` on `path`, errno `err`): FailedPrecondition, which
// fails the job without restarts, when the volume is full (ENOSPC, EDQUOT); Internal otherwise.
absl::Status CheckpointIoError(const std::string& what, const std::string& path, int err);

// The newest complete checkpoint under root: NotFound when there is none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// Loads a checkpoint directory into params (and optimizer when non-null, with its state
// allocated) after validating all of it; on a validation error nothing was modified. A sharded
// parameter reads its shard of the whole tensor.
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
