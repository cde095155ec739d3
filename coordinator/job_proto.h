// The client API's types to spindle.v1 (job.proto): a JobView as a Job, an EventRecord as a
// JobEvent. Used by grpc_services.cc and by tests that speak the wire types. Stateless.
#pragma once

#include "coordinator/job_view.h"

namespace spindle {
namespace v1 {
class Job;
class JobEvent;
}  // namespace v1

void EventToProto(const EventRecord& e, v1::JobEvent* out);
void JobViewToProto(const JobView& view, v1::Job* out);

}  // namespace spindle
