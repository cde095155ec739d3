#include "planner/planned_job.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cp_modes.h"

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

namespace {

// `s` at cp x dp = `cp` x `dp` with what the submitted spec forced but cannot run there left to
// the planner; each such release is appended to `released`.
JobSpec AtLayout(JobSpec s, int64_t cp, int64_t dp, std::vector<std::string>* released) {
  ParallelSpec& p = s.parallel;
  p.cp = cp;
  p.dp = dp;
  const int64_t heads = s.model.n_heads;
  const bool hybrid = p.lightning_mode == CpMode::kHybrid || p.mla_mode == CpMode::kHybrid;
  if (hybrid && !CheckCpModes(p, heads).ok()) {
    released->push_back(absl::StrCat("parallel.ulysses ", p.ulysses,
                                     " with the \"hybrid\" modes does not split cp ", cp,
                                     ": modes left to the planner"));
    if (p.lightning_mode == CpMode::kHybrid) p.lightning_mode = CpMode::kAuto;
    if (p.mla_mode == CpMode::kHybrid) p.mla_mode = CpMode::kAuto;
    p.ulysses = 1;
  }
  for (CpMode* m : {&p.lightning_mode, &p.mla_mode}) {
    if (*m == CpMode::kAll2All && !All2AllSplits(heads, cp)) {
      released->push_back(absl::StrCat("all2all does not split ", heads, " heads over cp ", cp,
                                       ": that mode left to the planner"));
      *m = CpMode::kAuto;
    }
  }
  if (p.ep > 0 && ((p.world() % p.ep) != 0)) {
    released->push_back(absl::StrCat("parallel.ep ", p.ep, " does not divide world ", p.world(),
                                     ": left to the planner"));
    p.ep = 0;
  }
  return s;
}

}  // namespace

PlannedJob ReplanForWorld(const PlannedJob& job, int64_t world, int64_t device_memory_bytes,
                          const Topology* topology, std::string* change) {
  change->clear();
  const ParallelSpec& now = job.spec.parallel;
  if (world == now.world()) return job;
  PlannedJob none = job;
  none.plan.problems.clear();
  absl::StatusOr<JobSpec> requested = ParseJobSpec(job.requested_json);
  if (!requested.ok()) {
    none.plan.problems.push_back(
        absl::StrCat("cannot re-plan at world ", world, ": ", requested.status().message()));
    return none;
  }
  const ParallelSpec& sub = requested->parallel;
  const bool keep = sub.elastic.batch == ElasticSpec::Batch::kKeep;
  const int64_t sequences = sub.dp * requested->train.micro_batches;  // a step's, as submitted
  std::vector<int64_t> cps = {now.cp, sub.cp};
  for (int64_t cp = world; cp >= 1; --cp) cps.push_back(cp);
  std::vector<int64_t> tried;
  std::vector<std::string> why_not;
  const CpPlanner planner;
  for (const int64_t cp : cps) {
    if (world % cp != 0 || std::find(tried.begin(), tried.end(), cp) != tried.end()) continue;
    tried.push_back(cp);
    const int64_t dp = world / cp;
    if (keep && sequences % dp != 0) {
      why_not.push_back(absl::StrCat("cp x dp ", cp, " x ", dp, ": dp ", dp,
                                     " does not divide the ", sequences,
                                     " sequences of a step (parallel.elastic.batch \"keep\")"));
      continue;
    }
    const int64_t mb = keep ? sequences / dp : requested->train.micro_batches;
    std::vector<std::string> released;
    // The present decisions where they still run, else the submitted spec planned afresh. A mode
    // the submitted spec left to the rule or the cost model ("auto", "fastest") is a function of
    // the layout: decided for this one, so that back at a world the job ran at it runs as there.
    JobSpec kept = AtLayout(job.spec, cp, dp, &released);
    kept.train.micro_batches = mb;
    for (auto [now_mode, asked] :
         {std::pair<CpMode*, CpMode>{&kept.parallel.lightning_mode, sub.lightning_mode},
          std::pair<CpMode*, CpMode>{&kept.parallel.mla_mode, sub.mla_mode}})
      if (asked == CpMode::kAuto || asked == CpMode::kFastest) *now_mode = asked;
    CpPlan plan;
    JobSpec s = kept;
    if (released.empty()) plan = planner.Plan(s, device_memory_bytes, topology);
    if (!released.empty() || !plan.ok()) {
      released.clear();
      s = AtLayout(*requested, cp, dp, &released);
      s.train.micro_batches = mb;
      plan = planner.Plan(s, device_memory_bytes, topology);
    }
    if (!plan.ok()) {
      why_not.push_back(absl::StrCat("cp x dp ", cp, " x ", dp, ": ", plan.problems.front()));
      continue;
    }
    PlannedJob next = Decided(job, s, std::move(plan));
    const int64_t tokens_before = now.dp * job.spec.train.micro_batches * job.spec.seq_len;
    const int64_t tokens_after = dp * mb * next.spec.seq_len;
    *change = absl::StrCat(
        "world ", now.world(), " -> ", world, ": ", DescribeDecisionChange(job.spec, next.spec),
        released.empty() ? "" : absl::StrCat(" (", absl::StrJoin(released, "; "), ")"), "; ",
        tokens_before == tokens_after
            ? absl::StrCat("tokens per step kept at ", tokens_after)
            : absl::StrCat("tokens per step ", tokens_before, " -> ", tokens_after),
        " (parallel.elastic.batch \"", std::string(ElasticBatchName(sub.elastic.batch)), "\")");
    return next;
  }
  none.plan.problems.push_back(
      absl::StrCat("no layout of world ", world, " runs: ", absl::StrJoin(why_not, "; ")));
  return none;
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
  if (before.train.micro_batches != after.train.micro_batches)
    parts.push_back(absl::StrCat("train.micro_batches ", before.train.micro_batches, " -> ",
                                 after.train.micro_batches));
  if (before.train.recompute_layers != after.train.recompute_layers)
    parts.push_back(absl::StrCat("train.recompute ", before.train.recompute_layers, " -> ",
                                 after.train.recompute_layers, " of ", after.model.n_layers,
                                 " layers"));
  return absl::StrJoin(parts, ", ");
}

}  // namespace spindle
