// The job a spindle-train process runs, read or planned once: the coordinator's PlannedJob as the
// worker daemon wrote it (--planned-job), or a spec run standalone (--job), planned here as the
// coordinator plans the jobs it runs. Either way the trainer takes the result's spec as it is.
//
// Thread-safety: free functions; they read files and the devices, and keep nothing.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "planner/planned_job.h"

namespace spindle {

// --planned-job FILE: a serialized spindle.v1.PlannedJob; its spec is parsed here, the one time
// this process parses it. NotFound for a file it cannot read, InvalidArgument for one that is not
// a PlannedJob or whose spec is not planned (PlannedJobFromProto).
absl::StatusOr<PlannedJob> ReadPlannedJob(const std::string& path);

// A spec run standalone, planned once: against this machine's device (the GPU's memory, or host
// memory shared by the world's ranks) when recompute is "auto", with the cost model's built-in
// rates, and with the documents of its data file measured (common/document_span.h) when the spec
// leaves them out. FailedPrecondition "the job cannot run: ..." for a plan with problems.
absl::StatusOr<PlannedJob> PlanStandalone(const JobSpec& spec);

}  // namespace spindle
