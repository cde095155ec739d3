// The coordinator's worker-facing types to and from cluster.proto: a RegisterRequest (with the
// address it came from) as a WorkerRegistration, a RegistrationReply as a RegisterResponse, a
// WorkerView as a WorkerInfo, a session's SessionHello and WorkerMessages as a WorkerHello and
// WorkerReports (worker_messages.h), and a WorkerCommand as a CoordinatorMessage. Used by
// grpc_services.cc (and tests that speak the wire types). Stateless.
#pragma once

#include <optional>
#include <string>

#include "coordinator/job_manager.h"
#include "coordinator/worker_messages.h"
#include "coordinator/worker_registry.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle {

DeviceOffer OfferFromProto(const v1::DeviceGroup& g);
void OfferToProto(const DeviceOffer& d, v1::DeviceGroup* g);

WorkerRegistration RegistrationFromProto(const v1::RegisterRequest& req,
                                         const std::string& observed_host);
void ReplyToProto(const RegistrationReply& reply, const std::string& worker_id,
                  v1::RegisterResponse* out);
void WorkerViewToProto(const WorkerView& view, v1::WorkerInfo* out);

WorkerHello HelloFromProto(const v1::SessionHello& hello);
// nullopt for a message that reports nothing (a hello after the first message, an empty one).
std::optional<WorkerReport> ReportFromProto(const v1::WorkerMessage& msg);
void CommandToProto(const WorkerCommand& command, v1::CoordinatorMessage* out);

}  // namespace spindle
