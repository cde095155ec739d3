// Worker types to and from cluster.proto (see worker_proto.h).
#include "coordinator/worker_proto.h"

namespace spindle {
namespace {

DeviceOffer OfferFromProto(const v1::DeviceGroup& g) {
  return {g.kind(), g.name(), g.count(), g.memory_bytes(), g.host_memory_bytes()};
}

void OfferToProto(const DeviceOffer& d, v1::DeviceGroup* g) {
  g->set_kind(d.kind);
  g->set_name(d.name);
  g->set_count(d.count);
  g->set_memory_bytes(d.memory_bytes);
  g->set_host_memory_bytes(d.host_memory_bytes);
}

}  // namespace

WorkerRegistration RegistrationFromProto(const v1::RegisterRequest& req,
                                         const std::string& observed_host) {
  WorkerRegistration reg;
  reg.worker_id = req.worker_id();
  reg.hostname = req.hostname();
  reg.instance_id = req.instance_id();
  reg.advertise_host = req.advertise_host();
  reg.observed_host = observed_host;
  reg.metrics_address = req.metrics_address();
  for (const v1::DeviceGroup& g : req.devices()) reg.devices.push_back(OfferFromProto(g));
  return reg;
}

void ReplyToProto(const RegistrationReply& reply, const std::string& worker_id,
                  v1::RegisterResponse* out) {
  out->set_worker_id(worker_id);
  out->set_heartbeat_interval_ms(static_cast<int32_t>(reply.heartbeat_interval_ms));
  out->set_heartbeat_timeout_ms(static_cast<int32_t>(reply.heartbeat_timeout_ms));
  out->set_stop_grace_ms(static_cast<int32_t>(reply.stop_grace_ms));
  out->set_observed_host(reply.observed_host);
}

void WorkerViewToProto(const WorkerView& v, v1::WorkerInfo* out) {
  out->set_worker_id(v.worker_id);
  out->set_hostname(v.hostname);
  OfferToProto(v.devices, out->add_devices());
  out->set_metrics_address(v.metrics_address);
  out->set_state(v.state);
  out->set_slots(v.slots);
  out->set_used_slots(v.used_slots);
  out->set_last_heartbeat_unix_ms(v.last_heartbeat_unix_ms);
  out->set_registered_unix_ms(v.registered_unix_ms);
  for (const std::string& r : v.ranks) out->add_ranks(r);
  out->set_address(v.address);
}

}  // namespace spindle
