// CpPlan <-> spindle.v1.Plan (see plan_proto.h).
#include "planner/plan_proto.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spindle/v1/job.pb.h"

namespace spindle {

int CpModeToProto(CpMode m) {
  switch (m) {
    case CpMode::kAllGather:
      return v1::CP_MODE_ALLGATHER;
    case CpMode::kAll2All:
      return v1::CP_MODE_ALL2ALL;
    case CpMode::kRing:
      return v1::CP_MODE_RING;
    case CpMode::kHybrid:
      return v1::CP_MODE_HYBRID;
    case CpMode::kAuto:
    case CpMode::kFastest:
      break;
  }
  return v1::CP_MODE_UNSPECIFIED;
}

CpMode CpModeFromProto(int m) {
  switch (m) {
    case v1::CP_MODE_ALLGATHER:
      return CpMode::kAllGather;
    case v1::CP_MODE_ALL2ALL:
      return CpMode::kAll2All;
    case v1::CP_MODE_RING:
      return CpMode::kRing;
    case v1::CP_MODE_HYBRID:
      return CpMode::kHybrid;
    default:
      return CpMode::kAuto;
  }
}

void PlanToProto(const CpPlan& plan, v1::Plan* out) {
  out->Clear();
  out->set_cp(plan.cp);
  out->set_dp(plan.dp);
  out->set_world(plan.world);
  out->set_tokens_per_rank(plan.tokens_per_rank);
  for (const LayerModePlan& l : plan.layers) {
    v1::LayerPlan* p = out->add_layers();
    p->set_layer_type(l.layer_type);
    p->set_num_layers(l.num_layers);
    p->set_mode(static_cast<v1::CpMode>(CpModeToProto(l.mode)));
    p->set_reason(l.reason);
    p->set_forced(l.forced);
    p->set_comm_bytes_per_step(l.comm_bytes_per_step);
    p->set_ring_payload(l.ring_payload);
  }
  for (const ModeEstimate& e : plan.estimates) {
    v1::ModeEstimate* p = out->add_estimates();
    p->set_layer_type(e.layer_type);
    p->set_mode(static_cast<v1::CpMode>(CpModeToProto(e.cost.choice.mode)));
    p->set_ulysses(e.cost.choice.ulysses);
    p->set_compute_s(e.cost.compute_s);
    p->set_comm_s(e.cost.comm_s);
    p->set_exposed_s(e.cost.exposed_s);
    p->set_bytes(e.cost.bytes);
    p->set_memory_bytes(e.cost.memory_bytes);
    p->set_step_s(e.step_s);
    p->set_rule(e.rule);
    p->set_fastest(e.fastest);
    p->set_chosen(e.chosen);
  }
  out->set_step_s(plan.step_s);
  out->set_cost_basis(plan.cost_basis);
  v1::MemoryEstimate* m = out->mutable_memory();
  m->set_params_bytes(plan.memory.params_bytes);
  m->set_grads_bytes(plan.memory.grads_bytes);
  m->set_optimizer_bytes(plan.memory.optimizer_bytes);
  m->set_activations_bytes(plan.memory.activations_bytes);
  m->set_workspace_bytes(plan.memory.workspace_bytes);
  m->set_runtime_bytes(plan.memory.runtime_bytes);
  m->set_precision_bytes(plan.memory.precision_bytes);
  m->set_host_bytes(plan.memory.host_bytes);
  m->set_total_bytes(plan.memory.total_bytes);
  m->set_device_memory_bytes(plan.memory.device_memory_bytes);
  m->set_recompute(plan.memory.recompute_layers > 0);
  m->set_recompute_layers(plan.memory.recompute_layers);
  for (const std::string& p : plan.problems) out->add_problems(p);
  for (const std::string& w : plan.warnings) out->add_warnings(w);
  out->set_ok(plan.ok());
  out->set_max_seq_len(plan.max_seq_len);
  out->set_max_seq_len_offload(plan.max_seq_len_offload);
  out->set_ulysses(plan.ulysses);
  if (!plan.ep_estimates.empty()) {
    out->set_ep(plan.ep);
    out->set_ep_reason(plan.ep_reason);
  }
  for (const ExpertParallelEstimate& c : plan.ep_estimates) {
    v1::ExpertParallelEstimate* e = out->add_ep_estimates();
    e->set_ep(c.ep);
    e->set_memory_bytes(c.memory_bytes);
    e->set_dispatch_bytes(c.dispatch_bytes);
    e->set_dispatch_s(c.dispatch_s);
    e->set_fits(c.fits);
    e->set_chosen(c.chosen);
  }
}

void PlanFromProto(const v1::Plan& p, CpPlan* out) {
  *out = CpPlan{};
  out->cp = p.cp();
  out->dp = p.dp();
  out->world = p.world();
  out->tokens_per_rank = p.tokens_per_rank();
  for (const v1::LayerPlan& l : p.layers()) {
    LayerModePlan& lp = out->layers.emplace_back();
    lp.layer_type = l.layer_type();
    lp.num_layers = l.num_layers();
    lp.mode = CpModeFromProto(l.mode());
    lp.reason = l.reason();
    lp.forced = l.forced();
    lp.comm_bytes_per_step = l.comm_bytes_per_step();
    lp.ring_payload = l.ring_payload();
  }
  out->ulysses = p.ulysses();
  out->ep = std::max<int64_t>(1, p.ep());
  out->ep_reason = p.ep_reason();
  for (const v1::ExpertParallelEstimate& e : p.ep_estimates())
    out->ep_estimates.push_back(
        {e.ep(), e.memory_bytes(), e.dispatch_bytes(), e.dispatch_s(), e.fits(), e.chosen()});
  for (const v1::ModeEstimate& e : p.estimates()) {
    ModeEstimate m;
    m.layer_type = e.layer_type();
    m.cost.choice = {CpModeFromProto(e.mode()), e.ulysses()};
    m.cost.compute_s = e.compute_s();
    m.cost.comm_s = e.comm_s();
    m.cost.exposed_s = e.exposed_s();
    m.cost.bytes = e.bytes();
    m.cost.memory_bytes = e.memory_bytes();
    m.step_s = e.step_s();
    m.rule = e.rule();
    m.fastest = e.fastest();
    m.chosen = e.chosen();
    out->estimates.push_back(std::move(m));
  }
  out->step_s = p.step_s();
  out->cost_basis = p.cost_basis();
  const v1::MemoryEstimate& m = p.memory();
  MemoryEstimate& e = out->memory;
  e.params_bytes = m.params_bytes();
  e.grads_bytes = m.grads_bytes();
  e.optimizer_bytes = m.optimizer_bytes();
  e.activations_bytes = m.activations_bytes();
  e.workspace_bytes = m.workspace_bytes();
  e.runtime_bytes = m.runtime_bytes();
  e.host_bytes = m.host_bytes();
  e.precision_bytes = m.precision_bytes();
  e.total_bytes = m.total_bytes();
  e.device_memory_bytes = m.device_memory_bytes();
  e.recompute_layers = m.recompute_layers();
  out->problems.assign(p.problems().begin(), p.problems().end());
  out->warnings.assign(p.warnings().begin(), p.warnings().end());
  out->max_seq_len = p.max_seq_len();
  out->max_seq_len_offload = p.max_seq_len_offload();
}

std::string EncodePlan(const CpPlan& plan) {
  v1::Plan p;
  PlanToProto(plan, &p);
  return p.SerializeAsString();
}

absl::StatusOr<CpPlan> DecodePlan(const std::string& bytes) {
  v1::Plan p;
  if (!p.ParseFromString(bytes)) return absl::DataLossError("stored plan does not parse");
  CpPlan plan;
  PlanFromProto(p, &plan);
  return plan;
}

void PlannedJobToProto(const PlannedJob& job, v1::PlannedJob* out) {
  out->set_requested_spec_json(job.requested_json);
  out->set_spec_json(job.spec.ToJson().dump());
  PlanToProto(job.plan, out->mutable_plan());
}

absl::StatusOr<PlannedJob> PlannedJobFromProto(const v1::PlannedJob& p) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(p.spec_json());
  if (!spec.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("planned job: its spec does not parse: ", spec.status().message()));
  if (!IsPlanned(*spec))
    return absl::InvalidArgumentError(
        "planned job: its spec leaves a decision open (an \"auto\" or \"fastest\" mode at "
        "cp > 1, an \"auto\" recompute, or an undecided parallel.ep); a planned spec is run as "
        "given");
  PlannedJob job;
  job.requested_json = p.requested_spec_json();
  job.spec = *std::move(spec);
  PlanFromProto(p.plan(), &job.plan);
  return job;
}

std::string EncodePlannedJob(const PlannedJob& job) {
  v1::PlannedJob p;
  PlannedJobToProto(job, &p);
  return p.SerializeAsString();
}

absl::StatusOr<PlannedJob> DecodePlannedJob(const std::string& bytes) {
  v1::PlannedJob p;
  if (!p.ParseFromString(bytes) || p.spec_json().empty())
    return absl::DataLossError("stored planned job does not parse");
  return PlannedJobFromProto(p);
}

}  // namespace spindle
