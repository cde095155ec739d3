// PlannedJob: a job with every decision made, carried whole from the planner to its ranks.
//
// PlanJob plans a spec as submitted once (CpPlanner::Plan) and writes every decision into the
// spec the ranks run (PlannedSpec: each layer type's mode, parallel.ulysses, parallel.ep,
// train.recompute as a number of layers). The coordinator does it at submit and stores the
// result; `spindle-train` run standalone does it before it starts. Nothing downstream decides
// again: a coordinator restart reads the stored PlannedJob, an Assignment carries it whole, and
// the trainer runs its spec as given.
//
// Replan is the one place a decision is taken again, for one of two causes:
//  - placement: the gang got devices of `device_memory_bytes` (the smallest of the gang). What
//    the submit-time plan decided for lack of a device (no worker of the kind was registered:
//    train.recompute "auto" at every layer, parallel.ep left open at its smallest) is decided for
//    these devices, keeping the modes. A job planned against a device keeps every decision while
//    its plan still runs on these devices; otherwise the spec as submitted is planned again.
//  - out of memory: a rank ran out of device memory. A spec whose train.recompute was "auto"
//    recomputes more layers from then on (half of those still keeping their activations, at
//    least two); any other job is kept as it is.
// Each says what changed in one line for the job's events ("" when nothing did).
//
// ReplanForWorld lays an elastic job (parallel.elastic) out at another world: the coordinator's
// resize when workers are lost or come back.
//
// Thread-safety: free functions without state.
#pragma once

#include <cstdint>
#include <string>

#include "common/job_spec.h"
#include "planner/cp_planner.h"

namespace spindle {

struct PlannedJob {
  // The spec as submitted, canonical JSON: what Replan may decide again (parsed only there).
  std::string requested_json;
  // Every decision in place (IsPlanned holds when plan.ok()): what each rank runs.
  JobSpec spec;
  // Why, and the estimates the decisions rest on.
  CpPlan plan;
  bool ok() const { return plan.ok(); }
};

// Plans `requested` against a device of `device_memory_bytes` (0: none known) and `topology`
// (null: the built-in one of its resources); see CpPlanner::Plan. The plan's problems, if any,
// are in the result (ok() false), its spec then is not to be run.
PlannedJob PlanJob(const JobSpec& requested, int64_t device_memory_bytes,
                   const Topology* topology = nullptr);

enum class ReplanCause { kPlacement, kOutOfMemory };

// See the file comment. `job` must be ok(). `*change` gets the event line ("" when nothing
// changed: the result is then `job` itself). A requested spec that no longer parses (a stored
// job of an older release) keeps `job`.
PlannedJob Replan(const PlannedJob& job, ReplanCause cause, int64_t device_memory_bytes,
                  const Topology* topology, std::string* change);

// `job` (ok(), its spec elastic) laid out at `world` ranks, planned against a device of
// `device_memory_bytes` (0: none known) and `topology`. The candidates are the (cp, dp) with
// cp x dp = world; the job's present cp is tried first, then the submitted cp, then the others
// from the largest cp down (a longer CP group holds less of a sequence a rank). Under
// parallel.elastic.batch "keep" micro_batches is set to keep the submitted tokens of a step
// (candidates whose dp does not divide dp x micro_batches as submitted are skipped); under
// "scale" it stays. Each candidate first keeps the present decisions that run there (forced
// modes, ulysses, ep, recompute; a mode the submitted spec left "auto" or "fastest" is decided
// for the layout, so a job back at a world runs as it ran there) and otherwise plans the submitted
// spec at that layout, where a forced mode, ulysses or ep that cannot run at it is left to the
// planner (the change says so). The first candidate
// that plans without problems is the result, `*change` its event line ("world 4 -> 2: cp x dp
// 4 x 1 -> 2 x 1; tokens per step kept at 2048 (parallel.elastic.batch \"keep\")").
// `world` equal to the present one gives `job` and "". None that runs: a result that is not
// ok(), its plan's problems naming the world and every candidate's first problem.
PlannedJob ReplanForWorld(const PlannedJob& job, int64_t world, int64_t device_memory_bytes,
                          const Topology* topology, std::string* change);

// A job an older release stored with only its plan (`stored`, the CpPlan made at its submit;
// `requested` the spec as submitted): that plan's decisions written into the spec when they make
// a planned spec that still plans, so that a restarted coordinator does not decide a "fastest"
// mode again on whatever cluster it now sees; otherwise the spec planned once more without a
// device, its "auto" recompute as the stored plan decided it.
PlannedJob PlannedJobOfOlderRecord(const JobSpec& requested, const absl::StatusOr<CpPlan>& stored);

// The decisions that differ between two planned specs of one job, e.g. "lightning mode
// all2all -> allgather, train.recompute 8 -> 3 of 8 layers"; "" when none does.
std::string DescribeDecisionChange(const JobSpec& before, const JobSpec& after);

}  // namespace spindle
