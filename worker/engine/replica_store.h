// In-memory checkpoint replicas (checkpoint.replicas, common/job_spec.h): a trainer's snapshots
// of the job's state kept in a worker's replica directory (tmpfs: RAM, not the checkpoint
// volume), so that a gang restarting after a rank death resumes from the newest snapshot rather
// than the last file checkpoint.
//
// A replica is a checkpoint: the same model.safetensors, optimizer.safetensors and state.json
// (checkpoint.h's format, layout-free), plus replica.json naming the job and the attempt that
// took it, committed under <replica root>/step_<S>/ with the checkpoint's crash-safe protocol
// (writer lock, fence, temporary directory, rename) and keep = 1: a root holds at most the newest
// complete replica and the one being written. A replica root is one job's directory on one
// worker; the attempt that resumes fences it first, so a rank of an older attempt still running
// there cannot replace what the new one reads.
//
// What is accepted: a complete replica (state.json present) whose replica.json names this job and
// an earlier attempt, whose state.json parses and whose tensor files have the sizes and CRC-32s
// it records. Anything else is refused with a reason (incomplete replicas are not candidates at
// all). Received replicas are bounded before any byte is held: ReplicaBoundFor gives the largest
// files a replica of the job's model can have. Stateless; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/params.h"

namespace spindle {

// Who took a replica (its replica.json).
struct ReplicaOrigin {
  std::string job_id;
  int64_t attempt = 0;
};

// The largest byte counts a replica's files may have.
struct ReplicaBound {
  int64_t model = 0, optimizer = 0, state = 0;
};

// The bound for a model of `params` (whole tensors, full_shape) whose optimizer keeps
// `optimizer_states` values per parameter (AdamW 2, SGD with momentum 1, none 0): each tensor
// file's values plus room for its header, and 1 MiB for state.json.
ReplicaBound ReplicaBoundFor(const ParamSet& params, int optimizer_states);

// InvalidArgument naming `from` and the file when a size is negative or over the bound.
absl::Status CheckReplicaSizes(int64_t model, int64_t optimizer, int64_t state,
                               const ReplicaBound& bound, const std::string& from);

// Commits `files` (a checkpoint of `step`) as the newest replica under `root` for `origin`,
// removing the older one. Aborted when a newer attempt has fenced the root.
absl::StatusOr<std::string> CommitReplica(const std::string& root, int64_t step,
                                          const CheckpointFiles& files,
                                          const ReplicaOrigin& origin);

// The newest replica under `root` that attempt `attempt` of job `job_id` may resume from, with its
// files read and verified; `refused` gets one line for each newer one that was passed over.
struct ReplicaChoice {
  int64_t step = 0;  // 0: none
  std::string dir;
  CheckpointFiles files;
  std::vector<std::string> refused;
};
// A replica whose files are larger than `bound` is refused before it is read.
ReplicaChoice NewestReplica(const std::string& root, const std::string& job_id, int64_t attempt,
                            const ReplicaBound& bound);

// The temporary directory a rank writes a replica it received into before loading it; the
// checkpoint writer's stale-temporary cleanup removes one a killed rank left.
std::string ReplicaLoadDir(const std::string& root);

// Writes `files` into `dir` (created; replaced when present) for LoadCheckpoint.
absl::Status WriteReplicaForLoad(const std::string& dir, const CheckpointFiles& files);

// Removes `dir` and the files in it.
void RemoveReplicaDir(const std::string& dir);

}  // namespace spindle
