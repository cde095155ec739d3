// CpPlan -> spindle.v1.Plan (see plan_proto.h).
#include "coordinator/plan_proto.h"

#include "spindle/v1/job.pb.h"

namespace spindle {

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
    p->set_mode(l.mode == CpMode::kAll2All ? v1::CP_MODE_ALL2ALL : v1::CP_MODE_ALLGATHER);
    p->set_reason(l.reason);
    p->set_forced(l.forced);
  }
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
}

}  // namespace spindle
