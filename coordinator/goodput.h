// GoodputLedger: a job's goodput, the fraction of its wall time spent on steps that count,
// computed from what its ranks already report. Pure logic on the times it is given (the
// coordinator's steady clock, in ms); plain data, guarded by the job table's lock like the rest of
// a JobRuntime.
//
// Definition. goodput = useful / wall, where
//  - wall is the time from the start of the job's first attempt the coordinator saw (its first
//    rank's start report) to now, or to the report of the job's final step once there is one;
//  - useful is the sum of the step times of the steps in the job's surviving history: the time
//    each of them took inside the trainer's step (the trainer's `elapsed_s`, the sum of its step
//    times since the process started, so start-up, rendezvous, checkpoint loads, checkpoint
//    snapshots and waits for checkpoint writes are excluded), for every step up to the newest
//    step reached, except steps that a restart threw away: when an attempt resumes from
//    checkpoint C, the steps after C that an earlier attempt trained are lost, and their time
//    counts no more (the new attempt's training of them counts instead).
//  Everything else is lost time: restart downtime (the dead rank's detection, the fence, the new
//  gang's placement and start), steps thrown away, and time outside steps.
//
// Inputs, all from rank 0's reports (the ranks step in lockstep, so rank 0's step times are the
// gang's): its start, its progress (step, elapsed_s of its attempt) and the checkpoints it reported
// committed (rank 0 reports a checkpoint only once it is on disk). The step an attempt resumed
// from is the one its progress reports name (a trainer that resumed from an in-memory replica,
// checkpoint.replicas, resumed from no committed checkpoint); when they name none it is taken as
// the newest committed checkpoint before the attempt's first reported step (the trainer resumes
// from the newest complete checkpoint; one that was committed but never reported is missed, which
// only undercounts). Reports may be coalesced: between two
// reported steps the useful time is taken as evenly spread. A coordinator that restarts starts
// a job's ledger afresh from the first report it gets: its wall time then starts where that
// process's steps began, and the steps of earlier attempts are not known.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace spindle {

class GoodputLedger {
 public:
  // A rank of `attempt` started at now_ms.
  void OnStart(int64_t attempt, int64_t now_ms);
  // Rank 0 of `attempt` reported `step` (of total_steps) after `elapsed_s` seconds of steps in
  // this attempt. Reports of an older attempt than the newest seen are ignored, and so are
  // reports whose elapsed_s no trainer sends (negative, NaN, infinite or above kMaxElapsedS).
  // `resumed_from` > 0: the step the attempt says it resumed from (an in-memory replica's, which
  // is no committed checkpoint), taken instead of the inferred one for a new attempt; a step the
  // job never reached counts as the newest it did.
  void OnProgress(int64_t attempt, int64_t step, double elapsed_s, int64_t total_steps,
                  int64_t now_ms, int64_t resumed_from = 0);
  // The checkpoint of `step` is committed (on disk).
  void OnCheckpoint(int64_t step);

  // useful / wall at now_ms, in [0, 1]; nullopt before the first step is reported.
  std::optional<double> Goodput(int64_t now_ms) const;
  // The parts, for tests and the CLI: the useful seconds and the wall seconds at now_ms.
  double UsefulSeconds() const { return points_.back().second; }
  double WallSeconds(int64_t now_ms) const;

 private:
  // The useful seconds of the surviving history up to `step` (interpolated between reports).
  double UsefulAt(int64_t step) const;

  int64_t start_ms_ = -1;   // -1: not started
  int64_t end_ms_ = -1;     // the report of the final step; -1: not yet
  int64_t attempt_ = -1;    // the attempt of the newest progress report
  double base_useful_ = 0;  // the useful seconds at the step the attempt resumed from
  // (step, cumulative useful seconds) of the surviving history, steps increasing; starts (0, 0).
  std::vector<std::pair<int64_t, double>> points_{{0, 0.0}};
  std::set<int64_t> checkpoints_;  // committed steps (the newest kMaxCheckpoints)
  static constexpr size_t kMaxCheckpoints = 64;
  static constexpr double kMaxElapsedS = 1e9;  // about 32 years of steps
  static constexpr size_t kMaxPoints = 4096;
};

}  // namespace spindle
