// Worker types to and from cluster.proto (see worker_proto.h).
#include "coordinator/worker_proto.h"

#include <algorithm>

#include "common/text_bounds.h"
#include "planner/plan_proto.h"

namespace spindle {
namespace {

// Every string a worker sends is cut to its bound (text_bounds.h) where it enters: a job id too
// long to be one names no job.
RankKey KeyFromProto(const v1::RankRef& r) {
  return {BoundedUtf8(r.job_id(), kMaxIdBytes), r.attempt(), r.rank()};
}

void KeyToProto(const RankKey& k, v1::RankRef* r) {
  r->set_job_id(k.job_id);
  r->set_attempt(k.attempt);
  r->set_rank(k.rank);
}

std::vector<RunningRankReport> RunningFromProto(
    const google::protobuf::RepeatedPtrField<v1::RunningRank>& running) {
  std::vector<RunningRankReport> out;
  out.reserve(running.size());
  for (const v1::RunningRank& r : running)
    out.push_back({KeyFromProto(r.ref()), r.step(), r.pid(), r.pulsing(), r.silent_ms(), r.loss()});
  return out;
}

}  // namespace

DeviceOffer OfferFromProto(const v1::DeviceGroup& g) {
  DeviceOffer d{BoundedUtf8(g.kind(), kMaxIdBytes), BoundedUtf8(g.name(), kMaxDeviceNameBytes),
                g.count(), g.memory_bytes(), g.host_memory_bytes()};
  const v1::DeviceRates& r = g.rates();
  d.rates = {r.gemm_flops(), r.attention_flops(), r.lightning_flops(), r.memory_bytes(),
             r.copy_bytes()};
  d.link = BoundedUtf8(g.link(), kMaxIdBytes);
  d.link_rates = {g.link_bytes_per_s(), g.link_latency_s()};
  d.cores = g.cores();
  d.threads_per_rank = g.threads_per_rank();
  return d;
}

void OfferToProto(const DeviceOffer& d, v1::DeviceGroup* g) {
  g->set_kind(d.kind);
  g->set_name(d.name);
  g->set_count(d.count);
  g->set_memory_bytes(d.memory_bytes);
  g->set_host_memory_bytes(d.host_memory_bytes);
  v1::DeviceRates* r = g->mutable_rates();
  r->set_gemm_flops(d.rates.gemm_flops);
  r->set_attention_flops(d.rates.attention_flops);
  r->set_lightning_flops(d.rates.lightning_flops);
  r->set_memory_bytes(d.rates.memory_bytes);
  r->set_copy_bytes(d.rates.copy_bytes);
  g->set_link(d.link);
  g->set_link_bytes_per_s(d.link_rates.bytes_per_s);
  g->set_link_latency_s(d.link_rates.latency_s);
  g->set_cores(d.cores);
  g->set_threads_per_rank(d.threads_per_rank);
}

WorkerRegistration RegistrationFromProto(const v1::RegisterRequest& req,
                                         const std::string& observed_host) {
  WorkerRegistration reg;
  // Ids are checked, not cut (WorkerRegistry refuses one too long); the rest is cut.
  reg.worker_id = req.worker_id();
  reg.hostname = BoundedUtf8(req.hostname(), kMaxHostBytes);
  reg.instance_id = req.instance_id();
  reg.advertise_host = req.advertise_host();
  reg.observed_host = observed_host;
  reg.metrics_address = BoundedUtf8(req.metrics_address(), kMaxHostBytes);
  reg.checkpoint_root = BoundedUtf8(req.checkpoint_root(), kMaxPathBytes);
  reg.data_root = BoundedUtf8(req.data_root(), kMaxPathBytes);
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

WorkerHello HelloFromProto(const v1::SessionHello& hello) {
  return {hello.worker_id(), hello.instance_id(), RunningFromProto(hello.running())};
}

std::optional<WorkerReport> ReportFromProto(const v1::WorkerMessage& msg) {
  switch (msg.kind_case()) {
    case v1::WorkerMessage::kHeartbeat: {
      const v1::Heartbeat& h = msg.heartbeat();
      return HeartbeatReport{h.unix_ms(), h.seq(), RunningFromProto(h.running())};
    }
    case v1::WorkerMessage::kRankStarted:
      return RankStartedReport{KeyFromProto(msg.rank_started().ref()), msg.rank_started().pid()};
    case v1::WorkerMessage::kRankProgress: {
      const v1::RankProgress& p = msg.rank_progress();
      RankProgressReport r{KeyFromProto(p.ref()), p.step(),      p.total_steps(),
                           p.loss(),              p.tokens_per_s(), p.lr(),
                           p.grad_norm(),         p.elapsed_s(),  p.mfu(),
                           p.memory_bytes()};
      r.resumed_from_step = p.resumed_from_step();
      if (p.has_moe()) {
        const v1::MoeStatus& m = p.moe();
        r.moe = {true,          m.load_max_over_mean(), m.bias_min(),  m.bias_max(),
                 m.router_z_loss(), m.dispatch_bytes(),  m.dispatch_s()};
      }
      return r;
    }
    case v1::WorkerMessage::kCheckpointDone: {
      const v1::CheckpointDone& c = msg.checkpoint_done();
      return CheckpointDoneReport{KeyFromProto(c.ref()), c.step(),
                                  BoundedUtf8(c.path(), kMaxPathBytes)};
    }
    case v1::WorkerMessage::kRankExit: {
      const v1::RankExit& e = msg.rank_exit();
      // The last lines of the tail, each cut.
      std::vector<std::string> tail;
      const int first = std::max(0, e.stderr_tail_size() - static_cast<int>(kMaxStderrTailLines));
      for (int i = first; i < e.stderr_tail_size(); ++i)
        tail.push_back(BoundedUtf8(e.stderr_tail(i), kMaxNoteBytes));
      return RankExitReport{KeyFromProto(e.ref()), e.exit_code(), e.signal(),
                            std::move(tail),       e.stopped(),   e.last_loss()};
    }
    case v1::WorkerMessage::kLeaving:
      return LeavingReport{BoundedUtf8(msg.leaving().reason(), kMaxReasonBytes)};
    case v1::WorkerMessage::kNote:
      return RankNoteReport{KeyFromProto(msg.note().ref()),
                            BoundedUtf8(msg.note().text(), kMaxNoteBytes)};
    case v1::WorkerMessage::kHello:
    case v1::WorkerMessage::KIND_NOT_SET:
      break;
  }
  return std::nullopt;
}

namespace {

void AssignmentToProto(const AssignmentCommand& a, v1::Assignment* as) {
  KeyToProto(a.ref, as->mutable_ref());
  if (a.job) PlannedJobToProto(*a.job, as->mutable_job());
  as->set_rendezvous_address(a.rendezvous_address);
  as->set_rendezvous_token(a.rendezvous_token);
  as->set_resume_step(a.resume_step);
  as->set_resume_path(a.resume_path);
  as->set_device_index(a.device_index);
  as->set_host_address(a.host_address);
}

void StopToProto(const StopCommand& s, v1::Stop* out) {
  out->set_job_id(s.job_id);
  out->set_attempt(s.attempt);
  out->set_reason(s.reason);
  out->set_grace_period_ms(static_cast<int32_t>(s.grace_period_ms));
}

}  // namespace

void CommandToProto(const WorkerCommand& command, v1::CoordinatorMessage* out) {
  out->Clear();
  if (const auto* a = std::get_if<AssignmentCommand>(&command))
    AssignmentToProto(*a, out->mutable_assignment());
  else
    StopToProto(std::get<StopCommand>(command), out->mutable_stop());
}

}  // namespace spindle
