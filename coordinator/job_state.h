// JobState: the job lifecycle of DESIGN.md section 5, numbered as spindle.v1.JobState so values
// convert with a cast. Plain data.
#pragma once

#include <string_view>

namespace spindle {

enum class JobState : int {
  kQueued = 1,
  kPlaced = 2,
  kRunning = 3,
  kSucceeded = 4,
  kFailed = 5,
  kCancelled = 6,
  kRestarting = 7,
};

inline bool IsTerminal(JobState s) {
  return s == JobState::kSucceeded || s == JobState::kFailed || s == JobState::kCancelled;
}

// Lower-case name as the CLI and metrics print it ("queued", "running", ...).
inline std::string_view JobStateName(JobState s) {
  switch (s) {
    case JobState::kQueued: return "queued";
    case JobState::kPlaced: return "placed";
    case JobState::kRunning: return "running";
    case JobState::kSucceeded: return "succeeded";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
    case JobState::kRestarting: return "restarting";
  }
  return "unknown";
}

inline constexpr JobState kAllJobStates[] = {
    JobState::kQueued,    JobState::kPlaced, JobState::kRunning,   JobState::kSucceeded,
    JobState::kFailed,    JobState::kCancelled, JobState::kRestarting};

}  // namespace spindle
