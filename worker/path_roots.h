// Where a job may read and write on a worker: its checkpoint directory under the worker's
// --checkpoint_root, its data file (data.source "tokens:<path>" or "text:<path>") under its
// --data_root. A path is refused when it is not absolute, has a ".." component, or resolves
// (the realpath of its longest existing prefix, so symbolic links count) outside the root's own
// realpath. The rank runner checks every assignment before it starts a trainer.
// Thread-safety: free functions without state.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"

namespace spindle {

// The flags' defaults (worker_main.cc, worker/README.md).
inline constexpr char kDefaultCheckpointRoot[] = "/var/lib/spindle/checkpoints";
inline constexpr char kDefaultDataRoot[] = "/var/lib/spindle/data";

struct PathRoots {
  std::string checkpoint_root = kDefaultCheckpointRoot;  // absolute
  std::string data_root = kDefaultDataRoot;              // absolute
};

// OK when `path` lies in `root` (or is it) as described above; otherwise InvalidArgument naming
// `what` (e.g. "checkpoint.dir"), the path, `root_flag` (e.g. "--checkpoint_root") and the root.
absl::Status CheckPathUnderRoot(const std::string& what, const std::string& path,
                                const std::string& root_flag, const std::string& root);

// The checks of one job on this worker: its checkpoint.dir (none when empty) and the file of its
// data source (none for synthetic data).
absl::Status CheckJobPaths(const JobSpec& spec, const PathRoots& roots);

// OK when `root` is an absolute path without ".." components; otherwise InvalidArgument naming
// `flag` (the daemon refuses to start with it).
absl::Status CheckRootFlag(const std::string& flag, const std::string& root);

}  // namespace spindle
