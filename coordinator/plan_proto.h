// Conversion of a CpPlan to its wire form (spindle.v1.Plan), shared by the coordinator and the
// CLI's offline `spindle plan`. Stateless.
#pragma once

#include "coordinator/cp_planner.h"

namespace spindle {
namespace v1 {
class Plan;
}  // namespace v1

void PlanToProto(const CpPlan& plan, v1::Plan* out);
// A decided mode (never kAuto) on the wire; the one mapping the coordinator's messages use.
int CpModeToProto(CpMode m);  // a v1::CpMode value

}  // namespace spindle
