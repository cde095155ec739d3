// JobAdmission: how a job enters the coordinator. A submit is parsed and checked (absolute paths,
// the client's request id), planned once against the registered workers (PlanJobLocked: a
// PlannedJob, planner/planned_job.h, with every decision in its spec), refused when the plan has
// problems, when no registered workers could ever hold it (CheckCanEverFitLocked), when no worker
// of its kind lets it write its checkpoint directory or read its data (CheckPathsAcceptedLocked,
// against the roots the workers reported), or when an unfinished job uses its checkpoint
// directory or one nested with it (CheckCheckpointDirFreeLocked), then stored QUEUED with its
// first event and its PlannedJob (AdoptPlan). A request id makes a submit idempotent: the job it
// created is returned again. PlanSpec answers what Submit would, storing nothing. Admission places
// nothing: the JobManager runs a scheduling pass (job_placement.h) after a job is created.
//
// Thread-safety: thread-compatible; functions taking a JobTable require its mutex (job_table.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "coordinator/clock.h"
#include "coordinator/job_store.h"
#include "coordinator/job_table.h"
#include "planner/cp_cost_model.h"
#include "planner/cp_planner.h"
#include "planner/planned_job.h"

namespace spindle {

class Counter;

// A submit as checked before the table is locked (ParseSubmit).
struct SubmitRequest {
  JobSpec spec;
  std::string canonical_spec;    // spec.ToJson().dump(): what the job record stores
  std::string checkpoint_place;  // SamePlace(spec.checkpoint.dir); "" for none
  std::string request_id;        // "": none
  std::string owner;             // "": users are not named
};

// What Submit did: created a job, or found the one a request id created earlier.
struct SubmitResult {
  std::string job_id;
  bool created = false;
};

class JobAdmission {
 public:
  // A request id is 1 to this many characters of [A-Za-z0-9._:-] ("" none).
  static constexpr size_t kMaxRequestIdLength = 128;

  // `store`, `clock` and `planner` are not owned and must outlive it; `jobs_submitted` may be
  // null.
  JobAdmission(JobStore* store, const Clock* clock, const CpPlanner* planner,
               Counter* jobs_submitted)
      : store_(store), clock_(clock), planner_(planner), jobs_submitted_(jobs_submitted) {}

  // Parses and checks a submit without the table (it reads the filesystem to resolve the
  // checkpoint directory). InvalidArgument for a bad request id, a bad spec or a relative path.
  static absl::StatusOr<SubmitRequest> ParseSubmit(const std::string& spec_json,
                                                   const std::string& request_id,
                                                   const std::string& owner);
  // Plans and stores the job, QUEUED (JobManager::Submit's contract). A request id seen before
  // returns its job (created false, `plan_out` its stored plan) without checking anything again,
  // or AlreadyExists when the spec differs or the job has another owner. FailedPrecondition "job
  // cannot run: ..." for plan problems, a job that can never fit, or a checkpoint directory in use.
  // `plan_out` may be null.
  absl::StatusOr<SubmitResult> Submit(JobTable& t, const SubmitRequest& req, CpPlan* plan_out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The plan Submit would make, with what else Submit would refuse among its problems.
  void PlanSpec(const JobTable& t, const JobSpec& spec, CpPlan* plan_out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  // The job planned against the largest registered device of its kind (the plan of its
  // PlannedJob: PlanLocked).
  PlannedJob PlanJobLocked(const JobTable& t, const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  CpPlan PlanLocked(const JobTable& t, const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // The smallest device of a gang's workers (0 when one is not registered).
  static int64_t SmallestDeviceMemory(const JobTable& t, const std::vector<RankPlacement>& ranks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // What the cost model estimates with: the rates of the worker plans are sized to (built-in
  // ones when it measured none), its link when the gang fits on it (at the rates the worker
  // measured for a "loopback" or "same-device" link, the basis then saying "measured"; nominal
  // ones otherwise), else the network.
  Topology TopologyLocked(const JobTable& t, const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // Takes a planned job: the spec the ranks run, the memory per rank the scheduler places by.
  static void AdoptPlan(JobRuntime& j, std::shared_ptr<const PlannedJob> planned);
  // Submit's admission check (CheckCanEverFit) of a planned job against the registered workers.
  absl::Status CheckCanEverFitLocked(const JobTable& t, const std::string& kind, int64_t world,
                                     const CpPlan& plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // FailedPrecondition naming the unfinished job whose checkpoint.dir is spec's, or contains it,
  // or lies inside it.
  absl::Status CheckCheckpointDirFreeLocked(const JobTable& t, const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);
  // FailedPrecondition when workers of the spec's kind are registered but none lets it write its
  // checkpoint.dir and read its data file (by the paths' text against the --checkpoint_root and
  // --data_root each reported: common/path_rules.h), naming the roots. OK when no worker of the
  // kind is registered or one reported no roots (an older daemon): the worker checks again.
  absl::Status CheckPathsAcceptedLocked(const JobTable& t, const JobSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

  // A checkpoint directory as a comparable path ("/a/b/" and "/a//b" are "/a/b"; the symbolic
  // links among its existing parts, as the coordinator's host sees them, resolved).
  static std::string SamePlace(const std::string& dir);

 private:
  JobStore* const store_;
  const Clock* const clock_;
  const CpPlanner* const planner_;
  Counter* const jobs_submitted_;
};

}  // namespace spindle
