#include "planner/planned_job.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace spindle {
namespace {

// `plan`'s layer reasons where it kept `before`'s mode: a decision carried over keeps why it was
// made ("fastest by the cost model", the rule), not "forced by the spec".
void KeepReasons(const CpPlan& before, CpPlan* plan) {
  for (LayerModePlan& l : plan->layers)
    for (const LayerModePlan& b : before.layers)
      if (b.layer_type == l.layer_type && b.mode == l.mode) {
        l.reason = b.reason;
        l.forced = b.forced;
      }
}

PlannedJob Decided(const PlannedJob& job, const JobSpec& spec, CpPlan plan) {
  PlannedJob out;
  out.requested_json = job.requested_json;
  KeepReasons(job.plan, &plan);
  out.spec = PlannedSpec(spec, plan);
  out.plan = std::move(plan);
  return out;
}

}  // namespace

PlannedJob PlanJob(const JobSpec& requested, int64_t device_memory_bytes,
                   const Topology* topology) {
  PlannedJob job;
  job.requested_json = requested.ToJson().dump();
  job.plan = CpPlanner().Plan(requested, device_memory_bytes, topology);
  job.spec = PlannedSpec(requested, job.plan);
  return job;
}

PlannedJob PlannedJobOfOlderRecord(const JobSpec& requested, const absl::StatusOr<CpPlan>& stored) {
  if (stored.ok() && stored->ok() && !stored->layers.empty()) {
    PlannedJob kept;
    kept.requested_json = requested.ToJson().dump();
    kept.spec = PlannedSpec(requested, *stored);
    // The stored decisions, checked as the planner checks a spec that forces them.
    CpPlan again = CpPlanner().Plan(kept.spec, stored->memory.device_memory_bytes);
    if (IsPlanned(kept.spec) && again.ok()) {
      kept.plan = *stored;
      return kept;
    }
  }
  JobSpec s = requested;
  if (stored.ok() && s.train.recompute_layers == TrainSpec::kRecomputeAuto)
    s.train.recompute_layers = stored->memory.recompute_layers;
  PlannedJob p = PlanJob(s, 0);
  p.requested_json = requested.ToJson().dump();
  return p;
}

PlannedJob Replan(const PlannedJob& job, ReplanCause cause, int64_t device_memory_bytes,
                  const Topology* topology, std::string* change) {
  change->clear();
  absl::StatusOr<JobSpec> requested = ParseJobSpec(job.requested_json);
  if (!requested.ok()) return job;
  const CpPlanner planner;
  const int64_t n = job.spec.model.n_layers;
  PlannedJob next;
  if (cause == ReplanCause::kOutOfMemory) {
    const int64_t now = job.spec.train.recompute_layers;
    if (requested->train.recompute_layers != TrainSpec::kRecomputeAuto || now >= n) return job;
    // Half of the layers still keeping their activations start recomputing (at least two: one
    // alone saves nothing, the shared cache being as large as a layer's).
    JobSpec s = job.spec;
    s.train.recompute_layers = std::min(n, now + std::max<int64_t>(2, (n - now + 1) / 2));
    next = Decided(job, s, planner.Plan(s, device_memory_bytes, topology));
    *change = absl::StrCat("train.recompute \"auto\": ", s.train.recompute_layers, " of ", n,
                           " layers recompute from now on");
    return next;
  }
  if (device_memory_bytes <= 0) return job;
  // Placement. Decided without a device: those decisions are taken for this one.
  JobSpec s = job.spec;
  if (job.plan.memory.device_memory_bytes <= 0) {
    if (requested->train.recompute_layers == TrainSpec::kRecomputeAuto)
      s.train.recompute_layers = TrainSpec::kRecomputeAuto;
    if (requested->model.moe.experts > 0 && requested->parallel.ep == 0) s.parallel.ep = 0;
  }
  CpPlan plan = planner.Plan(s, device_memory_bytes, topology);
  if (!plan.ok()) {
    // The kept decisions do not run on these devices: every open one is taken again.
    s = *requested;
    plan = planner.Plan(s, device_memory_bytes, topology);
    if (!plan.ok()) return job;  // the placement's own checks refuse the devices
  }
  next = Decided(job, s, std::move(plan));
  const std::string what = DescribeDecisionChange(job.spec, next.spec);
  if (what.empty()) return job;
  *change = absl::StrCat("re-planned for the placement's devices (",
                         FormatBytes(device_memory_bytes), " each): ", what);
  return next;
}

std::string DescribeDecisionChange(const JobSpec& before, const JobSpec& after) {
  std::vector<std::string> parts;
  const ParallelSpec &a = before.parallel, &b = after.parallel;
  if (a.cp != b.cp || a.dp != b.dp)
    parts.push_back(absl::StrCat("cp x dp ", a.cp, " x ", a.dp, " -> ", b.cp, " x ", b.dp));
  if (a.lightning_mode != b.lightning_mode)
    parts.push_back(absl::StrCat("lightning mode ", std::string(CpModeName(a.lightning_mode)), " -> ",
                                 std::string(CpModeName(b.lightning_mode))));
  if (a.mla_mode != b.mla_mode)
    parts.push_back(absl::StrCat("mla mode ", std::string(CpModeName(a.mla_mode)), " -> ",
                                 std::string(CpModeName(b.mla_mode))));
  if (a.ulysses != b.ulysses)
    parts.push_back(absl::StrCat("parallel.ulysses ", a.ulysses, " -> ", b.ulysses));
  if (a.ep != b.ep) parts.push_back(absl::StrCat("parallel.ep ", a.ep, " -> ", b.ep));
  if (before.train.recompute_layers != after.train.recompute_layers)
    parts.push_back(absl::StrCat("train.recompute ", before.train.recompute_layers, " -> ",
                                 after.train.recompute_layers, " of ", after.model.n_layers,
                                 " layers"));
  return absl::StrJoin(parts, ", ");
}

}  // namespace spindle
