// JobView -> spindle.v1.Job (see job_proto.h).
#include "coordinator/job_proto.h"

#include "planner/plan_proto.h"
#include "spindle/v1/job.pb.h"

namespace spindle {

void EventToProto(const EventRecord& e, v1::JobEvent* out) {
  out->set_unix_ms(e.unix_ms);
  out->set_attempt(e.attempt);
  out->set_state(static_cast<v1::JobState>(e.state));
  out->set_message(e.message);
}

namespace {

void MoeToProto(const MoeSummary& m, v1::MoeStatus* out) {
  out->set_load_max_over_mean(m.load_max_over_mean);
  out->set_bias_min(m.bias_min);
  out->set_bias_max(m.bias_max);
  out->set_router_z_loss(m.router_z_loss);
  out->set_dispatch_bytes(m.dispatch_bytes);
  out->set_dispatch_s(m.dispatch_s);
}

}  // namespace

void JobViewToProto(const JobView& v, v1::Job* out) {
  out->Clear();
  const JobRecord& r = v.record;
  out->set_job_id(r.job_id);
  out->set_name(r.name);
  out->set_state(static_cast<v1::JobState>(r.state));
  out->set_priority(r.priority);
  out->set_spec_json(r.spec_json);
  out->set_submitted_unix_ms(r.submitted_ms);
  out->set_updated_unix_ms(r.updated_ms);
  out->set_attempt(r.attempt);
  out->set_restarts(r.restarts);
  out->set_max_restarts(r.max_restarts);
  out->set_message(r.message);
  out->set_owner(r.owner);
  PlanToProto(v.plan, out->mutable_plan());
  out->set_last_checkpoint_step(r.last_checkpoint_step);
  out->set_last_checkpoint_path(r.last_checkpoint_path);
  out->set_total_steps(v.total_steps);
  for (const RankView& rv : v.ranks) {
    v1::RankStatus* s = out->add_ranks();
    s->set_rank(rv.placement.rank);
    s->set_worker_id(rv.placement.worker_id);
    s->set_device_index(rv.placement.device_index);
    s->set_step(rv.step);
    s->set_loss(rv.loss);
    s->set_tokens_per_s(rv.tokens_per_s);
    s->set_lr(rv.lr);
    s->set_grad_norm(rv.grad_norm);
    s->set_elapsed_s(rv.elapsed_s);
    s->set_mfu(rv.mfu);
    s->set_memory_bytes(rv.memory_bytes);
    if (rv.moe.present) MoeToProto(rv.moe, s->mutable_moe());
    s->set_state(rv.state);
    s->set_exit_code(rv.exit_code);
    s->set_last_report_unix_ms(rv.last_report_unix_ms);
  }
  out->set_step(v.step);
  out->set_loss(v.loss);
  out->set_tokens_per_s(v.tokens_per_s);
  out->set_mfu(v.mfu);
  if (v.moe.present) MoeToProto(v.moe, out->mutable_moe());
  out->set_eta_s(v.eta_s);
  out->set_goodput(v.goodput);
  for (const EventRecord& e : v.events) EventToProto(e, out->add_events());
  out->set_next_events_page_token(v.next_events_page_token);
}

}  // namespace spindle
