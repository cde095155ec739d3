// Test helper: the PlannedJob an Assignment carries, for tests that hand a worker assignments of
// their own (fake coordinators, the rank runner).
#pragma once

#include <string>

#include "common/job_spec.h"
#include "planner/plan_proto.h"
#include "planner/planned_job.h"
#include "spindle/v1/job.pb.h"

namespace spindle::testing {

// `spec_json` planned as the coordinator plans a job before any worker is registered (no device
// known); an empty message for a spec that does not parse.
inline v1::PlannedJob PlannedJobFor(const std::string& spec_json) {
  v1::PlannedJob out;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(spec_json);
  if (spec.ok()) PlannedJobToProto(PlanJob(*spec, 0), &out);
  return out;
}

}  // namespace spindle::testing
