// Admission of submitted jobs: checks, planning at submit, idempotency and the checkpoint
// directory rule (see job_admission.h).
#include "coordinator/job_admission.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/metrics.h"
#include "common/path_rules.h"
#include "common/status.h"
#include "coordinator/scheduler.h"
#include "planner/plan_proto.h"

namespace spindle {
namespace {

// Trainers run in their workers' own directories, so a relative path would name a different
// place for every rank and attempt (and a restart would not find its checkpoint).
absl::Status CheckAbsolutePaths(const JobSpec& spec) {
  auto relative = [](const std::string& p) { return !p.empty() && p[0] != '/'; };
  if (relative(spec.checkpoint.dir))
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: checkpoint.dir: must be an absolute path (`spindle submit` makes relative "
        "paths absolute), got \"",
        spec.checkpoint.dir, "\""));
  if (spec.data.kind != DataKind::kSynthetic && relative(spec.data.path))
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: data.source: the file must be an absolute path (`spindle submit` makes "
        "relative paths absolute), got \"",
        spec.data.source, "\""));
  return absl::OkStatus();
}

// A request id is 1 to JobAdmission::kMaxRequestIdLength characters of [A-Za-z0-9._:-] ("" none).
absl::Status CheckRequestId(const std::string& id) {
  const bool ok_chars = std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
           c == '-';
  });
  if (id.size() <= JobAdmission::kMaxRequestIdLength && ok_chars) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("submit: request_id must be at most ", JobAdmission::kMaxRequestIdLength,
                   " characters of [A-Za-z0-9._:-], got ", id.size(), " characters",
                   ok_chars ? "" : " including others"));
}

}  // namespace

std::string JobAdmission::SamePlace(const std::string& dir) {
  std::error_code ec;
  std::filesystem::path resolved = std::filesystem::weakly_canonical(dir, ec);
  if (ec) resolved = dir;
  std::string p = resolved.lexically_normal().string();
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

absl::StatusOr<SubmitRequest> JobAdmission::ParseSubmit(const std::string& spec_json,
                                                        const std::string& request_id,
                                                        const std::string& owner) {
  RETURN_IF_ERROR(CheckRequestId(request_id));
  SubmitRequest req;
  ASSIGN_OR_RETURN(req.spec, ParseJobSpec(spec_json));
  RETURN_IF_ERROR(CheckAbsolutePaths(req.spec));
  req.canonical_spec = req.spec.ToJson().dump();
  req.checkpoint_place = req.spec.checkpoint.dir.empty() ? "" : SamePlace(req.spec.checkpoint.dir);
  req.request_id = request_id;
  req.owner = owner;
  return req;
}

PlannedJob JobAdmission::PlanJobLocked(const JobTable& t, const JobSpec& spec) const {
  const Topology topo = TopologyLocked(t, spec);
  return PlanJob(spec, t.registry.LargestDeviceMemory(spec.resources), &topo);
}

CpPlan JobAdmission::PlanLocked(const JobTable& t, const JobSpec& spec) const {
  const Topology topo = TopologyLocked(t, spec);
  return planner_->Plan(spec, t.registry.LargestDeviceMemory(spec.resources), &topo);
}

int64_t JobAdmission::SmallestDeviceMemory(const JobTable& t,
                                           const std::vector<RankPlacement>& ranks) {
  int64_t memory = 0;
  for (const RankPlacement& p : ranks) {
    const Worker* w = t.registry.Find(p.worker_id);
    if (w == nullptr) return 0;
    const int64_t m = w->devices.memory_bytes;
    memory = memory == 0 ? m : std::min(memory, m);
  }
  return memory;
}

absl::Status JobAdmission::CheckPathsAcceptedLocked(const JobTable& t, const JobSpec& spec) const {
  const std::string data = DataSourceFile(spec.data);
  if (spec.checkpoint.dir.empty() && data.empty()) return absl::OkStatus();
  std::vector<std::string> refusals;
  for (const auto& [id, w] : t.registry.workers()) {
    if (w->devices.kind != spec.resources || w->left) continue;
    if (w->checkpoint_root.empty() || w->data_root.empty()) return absl::OkStatus();
    const bool ckpt_ok =
        spec.checkpoint.dir.empty() || LexicallyWithin(spec.checkpoint.dir, w->checkpoint_root);
    const bool data_ok = data.empty() || LexicallyWithin(data, w->data_root);
    if (ckpt_ok && data_ok) return absl::OkStatus();
    if (refusals.size() < 4)
      refusals.push_back(absl::StrCat(
          id, " (", !ckpt_ok ? absl::StrCat("--checkpoint_root ", w->checkpoint_root) : "",
          !ckpt_ok && !data_ok ? ", " : "", !data_ok ? absl::StrCat("--data_root ", w->data_root) : "",
          ")"));
  }
  if (refusals.empty()) return absl::OkStatus();  // no worker of the kind: it checks at start
  std::vector<std::string> what;
  if (!spec.checkpoint.dir.empty()) what.push_back("checkpoint.dir " + spec.checkpoint.dir);
  if (!data.empty()) what.push_back("data.source file " + data);
  return absl::FailedPreconditionError(absl::StrCat(
      "job cannot run: no ", spec.resources, " worker lets it use ", absl::StrJoin(what, " and "),
      ": ", absl::StrJoin(refusals, ", "),
      refusals.size() == 4 ? ", ..." : "",
      "; put them under a worker's roots, or start workers with roots that hold them"));
}

Topology JobAdmission::TopologyLocked(const JobTable& t, const JobSpec& spec) const {
  Topology topo = DefaultTopology(spec.resources);
  const Worker* w = t.registry.LargestWorker(spec.resources);
  if (w == nullptr) return topo;
  const DeviceOffer& d = w->devices;
  const std::string threads =
      d.threads_per_rank > 0 ? absl::StrCat(", ", d.threads_per_rank, " threads a rank") : "";
  if (d.rates.known()) {
    topo.rates = d.rates;
    topo.basis = absl::StrCat("rates measured by worker ", w->rec.worker_id, " (", d.kind, " ",
                              d.name, threads, ")");
  } else {
    topo.basis = absl::StrCat(topo.basis.substr(0, topo.basis.find(',')), " (worker ",
                              w->rec.worker_id, " reported none)");
  }
  // The gang fits on that worker: its own link (at the rates it measured, where it measured
  // them); otherwise the ranks meet over the network.
  const int64_t world = spec.parallel.world();
  const bool own_link = world <= d.count;
  LinkClass link = topo.link;
  if (!own_link)
    link = LinkClass::kNetwork;
  else if (!d.link.empty())
    ParseLinkClass(d.link, &link);
  topo.link = link;
  topo.link_rates = DefaultLinkRates(link);
  const bool measured = own_link && d.link_rates.bytes_per_s > 0 &&
                        (link == LinkClass::kLoopback || link == LinkClass::kSameDevice);
  if (measured) topo.link_rates = d.link_rates;
  // CPU ranks of one host share its cores.
  const int64_t on_host = std::min<int64_t>(world, d.count);
  if (d.kind == "cpu" && d.cores > 0 && d.threads_per_rank > 0)
    topo.sharing = CoreSharing(on_host, d.threads_per_rank, d.cores, world);
  absl::StrAppend(
      &topo.basis, ", link ", LinkClassName(link),
      measured ? absl::StrFormat(" measured by worker %s (%.3g GB/s, %.0f us a message)",
                                 w->rec.worker_id, topo.link_rates.bytes_per_s / 1e9,
                                 topo.link_rates.latency_s * 1e6)
               : std::string(),
      topo.sharing > 1 ? absl::StrFormat(", %d ranks sharing %d cores", on_host, d.cores) : "");
  return topo;
}

absl::Status JobAdmission::CheckCanEverFitLocked(const JobTable& t, const std::string& kind,
                                                 int64_t world, const CpPlan& plan) const {
  SchedulableJob sj;
  sj.world = world;
  sj.kind = kind;
  sj.memory_bytes_per_rank = plan.memory.total_bytes;
  sj.host_bytes_per_rank = plan.memory.host_bytes;
  return CheckCanEverFit(sj, t.registry.Registered());
}

absl::Status JobAdmission::CheckCheckpointDirFreeLocked(const JobTable& t,
                                                        const JobSpec& spec) const {
  if (spec.checkpoint.dir.empty()) return absl::OkStatus();
  // Through the index: one path resolution per submit, not one per stored job. A directory
  // inside another's is refused like the same one: the outer job's pruning and `latest` would
  // see the inner job's checkpoints.
  const std::string place = SamePlace(spec.checkpoint.dir);
  for (const std::string& id : t.index.OverlappingCheckpointPlace(place)) {
    const JobRuntime* other = t.Find(id);
    if (other == nullptr || IsTerminal(other->rec.state)) continue;
    const std::string state(JobStateName(other->rec.state));
    if (other->checkpoint_place == place)
      return absl::FailedPreconditionError(absl::StrCat(
          "job cannot run: checkpoint.dir \"", spec.checkpoint.dir, "\" is in use by job ", id,
          " (", state, "); two jobs on one directory would resume from each other's checkpoints"));
    return absl::FailedPreconditionError(
        absl::StrCat("job cannot run: checkpoint.dir \"", spec.checkpoint.dir, "\" is ",
                     other->checkpoint_place.size() < place.size() ? "inside" : "around", " \"",
                     other->spec.checkpoint.dir, "\", the checkpoint.dir of job ", id, " (", state,
                     "); nested checkpoint directories would mix the two jobs' checkpoints"));
  }
  return absl::OkStatus();
}

namespace {

// The fewest ranks the job can run on: an elastic job's min_world, else its world.
int64_t FewestRanks(const JobSpec& spec) {
  return spec.parallel.elastic.enabled() ? spec.parallel.elastic.min_world : spec.parallel.world();
}

}  // namespace

void JobAdmission::PlanSpec(const JobTable& t, const JobSpec& spec, CpPlan* plan_out) const {
  CpPlan plan = PlanLocked(t, spec);
  // What submit would refuse besides an impossible plan.
  if (plan.ok()) {
    if (absl::Status fit = CheckCanEverFitLocked(t, spec.resources, FewestRanks(spec), plan);
        !fit.ok())
      plan.problems.emplace_back(fit.message());
  }
  if (absl::Status paths = CheckPathsAcceptedLocked(t, spec); !paths.ok())
    plan.problems.emplace_back(paths.message());
  if (absl::Status free = CheckCheckpointDirFreeLocked(t, spec); !free.ok())
    plan.problems.emplace_back(free.message());
  *plan_out = std::move(plan);
}

absl::StatusOr<SubmitResult> JobAdmission::Submit(JobTable& t, const SubmitRequest& req,
                                                  CpPlan* plan_out) {
  const JobSpec& spec = req.spec;
  const std::string& request_id = req.request_id;
  const std::string& owner = req.owner;
  // A retried submit (its first reply lost) gets the job its first attempt created.
  if (const std::string seen = t.index.ByRequestId(request_id);
      !request_id.empty() && !seen.empty()) {
    const JobRuntime* j = t.Find(seen);
    if (j != nullptr) {
      // Another user's job is not the retry's: it is neither returned nor reported as theirs.
      if (j->rec.owner != owner)
        return absl::AlreadyExistsError(
            absl::StrCat("submit: request id \"", request_id,
                         "\" was already used by another user; a new job needs a new request id"));
      if (j->rec.spec_json != req.canonical_spec)
        return absl::AlreadyExistsError(
            absl::StrCat("submit: request id \"", request_id, "\" was already used for job ", seen,
                         " with a different spec; a new job needs a new request id"));
      if (plan_out) *plan_out = j->planned ? j->planned->plan : CpPlan{};
      return SubmitResult{seen, false};
    }
  }
  auto planned = std::make_shared<const PlannedJob>(PlanJobLocked(t, spec));
  const CpPlan& plan = planned->plan;
  if (plan_out) *plan_out = plan;
  if (!plan.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("job cannot run: ", absl::StrJoin(plan.problems, "; ")));
  RETURN_IF_ERROR(CheckCanEverFitLocked(t, spec.resources, FewestRanks(spec), plan));
  RETURN_IF_ERROR(CheckPathsAcceptedLocked(t, spec));
  RETURN_IF_ERROR(CheckCheckpointDirFreeLocked(t, spec));

  auto j = std::make_unique<JobRuntime>();
  AdoptPlan(*j, planned);
  const int64_t now = clock_->NowMs();
  JobRecord& rec = j->rec;
  rec.name = spec.name;
  rec.state = JobState::kQueued;
  rec.priority = spec.priority;
  rec.spec_json = req.canonical_spec;
  rec.request_id = request_id;
  rec.owner = owner;
  rec.plan = EncodePlannedJob(*planned);
  rec.submitted_ms = rec.updated_ms = now;
  rec.max_restarts = spec.max_restarts;
  const int64_t world = spec.parallel.world();
  rec.message = absl::StrCat("waiting for ", world, " free ", spec.resources, " device",
                             world == 1 ? "" : "s");
  EventRecord ev{"", 0, now, JobState::kQueued,
                 owner.empty() ? "submitted" : absl::StrCat("submitted by ", owner)};
  RETURN_IF_ERROR(store_->CreateJob(&rec, ev));
  ev.job_id = rec.job_id;
  AddEvent(*j, ev);
  j->queued_since_ms = clock_->SteadyMs();
  t.Bump(*j);
  const std::string job_id = rec.job_id;
  j->checkpoint_place = req.checkpoint_place;
  t.index.Add(rec.seq, job_id, req.checkpoint_place, request_id);
  t.jobs[job_id] = std::move(j);
  if (jobs_submitted_) jobs_submitted_->Increment();
  return SubmitResult{job_id, true};
}

void JobAdmission::AdoptPlan(JobRuntime& j, std::shared_ptr<const PlannedJob> planned) {
  j.spec = planned->spec;
  j.memory_per_rank = planned->plan.memory.total_bytes;
  j.host_bytes_per_rank = planned->plan.memory.host_bytes;
  j.planned = std::move(planned);
}

}  // namespace spindle
