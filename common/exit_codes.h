// The trainer's exit codes, as spindle-train returns them and the coordinator reads them from a
// rank's exit (cluster.proto RankExit): 0 success, kExitInvalidInput (the job fails without
// restarts), kExitOutOfMemory (the gang restarts; a job with train.recompute "auto" with more
// layers recomputing), anything else a runtime failure (the gang restarts).
#pragma once

namespace spindle {

inline constexpr int kExitRuntimeFailure = 1;
inline constexpr int kExitInvalidInput = 2;
inline constexpr int kExitOutOfMemory = 3;

}  // namespace spindle
