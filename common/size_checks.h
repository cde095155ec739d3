// Bounds on the sizes a job spec implies, checked before anything multiplies them in 64-bit
// integers (the planner's memory estimate, the trainer's allocations): a well-formed but absurd
// spec (every width at its limit, a thousand layers, 16M tokens) is refused with
// InvalidArgument naming the quantity, instead of an estimate that wraps to a negative size.
// The quantities are computed in floating point (they cannot wrap), each against kMaxSpecBytes,
// with factors generous enough that every product the planner and the engines form from the same
// sizes stays far inside int64.
// Thread-safety: plain functions.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace spindle {

struct JobSpec;

// 64 PiB: more than any machine holds by orders of magnitude, and 2^7 below int64's range.
inline constexpr int64_t kMaxSpecBytes = int64_t{1} << 56;

// InvalidArgument "job spec: <quantity> ..." when the model's training state (weights, gradients,
// optimizer moments) or one sequence's activations would pass kMaxSpecBytes.
absl::Status CheckSpecSizes(const JobSpec& spec);

}  // namespace spindle
