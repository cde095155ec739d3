// JobPlacement on its own (tests/control/job_parts.h): a scheduling pass places a queued gang as
// the job's next attempt (stored first, slots taken, a rendezvous scope, one assignment per rank
// carrying the plan's decisions), places nothing when the store refuses or no device is free,
// fails a gang its ranks could not reach, waits for the previous attempt's ranks to be gone
// (fencing), and takes the recompute decisions made at placement and after running out of memory.
#include <set>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "coordinator/job_placement.h"
#include "gtest/gtest.h"
#include "planner/plan_proto.h"
#include "tests/control/job_parts.h"

namespace spindle {
namespace {

using testing::TinyJob;

class JobPlacementTest : public testing::JobPartsTest {};

TEST_F(JobPlacementTest, APlacedGangIsStoredThenAssignedRankByRank) {
  AddWorker("w1", 1, "198.18.0.11");
  AddWorker("w2", 1, "198.18.0.12");
  JobRuntime& j = SubmitAndPlace(TinyJob(2));
  EXPECT_EQ(j.rec.attempt, 1);
  EXPECT_EQ(j.rec.message, "attempt 1 placed on w1 (1 rank), w2 (1 rank)");
  // Stored with its attempt before anything was sent.
  absl::StatusOr<AttemptRecord> stored = store.LoadAttempt(j.rec.job_id, 1);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->ranks.size(), 2u);
  EXPECT_EQ(stored->rendezvous_token, j.token);
  EXPECT_EQ(j.token.size(), 32u);
  EXPECT_EQ(rendezvous.NumOpen(), 1u);

  auto as = Take<AssignmentCommand>();
  ASSERT_EQ(as.size(), 2u);
  for (int64_t r = 0; r < 2; ++r) {
    const auto& [worker, a] = as[r];
    const RankPlacement& p = j.ranks[r].placement;
    EXPECT_EQ(worker, p.worker_id);
    EXPECT_EQ(a.ref.job_id, j.rec.job_id);
    EXPECT_EQ(a.ref.attempt, 1);
    EXPECT_EQ(a.ref.rank, r);
    EXPECT_EQ(a.job, j.planned) << "the job as planned, whole";
    EXPECT_EQ(a.job->spec.parallel.world(), 2);
    EXPECT_EQ(a.job->spec.checkpoint.dir, "/tmp/ck");
    EXPECT_EQ(a.rendezvous_address, "198.18.0.1:7");
    EXPECT_EQ(a.rendezvous_token, j.token);
    EXPECT_EQ(a.host_address, table.registry.Find(p.worker_id)->address);
    EXPECT_EQ(table.registry.Find(p.worker_id)->slots[p.device_index].job_id, j.rec.job_id);
  }
  EXPECT_EQ((std::set<std::string>{as[0].second.host_address, as[1].second.host_address}),
            (std::set<std::string>{"198.18.0.11", "198.18.0.12"}));
  // A later checkpoint is where the next attempt's assignments resume from.
  j.rec.last_checkpoint_step = 5;
  j.rec.last_checkpoint_path = "/tmp/ck/step-5";
  const AssignmentCommand again = placement.MakeAssignment(table, j, j.ranks[1].placement);
  EXPECT_EQ(again.resume_step, 5);
  EXPECT_EQ(again.resume_path, "/tmp/ck/step-5");
}

TEST_F(JobPlacementTest, NothingIsPlacedWhenTheStoreRefusesOrNoDeviceIsFree) {
  AddWorker("w1", 1);
  const std::string id = Submit(TinyJob());
  store.refuse_writes = true;
  placement.Schedule(table, &out);
  EXPECT_EQ(Job(id).rec.state, JobState::kQueued);
  EXPECT_EQ(Job(id).rec.attempt, 0);
  EXPECT_TRUE(out.messages.empty());
  EXPECT_EQ(table.registry.DeviceCounts()["free"], 1);
  EXPECT_EQ(rendezvous.NumOpen(), 0u);

  store.refuse_writes = false;
  placement.Schedule(table, &out);
  EXPECT_EQ(Job(id).rec.state, JobState::kPlaced);
  const std::string waiting = Submit(TinyJob(1, 1, "/tmp/parts-b"));
  placement.Schedule(table, &out);
  EXPECT_EQ(Job(waiting).rec.state, JobState::kQueued);
  EXPECT_EQ(Take<AssignmentCommand>().size(), 1u);
}

TEST_F(JobPlacementTest, AGangAcrossALoopbackWorkerAndAnotherHostFails) {
  AddWorker("w1", 1, "127.0.0.1");
  AddWorker("w2", 1, "198.18.0.12");
  std::vector<RankPlacement> across = {{0, "w1", 0}, {1, "w2", 0}};
  const absl::Status st = placement.CheckReachable(table, across);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "cannot place the job across workers w1 and w2: w1's address 127.0.0.1 (it reaches "
            "the coordinator over loopback) cannot be reached from w2 at 198.18.0.12; start w1 "
            "with --advertise-host=<an address the other hosts reach>, or connect it to the "
            "coordinator's network address");
  EXPECT_TRUE(placement.CheckReachable(table, {{0, "w1", 0}}).ok());

  const std::string id = Submit(TinyJob(2));
  placement.Schedule(table, &out);
  EXPECT_EQ(Job(id).rec.state, JobState::kFailed);
  EXPECT_EQ(Job(id).rec.message, st.message());
  EXPECT_TRUE(out.messages.empty());
  EXPECT_EQ(table.registry.DeviceCounts()["free"], 2);
}

TEST_F(JobPlacementTest, TheNextAttemptWaitsUntilThePreviousOneIsGone) {
  JobRuntime j;
  j.ranks.resize(3);
  j.ranks[0].state = "exited";
  j.ranks[1].state = "stopped";
  j.ranks[1].gone = true;
  j.ranks[2].state = "stopped";
  j.ranks[2].dead_by_ms = 1000;
  EXPECT_FALSE(JobPlacement::PreviousAttemptGone(j, 999));
  EXPECT_TRUE(JobPlacement::PreviousAttemptGone(j, 1000));  // dead by now, reported or not
  j.restart_not_before_ms = 2000;                           // recovered: its ranks unknown
  EXPECT_FALSE(JobPlacement::PreviousAttemptGone(j, 1999));
  EXPECT_TRUE(JobPlacement::PreviousAttemptGone(j, 2000));

  AddWorker("w1", 2);
  JobRuntime& placed = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  lifecycle.FailAttempt(table, placed, "rank 0 died", false, nullptr, &out);
  ASSERT_EQ(placed.rec.state, JobState::kRestarting);
  placement.Schedule(table, &out);  // a device is free, but rank 0 may still run
  EXPECT_EQ(placed.rec.state, JobState::kRestarting);
  EXPECT_TRUE(Take<AssignmentCommand>().empty());
  clock.AdvanceMs(placed.ranks[0].dead_by_ms - clock.SteadyMs());
  placement.Schedule(table, &out);
  EXPECT_EQ(placed.rec.state, JobState::kPlaced);
  EXPECT_EQ(placed.rec.attempt, 2);
  EXPECT_EQ(Take<AssignmentCommand>().size(), 1u);
}

TEST_F(JobPlacementTest, RecomputeAutoIsSizedToTheSmallestDeviceOfTheGang) {
  const std::string id = Submit(TinyJob(2, 1, "/tmp/ck", 3, "\"auto\""));
  ASSERT_EQ(Job(id).spec.train.recompute_layers, 4);  // no device known yet: every layer
  AddWorker("w1", 1, "198.18.0.11", int64_t{16} << 30);
  AddWorker("w2", 1, "198.18.0.12", int64_t{8} << 30);
  JobRuntime& j = Job(id);  // placed when w2 opened its session
  ASSERT_EQ(j.rec.state, JobState::kPlaced);
  EXPECT_EQ(j.pending_plan, nullptr) << "taken with the placement's transition";
  absl::StatusOr<PlannedJob> stored = DecodePlannedJob(store.LoadJobs()->at(0).plan);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->plan.memory.device_memory_bytes, int64_t{8} << 30);
  EXPECT_EQ(stored->spec.train.recompute_layers, 0);
  EXPECT_EQ(j.spec.train.recompute_layers, 0);
  // The placement's event says what the re-plan changed.
  EXPECT_NE(j.events.back().message.find(
                "re-planned for the placement's devices (8.00 GiB each): train.recompute 4 -> 0 "
                "of 4 layers"),
            std::string::npos)
      << j.events.back().message;
  auto as = Take<AssignmentCommand>();
  ASSERT_EQ(as.size(), 2u);
  EXPECT_EQ(as[0].second.job->spec.train.recompute_layers, 0);
}

TEST_F(JobPlacementTest, OutOfMemoryMakesAnAutoJobRecomputeMoreFromItsNextAttempt) {
  AddWorker("w1", 2);
  JobRuntime& automatic = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-a", 3, "\"auto\""));
  ASSERT_EQ(automatic.spec.train.recompute_layers, 0);
  std::string reason = "rank 0 exited with code 3";
  placement.RecomputeMoreAfterOutOfMemory(table, automatic, &reason);
  EXPECT_EQ(reason,
            "rank 0 exited with code 3; train.recompute \"auto\": 2 of 4 layers recompute from "
            "now on");
  ASSERT_NE(automatic.pending_plan, nullptr);
  EXPECT_EQ(automatic.pending_plan->spec.train.recompute_layers, 2);
  EXPECT_EQ(automatic.spec.train.recompute_layers, 0) << "the running attempt keeps its plan";
  // The restart's transition stores the new plan, and the job takes it.
  lifecycle.FailAttempt(table, automatic, reason, false, nullptr, &out);
  EXPECT_EQ(automatic.spec.train.recompute_layers, 2);
  EXPECT_EQ(DecodePlannedJob(automatic.rec.plan)->spec.train.recompute_layers, 2);

  JobRuntime& fixed = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-b", 3, "1"));
  reason = "out of memory";
  placement.RecomputeMoreAfterOutOfMemory(table, fixed, &reason);
  EXPECT_EQ(reason, "out of memory");
  EXPECT_EQ(fixed.pending_plan, nullptr);
}

}  // namespace
}  // namespace spindle
