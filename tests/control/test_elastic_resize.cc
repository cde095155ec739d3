// Elastic jobs in the coordinator (coordinator/elastic_resize.h) over the job manager's parts
// (tests/control/job_parts.h): a cp = 4 job that loses a worker waits parallel.elastic.wait_s for
// a replacement, then resumes at the largest world that plans and fits (never below min_world),
// its resized plan stored with the event; once devices are free again it grows back at its next
// checkpoint without spending a restart; a job placeable as it is, or still inside its wait, is
// left alone.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/elastic_resize.h"
#include "gtest/gtest.h"
#include "planner/plan_proto.h"
#include "tests/control/job_parts.h"

namespace spindle {
namespace {

using testing::TinyJob;

// A tiny cp = `cp` job of 20 steps, checkpointing every 5, elastic over [min_world, cp].
std::string ElasticJob(int64_t cp, int64_t min_world, double wait_s, const std::string& dir) {
  return absl::StrCat(R"({"name": "el", "model": {"preset": "tiny"}, "seq_len": 256,
    "data": {"source": "synthetic:recall"},
    "parallel": {"cp": )",
                      cp, R"(, "elastic": {"min_world": )", min_world, R"(, "wait_s": )", wait_s,
                      R"(}}, "train": {"steps": 20}, "checkpoint": {"dir": ")", dir,
                      R"(", "every": 5}, "resources": "cpu", "max_restarts": 3})");
}

class ElasticResizeTest : public testing::JobPartsTest {
 protected:
  void Report(const std::string& worker, const WorkerReport& report) {
    sessions.HandleWorkerMessage(table, worker, report, &out);
  }
  static RankKey Key(const JobRuntime& j, int64_t rank) {
    return {j.rec.job_id, j.rec.attempt, rank};
  }
  // Every rank of the current attempt reports checkpoint `step` from its worker.
  void Checkpoint(JobRuntime& j, int64_t step) {
    const std::vector<RankRuntime> ranks = j.ranks;
    for (const RankRuntime& r : ranks)
      Report(r.placement.worker_id,
             CheckpointDoneReport{Key(j, r.placement.rank), step, "/tmp/el/step"});
  }
  // Every rank of the current attempt starts.
  void Start(JobRuntime& j) {
    const std::vector<RankRuntime> ranks = j.ranks;
    for (const RankRuntime& r : ranks)
      Report(r.placement.worker_id, RankStartedReport{Key(j, r.placement.rank), 100});
  }
  // Every rank of the current attempt that was stopped reports its exit.
  void ExitStopped(JobRuntime& j, int64_t attempt) {
    const std::vector<RankRuntime> ranks = j.ranks;
    for (const RankRuntime& r : ranks)
      if (!table.registry.Find(r.placement.worker_id)->lost)
        Report(r.placement.worker_id,
               RankExitReport{{j.rec.job_id, attempt, r.placement.rank}, -15, 0, {}, true});
  }
  // Every worker but `id` is heard from; `id` is lost for its silence.
  void LoseWorker(const std::string& id) {
    clock.AdvanceMs(options.heartbeat_timeout_ms + 1);
    for (const auto& [wid, w] : table.registry.workers())
      if (wid != id) sessions.HeardFrom(wid);
    sessions.SyncHeardLocked(table);
    sessions.MarkLostWorkers(table, clock.SteadyMs(), &out);
    ASSERT_TRUE(table.registry.Find(id)->lost);
  }
};

TEST_F(ElasticResizeTest, ALostWorkerShrinksTheJobAfterItsWaitAndItGrowsBackAtACheckpoint) {
  for (const char* w : {"w1", "w2", "w3", "w4"}) AddWorker(w, 1);
  JobRuntime& j = SubmitAndPlace(ElasticJob(4, 2, 10, "/tmp/el"));
  ASSERT_EQ(j.ranks.size(), 4u);
  Take<AssignmentCommand>();
  Start(j);
  ASSERT_EQ(j.rec.state, JobState::kRunning);
  Checkpoint(j, 5);
  ASSERT_EQ(j.rec.last_checkpoint_step, 5);
  EXPECT_EQ(j.rec.state, JobState::kRunning) << "at max_world already: nothing to grow";

  const std::string lost_on = j.ranks[3].placement.worker_id;
  LoseWorker(lost_on);
  ASSERT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.restarts, 1);
  const int64_t lost_at = clock.SteadyMs();
  ExitStopped(j, 1);
  // The lost worker's rank is dead by its fencing deadline; until wait_s the job waits for a
  // replacement at its world.
  clock.AdvanceMs(health.FenceMs());
  placement.Schedule(table, &out);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.spec.parallel.world(), 4);
  clock.AdvanceMs(lost_at + 10000 - clock.SteadyMs() - 1);
  placement.Schedule(table, &out);
  EXPECT_EQ(j.spec.parallel.world(), 4) << "1 ms before wait_s";
  EXPECT_TRUE(Take<AssignmentCommand>().empty());

  clock.AdvanceMs(1);
  placement.Schedule(table, &out);
  // Three workers are left, but 256 tokens do not cut into 6 chunks: world 2.
  ASSERT_EQ(j.rec.state, JobState::kPlaced) << j.rec.message;
  EXPECT_EQ(j.rec.attempt, 2);
  EXPECT_EQ(j.spec.parallel.cp, 2);
  EXPECT_EQ(j.ranks.size(), 2u);
  const std::vector<std::string> events = Events(j);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2],
            "resized (no gang of world 4 could be placed within parallel.elastic.wait_s = 10 s); "
            "world 4 -> 2: cp x dp 4 x 1 -> 2 x 1; tokens per step kept at 256 "
            "(parallel.elastic.batch \"keep\"); resumes from checkpoint step 5");
  auto assigned = Take<AssignmentCommand>();
  ASSERT_EQ(assigned.size(), 2u);
  for (const auto& [worker, a] : assigned) {
    EXPECT_NE(worker, lost_on);
    EXPECT_EQ(a.job->spec.parallel.cp, 2);
    EXPECT_EQ(a.resume_step, 5);
  }
  // Stored with the resize: a restarted coordinator reads the job back at world 2.
  {
    absl::StatusOr<PlannedJob> stored = DecodePlannedJob(store.LoadJobs()->at(0).plan);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_EQ(stored->spec.parallel.world(), 2);
    JobTable again(&store, &clock, options.registry, options.rendezvous_address);
    absl::MutexLock l(&again.mu);
    ASSERT_TRUE(lifecycle.Recover(again, *store.LoadJobs()).ok());
    EXPECT_EQ(again.Find(j.rec.job_id)->spec.parallel.world(), 2);
    EXPECT_EQ(again.Find(j.rec.job_id)->ranks.size(), 2u);
  }

  Start(j);
  ASSERT_EQ(j.rec.state, JobState::kRunning);
  Checkpoint(j, 10);
  EXPECT_EQ(j.rec.state, JobState::kRunning) << "one free worker is not enough for world 4";
  AddWorker(lost_on, 1);  // back (a new session)
  ASSERT_FALSE(table.registry.Find(lost_on)->lost);
  Take<StopCommand>();
  Checkpoint(j, 15);
  ASSERT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            "growing at checkpoint step 15: world 2 -> 4: cp x dp 2 x 1 -> 4 x 1; tokens per "
            "step kept at 256 (parallel.elastic.batch \"keep\")");
  EXPECT_EQ(j.rec.restarts, 1) << "a resize spends no restart";
  EXPECT_EQ(Take<StopCommand>().size(), 2u);
  ExitStopped(j, 2);
  placement.Schedule(table, &out);
  ASSERT_EQ(j.rec.state, JobState::kPlaced) << j.rec.message;
  EXPECT_EQ(j.rec.attempt, 3);
  EXPECT_EQ(j.spec.parallel.cp, 4);
  assigned = Take<AssignmentCommand>();
  ASSERT_EQ(assigned.size(), 4u);
  for (const auto& [worker, a] : assigned) EXPECT_EQ(a.resume_step, 15);
  // Its last checkpoint is the job's end: no growth (nor anything else) there.
}

// Never below min_world: with one device free a cp = 4, min 2 job keeps waiting at world 4. A job
// that is placeable as submitted is placed as submitted; a waiting one is given a larger world
// at once when devices for it are free.
TEST_F(ElasticResizeTest, TheWorldStaysInItsRangeAndTakesTheLargestThatFits) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  JobRuntime& blocker = SubmitAndPlace(TinyJob(1, 1, "/tmp/el-blocker"));
  Take<AssignmentCommand>();
  JobRuntime& j = Job(Submit(ElasticJob(4, 2, 0, "/tmp/el-a")));
  placement.Schedule(table, &out);
  EXPECT_EQ(j.rec.state, JobState::kQueued);
  EXPECT_EQ(j.spec.parallel.world(), 4);
  EXPECT_EQ(Events(j).size(), 1u) << Events(j).back();

  AddWorker("w3", 1);
  placement.Schedule(table, &out);  // wait_s 0: world 2 at once
  ASSERT_EQ(j.rec.state, JobState::kPlaced);
  EXPECT_EQ(j.spec.parallel.world(), 2);
  EXPECT_EQ(Take<AssignmentCommand>().size(), 2u);
  EXPECT_EQ(blocker.rec.state, JobState::kPlaced);

  // max_world 4 over a job submitted at 2: placeable as it is, it is given all four at once.
  for (const char* w : {"w4", "w5", "w6", "w7"}) AddWorker(w, 1);
  JobRuntime& k = Job(Submit(absl::StrCat(
      R"({"name": "up", "model": {"preset": "tiny"}, "seq_len": 256,
          "data": {"source": "synthetic:recall"},
          "parallel": {"cp": 2, "elastic": {"min_world": 2, "max_world": 4}},
          "checkpoint": {"dir": "/tmp/el-b"}})")));
  placement.Schedule(table, &out);
  ASSERT_EQ(k.rec.state, JobState::kPlaced);
  EXPECT_EQ(k.spec.parallel.world(), 4);
  EXPECT_EQ(Events(k)[1],
            "resized (devices for a larger world are free); world 2 -> 4: cp x dp 2 x 1 -> 4 x 1; "
            "tokens per step kept at 256 (parallel.elastic.batch \"keep\")");
}

// Growing yields to waiting jobs: while a job of the same resources waits for devices, an elastic
// job does not grow at its checkpoint into devices that are free; once none waits, it grows at its
// next checkpoint.
TEST_F(ElasticResizeTest, GrowingYieldsToAJobThatWaits) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  JobRuntime& j = SubmitAndPlace(absl::StrCat(
      R"({"name": "up", "model": {"preset": "tiny"}, "seq_len": 256,
          "data": {"source": "synthetic:recall"},
          "parallel": {"cp": 2, "elastic": {"min_world": 2, "max_world": 4}},
          "train": {"steps": 20}, "checkpoint": {"dir": "/tmp/el-y", "every": 5}})"));
  ASSERT_EQ(j.spec.parallel.world(), 2);
  Take<AssignmentCommand>();
  Start(j);
  ASSERT_EQ(j.rec.state, JobState::kRunning);
  // Two devices come free; a fixed job of 3 ranks waits, as they are not enough for it.
  AddWorker("w3", 1);
  AddWorker("w4", 1);
  JobRuntime& waiting = Job(Submit(TinyJob(1, 3, "/tmp/el-w")));
  placement.Schedule(table, &out);
  ASSERT_EQ(waiting.rec.state, JobState::kQueued);
  Checkpoint(j, 5);
  EXPECT_EQ(j.rec.state, JobState::kRunning) << "grew past a waiting job: " << j.rec.message;
  EXPECT_EQ(j.spec.parallel.world(), 2);
  EXPECT_TRUE(Take<StopCommand>().empty());
  // Once the waiting job is cancelled, j grows to 4 at its next checkpoint.
  JobView view;
  ASSERT_TRUE(lifecycle.Cancel(table, waiting.rec.job_id, "test", nullptr, &view, &out).ok());
  Checkpoint(j, 10);
  ASSERT_EQ(j.rec.state, JobState::kRestarting) << j.rec.message;
  EXPECT_EQ(j.rec.message,
            "growing at checkpoint step 10: world 2 -> 4: cp x dp 2 x 1 -> 4 x 1; tokens per "
            "step kept at 256 (parallel.elastic.batch \"keep\")");
}

// A resize the store refuses changes nothing; the next pass makes it.
TEST_F(ElasticResizeTest, ARefusedResizeChangesNothing) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  JobRuntime& j = Job(Submit(ElasticJob(4, 2, 0, "/tmp/el-c")));
  store.refuse_writes = true;
  placement.Schedule(table, &out);
  EXPECT_EQ(j.rec.state, JobState::kQueued);
  EXPECT_EQ(j.spec.parallel.world(), 4);
  EXPECT_EQ(j.pending_plan, nullptr);
  store.refuse_writes = false;
  placement.Schedule(table, &out);
  EXPECT_EQ(j.rec.state, JobState::kPlaced);
  EXPECT_EQ(j.spec.parallel.world(), 2);
}

}  // namespace
}  // namespace spindle
