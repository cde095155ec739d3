// The job a spindle-train process runs (see trainer_job.h).
#include "worker/trainer_job.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/document_span.h"
#include "planner/plan_proto.h"
#include "spindle/v1/job.pb.h"
#include "worker/device_discovery.h"

namespace spindle {

absl::StatusOr<PlannedJob> ReadPlannedJob(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--planned-job: cannot read ", path));
  v1::PlannedJob p;
  if (!p.ParseFromIstream(&in))
    return absl::InvalidArgumentError(
        absl::StrCat("--planned-job: ", path, " is not a spindle.v1.PlannedJob"));
  return PlannedJobFromProto(p);
}

absl::StatusOr<PlannedJob> PlanStandalone(const JobSpec& spec) {
  int64_t memory = 0;
  if (spec.train.recompute_layers == TrainSpec::kRecomputeAuto) {
    if (spec.resources == "cuda") {
      if (auto g = DiscoverCudaDevices(); g.ok()) memory = g->memory_bytes();
    } else if (auto g =
                   DiscoverDevices(static_cast<int>(std::max<int64_t>(1, spec.parallel.world())));
               g.ok()) {
      memory = g->memory_bytes();
    }
  }
  PlannedJob job = PlanJob(WithDocumentSpan(spec), memory);
  if (!job.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("the job cannot run: ", absl::StrJoin(job.plan.problems, "; ")));
  return job;
}

}  // namespace spindle
