// A CpPlan to and from its wire form (spindle.v1.Plan), shared by the coordinator and the CLI's
// offline `spindle plan`; a PlannedJob (planned_job.h) to and from spindle.v1.PlannedJob, the
// form a job record stores and an Assignment carries. Stateless.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "planner/cp_planner.h"
#include "planner/planned_job.h"

namespace spindle {
namespace v1 {
class Plan;
class PlannedJob;
}  // namespace v1

// A decided mode's spindle.v1.CpMode value (CP_MODE_UNSPECIFIED for kAuto).
int CpModeToProto(CpMode m);
// CP_MODE_UNSPECIFIED (or a value this build does not know) is kAuto.
CpMode CpModeFromProto(int m);

void PlanToProto(const CpPlan& plan, v1::Plan* out);
void PlanFromProto(const v1::Plan& p, CpPlan* out);

// The plan as a job record stores it, and back (DataLoss for bytes that are not a plan).
std::string EncodePlan(const CpPlan& plan);
absl::StatusOr<CpPlan> DecodePlan(const std::string& bytes);

void PlannedJobToProto(const PlannedJob& job, v1::PlannedJob* out);
// Parses the planned spec (once: the requested one stays JSON until a Replan). InvalidArgument
// naming what is wrong for a spec that does not parse, or one that leaves a decision open
// (IsPlanned): a PlannedJob's spec is run as given.
absl::StatusOr<PlannedJob> PlannedJobFromProto(const v1::PlannedJob& p);
// The planned job as a job record stores it, and back (DataLoss for bytes that are not one, or
// one without a planned spec: a record of an older release, which stored only its plan).
std::string EncodePlannedJob(const PlannedJob& job);
absl::StatusOr<PlannedJob> DecodePlannedJob(const std::string& bytes);

}  // namespace spindle
