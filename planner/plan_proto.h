// A CpPlan to and from its wire form (spindle.v1.Plan), shared by the coordinator and the CLI's
// offline `spindle plan`; the same encoding is how a job record stores its plan. Stateless.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "planner/cp_planner.h"

namespace spindle {
namespace v1 {
class Plan;
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

}  // namespace spindle
