// The worker registry's types to and from cluster.proto: a RegisterRequest (with the address
// it came from) as a WorkerRegistration, a RegistrationReply as a RegisterResponse, a WorkerView
// as a WorkerInfo. Used by grpc_services.cc (and tests that speak the wire types).
#pragma once

#include <string>

#include "coordinator/job_manager.h"
#include "coordinator/worker_registry.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle {

WorkerRegistration RegistrationFromProto(const v1::RegisterRequest& req,
                                         const std::string& observed_host);
void ReplyToProto(const RegistrationReply& reply, const std::string& worker_id,
                  v1::RegisterResponse* out);
void WorkerViewToProto(const WorkerView& view, v1::WorkerInfo* out);

}  // namespace spindle
