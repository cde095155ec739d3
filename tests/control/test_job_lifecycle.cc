// JobLifecycle on its own (tests/control/job_parts.h): transitions stored before the job takes
// them and retried when the store refuses one, attempts stopped (fencing deadlines, draining
// slots), failed and restarted, cancel, recovery from the store, Tick's checks of recovery windows
// and hangs, pruning, and the client's reads (event pages, job pages, waits).
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/users.h"
#include "gtest/gtest.h"
#include "tests/control/job_parts.h"

namespace spindle {
namespace {

using testing::TinyJob;

class JobLifecycleTest : public testing::JobPartsTest {};

TEST_F(JobLifecycleTest, ATransitionIsStoredBeforeTheJobTakesIt) {
  JobRuntime& j = Job(Submit(TinyJob()));
  const uint64_t version = j.version;
  store.refuse_writes = true;
  absl::Status st = lifecycle.Transition(table, j, JobState::kFailed, "gone wrong");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  // Nothing changed: the job in memory is what the store holds.
  EXPECT_EQ(j.rec.state, JobState::kQueued);
  EXPECT_EQ(j.version, version);
  EXPECT_EQ(Events(j), std::vector<std::string>{"submitted"});

  store.refuse_writes = false;
  ASSERT_TRUE(lifecycle.Transition(table, j, JobState::kFailed, "gone wrong").ok());
  EXPECT_EQ(j.rec.state, JobState::kFailed);
  EXPECT_EQ(j.rec.message, "gone wrong");
  EXPECT_GT(j.version, version);
  EXPECT_EQ(Events(j), (std::vector<std::string>{"submitted", "gone wrong"}));
  EXPECT_EQ(store.LoadJobs()->at(0).state, JobState::kFailed);
  EXPECT_EQ(store.LoadEvents(j.rec.job_id)->size(), 2u);
}

TEST_F(JobLifecycleTest, ARefusedTransitionIsRetriedByTick) {
  JobRuntime& j = Job(Submit(TinyJob()));
  store.refuse_writes = true;
  lifecycle.TransitionOrRetry(table, j, JobState::kRestarting, "again", /*add_restarts=*/1);
  ASSERT_NE(j.retry, nullptr);
  EXPECT_EQ(j.rec.state, JobState::kQueued);
  lifecycle.TickJobs(table, clock.SteadyMs(), &out);
  EXPECT_NE(j.retry, nullptr) << "still refused";
  EXPECT_EQ(j.rec.restarts, 0);

  store.refuse_writes = false;
  lifecycle.TickJobs(table, clock.SteadyMs(), &out);
  EXPECT_EQ(j.retry, nullptr);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.restarts, 1);  // added once, when the write was made
  EXPECT_EQ(store.LoadJobs()->at(0).restarts, 1);
}

TEST_F(JobLifecycleTest, StopAttemptStopsEachWorkerOnceAndSetsTheFencingDeadlines) {
  AddWorker("w1", 2);
  AddWorker("w2", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob(1, 3));
  ASSERT_EQ(Take<AssignmentCommand>().size(), 3u);
  ASSERT_EQ(rendezvous.NumOpen(), 1u);
  j.ranks[2].state = "exited";  // w2's rank already ended
  clock.AdvanceMs(500);
  lifecycle.StopAttempt(table, j, "enough", &out);

  auto stops = Take<StopCommand>();
  ASSERT_EQ(stops.size(), 1u) << "one Stop per worker with a live rank";
  EXPECT_EQ(stops[0].first, "w1");
  EXPECT_EQ(stops[0].second.job_id, j.rec.job_id);
  EXPECT_EQ(stops[0].second.attempt, 1);
  EXPECT_EQ(stops[0].second.reason, "enough");
  EXPECT_EQ(stops[0].second.grace_period_ms, options.stop_grace_ms);
  const Worker& w1 = *table.registry.Find("w1");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(j.ranks[r].state, "stopped");
    EXPECT_EQ(j.ranks[r].dead_by_ms, health.DeadBy(w1, clock.SteadyMs()));
    // The slot stays held while the rank may still run, then drains.
    EXPECT_EQ(w1.slots[j.ranks[r].placement.device_index].job_id, j.rec.job_id);
    EXPECT_EQ(w1.slots[j.ranks[r].placement.device_index].drain_deadline_ms,
              clock.SteadyMs() + health.FenceMs());
  }
  EXPECT_EQ(j.ranks[2].state, "exited");
  EXPECT_EQ(rendezvous.NumOpen(), 0u);
}

TEST_F(JobLifecycleTest, FailAttemptRestartsUntilOutOfRestartsOrFailsAtOnceWhenFatal) {
  AddWorker("w1", 3);
  JobRuntime& a = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-a", /*max_restarts=*/1));
  a.rec.last_checkpoint_step = 5;
  lifecycle.FailAttempt(table, a, "rank 0 died", false, &rank_failed, &out);
  EXPECT_EQ(a.rec.state, JobState::kRestarting);
  EXPECT_EQ(a.rec.message, "rank 0 died; restart 1/1 from checkpoint step 5");
  EXPECT_EQ(a.rec.restarts, 1);
  EXPECT_EQ(rank_failed.Value(), 1);
  EXPECT_EQ(Take<StopCommand>().size(), 1u);

  placement.Schedule(table, &out);  // the stopped rank's slot drains: the next attempt waits
  EXPECT_EQ(a.rec.attempt, 1);
  a.ranks[0].gone = true;  // its exit was reported
  placement.Schedule(table, &out);
  ASSERT_EQ(a.rec.attempt, 2);
  lifecycle.FailAttempt(table, a, "rank 0 died", false, &rank_failed, &out);
  EXPECT_EQ(a.rec.state, JobState::kFailed);
  EXPECT_EQ(a.rec.message, "rank 0 died; out of restarts (1/1)");
  EXPECT_EQ(rank_failed.Value(), 1);

  JobRuntime& b = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-b"));
  lifecycle.FailAttempt(table, b, "bad data", true, &rank_failed, &out);
  EXPECT_EQ(b.rec.state, JobState::kFailed);
  EXPECT_EQ(b.rec.message, "bad data (invalid input; not restarted)");
  EXPECT_EQ(b.rec.restarts, 0);
}

TEST_F(JobLifecycleTest, CancelIsForTheOwnerOrAnAdminAndStopsTheRanks) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  j.rec.owner = "alice";
  Take<AssignmentCommand>();
  JobView view;
  const User mallory{"mallory", false}, admin{"root", true};
  absl::StatusOr<bool> refused = lifecycle.Cancel(table, j.rec.job_id, "", &mallory, &view, &out);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.status().message(),
            "job j-000001 belongs to alice; only its owner or an admin may cancel it");
  EXPECT_EQ(lifecycle.Cancel(table, "j-000009", "", nullptr, &view, &out).status().message(),
            "job j-000009 not found");
  EXPECT_TRUE(out.messages.empty());

  absl::StatusOr<bool> done =
      lifecycle.Cancel(table, j.rec.job_id, "wrong lr", &admin, &view, &out);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  EXPECT_EQ(j.rec.state, JobState::kCancelled);
  EXPECT_EQ(view.record.state, JobState::kCancelled);
  EXPECT_EQ(view.events.back().message, "cancelled by root: wrong lr");
  EXPECT_EQ(Take<StopCommand>().size(), 1u);
  // Already finished: nothing more to do.
  done = lifecycle.Cancel(table, j.rec.job_id, "", nullptr, &view, &out);
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  EXPECT_TRUE(out.messages.empty());
}

TEST_F(JobLifecycleTest, EventsArePagedByPositionAmongAllTheJobEverHad) {
  JobRuntime& j = Job(Submit(TinyJob()));
  for (int i = 1; i <= 4; ++i)
    AddEvent(j, {j.rec.job_id, 0, 0, JobState::kQueued, absl::StrCat("e", i)});
  JobView view;
  ASSERT_TRUE(lifecycle.GetJob(table, j.rec.job_id, true, &view, {2, ""}).ok());
  ASSERT_EQ(view.events.size(), 2u);
  EXPECT_EQ(view.events[1].message, "e1");
  EXPECT_EQ(view.next_events_page_token, "events-2");
  ASSERT_TRUE(lifecycle.GetJob(table, j.rec.job_id, true, &view, {2, "events-2"}).ok());
  EXPECT_EQ(view.events[0].message, "e2");
  EXPECT_EQ(view.next_events_page_token, "events-4");
  ASSERT_TRUE(lifecycle.GetJob(table, j.rec.job_id, true, &view, {2, "events-4"}).ok());
  ASSERT_EQ(view.events.size(), 1u);
  EXPECT_EQ(view.next_events_page_token, "");
  EXPECT_EQ(lifecycle.GetJob(table, j.rec.job_id, true, &view, {0, "x"}).message(),
            "get: events_page_token \"x\" is not one that Get returned");
  EXPECT_EQ(lifecycle.GetJob(table, j.rec.job_id, true, &view, {-1, ""}).message(),
            "get: events_page_size must not be negative, got -1");
  // Events no longer kept are skipped: a token names a position, not an index.
  j.events.erase(j.events.begin(), j.events.begin() + 3);
  j.events_dropped = 3;
  ASSERT_TRUE(lifecycle.GetJob(table, j.rec.job_id, true, &view, {2, "events-2"}).ok());
  ASSERT_EQ(view.events.size(), 2u);
  EXPECT_EQ(view.events[0].message, "e3");
}

TEST_F(JobLifecycleTest, JobPagesAreNewestFirstAndFilterByStateAndOwner) {
  const std::string a = Submit(TinyJob(1, 1, "/tmp/parts-a"), "alice");
  const std::string b = Submit(TinyJob(1, 1, "/tmp/parts-b"), "bob");
  const std::string c = Submit(TinyJob(1, 1, "/tmp/parts-c"), "alice");
  Job(b).rec.state = JobState::kFailed;
  std::vector<JobView> jobs;
  std::string next;
  ASSERT_TRUE(lifecycle.ListJobPage(table, {}, 2, "", &jobs, &next, nullptr).ok());
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].record.job_id, c);
  EXPECT_EQ(jobs[1].record.job_id, b);
  ASSERT_FALSE(next.empty());
  jobs.clear();
  ASSERT_TRUE(lifecycle.ListJobPage(table, {}, 2, next, &jobs, &next, nullptr).ok());
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].record.job_id, a);
  EXPECT_EQ(next, "");
  jobs.clear();
  ASSERT_TRUE(
      lifecycle.ListJobPage(table, {JobState::kQueued}, 10, "", &jobs, &next, nullptr).ok());
  EXPECT_EQ(jobs.size(), 2u);
  jobs.clear();
  const std::string bob = "bob";
  ASSERT_TRUE(lifecycle.ListJobPage(table, {}, 10, "", &jobs, &next, &bob).ok());
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].record.job_id, b);
  EXPECT_EQ(lifecycle.ListJobPage(table, {}, 10, "nonsense", &jobs, &next, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(JobLifecycleTest, WaitReturnsTheEventsAfterTheCursor) {
  JobRuntime& j = Job(Submit(TinyJob()));
  uint64_t version = 0;
  size_t seen = 0;
  JobView view;
  std::vector<EventRecord> fresh;
  ASSERT_TRUE(
      lifecycle.WaitJob(table, j.rec.job_id, &version, &seen, absl::ZeroDuration(), &view, &fresh)
          .ok());
  EXPECT_EQ(version, j.version);
  EXPECT_EQ(seen, 1u);
  ASSERT_EQ(fresh.size(), 1u);
  // Unchanged: waits out max_wait (the table's mutex released meanwhile) and reports nothing new.
  fresh.clear();
  ASSERT_TRUE(
      lifecycle.WaitJob(table, j.rec.job_id, &version, &seen, absl::Milliseconds(1), &view, &fresh)
          .ok());
  EXPECT_TRUE(fresh.empty());
  ASSERT_TRUE(lifecycle.Transition(table, j, JobState::kFailed, "over").ok());
  ASSERT_TRUE(
      lifecycle.WaitJob(table, j.rec.job_id, &version, &seen, absl::ZeroDuration(), &view, &fresh)
          .ok());
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0].message, "over");
  EXPECT_EQ(seen, 2u);
  EXPECT_EQ(view.record.state, JobState::kFailed);
  EXPECT_EQ(
      lifecycle.WaitJob(table, "j-000009", &version, &seen, absl::ZeroDuration(), &view, &fresh)
          .code(),
      absl::StatusCode::kNotFound);
}

// What a restarted coordinator makes of the store: a live attempt's ranks hold their slots and
// wait recovery_grace for their worker; past it the gang restarts. A restart the previous process
// began waits out the fencing time.
TEST_F(JobLifecycleTest, RecoveredAttemptsWaitForTheirWorkersThenRestart) {
  AddWorker("w1", 1);
  JobRuntime& placed = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-a"));
  placed.rec.last_checkpoint_step = 5;
  ASSERT_TRUE(store.SaveJob(placed.rec, nullptr, nullptr).ok());
  JobRuntime& restarting = Job(Submit(TinyJob(1, 1, "/tmp/parts-b")));
  ASSERT_TRUE(lifecycle.Transition(table, restarting, JobState::kRestarting, "again").ok());

  JobTable again(&store, &clock, options.registry, options.rendezvous_address);
  absl::MutexLock l(&again.mu);
  ASSERT_TRUE(lifecycle.Recover(again, *store.LoadJobs()).ok());
  ASSERT_EQ(again.jobs.size(), 2u);
  const JobRuntime& p = *again.Find(placed.rec.job_id);
  ASSERT_EQ(p.ranks.size(), 1u);
  EXPECT_FALSE(p.ranks[0].adopted);
  EXPECT_EQ(p.ranks[0].step, 5);  // at least at its last complete checkpoint
  EXPECT_EQ(p.adopt_deadline_ms, clock.SteadyMs() + options.recovery_grace_ms);
  EXPECT_EQ(again.registry.Find("w1")->slots[0].job_id, p.rec.job_id);
  EXPECT_EQ(Events(p), Events(placed));
  EXPECT_EQ(again.index.size(), 2u);
  EXPECT_EQ(again.Find(restarting.rec.job_id)->restart_not_before_ms,
            clock.SteadyMs() + health.FenceMs());

  lifecycle.TickJobs(again, clock.SteadyMs() + options.recovery_grace_ms - 1, &out);
  EXPECT_EQ(p.rec.state, JobState::kPlaced);
  lifecycle.TickJobs(again, clock.SteadyMs() + options.recovery_grace_ms, &out);
  EXPECT_EQ(p.rec.state, JobState::kRestarting);
  EXPECT_EQ(p.rec.message,
            "coordinator restarted and rank 0 on worker w1 was not re-adopted within 4.0 s; "
            "restart 1/3 from checkpoint step 5");
  EXPECT_EQ(recovery.Value(), 1);
}

TEST_F(JobLifecycleTest, TickRestartsAHungGang) {
  AddWorker("w1", 2);
  JobRuntime& j = SubmitAndPlace(TinyJob(2));
  for (RankRuntime& r : j.ranks) r.state = "running";
  j.ranks[0].step = 3;
  j.ranks[1].step = 2;
  const int64_t placed = j.ranks[1].last_progress_ms;
  lifecycle.TickJobs(table, placed + options.hang_timeout_ms, &out);
  EXPECT_EQ(j.rec.state, JobState::kPlaced);
  lifecycle.TickJobs(table, placed + options.hang_timeout_ms + 1, &out);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            "rank 1 on worker w1 made no progress for 5.0 s (step 2, furthest rank at step 3); "
            "restart 1/3 from scratch");
  EXPECT_EQ(hang.Value(), 1);
  EXPECT_EQ(Take<StopCommand>().size(), 1u);
}

TEST_F(JobLifecycleTest, PruningDeletesFromTheStoreFirst) {
  options.retention = {0, 1};  // one finished job kept
  const std::string a = Submit(TinyJob(1, 1, "/tmp/parts-a"));
  const std::string b = Submit(TinyJob(1, 1, "/tmp/parts-b"));
  const std::string live = Submit(TinyJob(1, 1, "/tmp/parts-c"));
  ASSERT_TRUE(lifecycle.Transition(table, Job(a), JobState::kFailed, "x").ok());
  clock.AdvanceMs(10);
  ASSERT_TRUE(lifecycle.Transition(table, Job(b), JobState::kFailed, "y").ok());
  store.refuse_writes = true;
  EXPECT_EQ(lifecycle.PruneFinishedJobs(table).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(table.jobs.size(), 3u) << "a refused delete keeps the jobs in memory too";
  store.refuse_writes = false;
  absl::StatusOr<int64_t> pruned = lifecycle.PruneFinishedJobs(table);
  ASSERT_TRUE(pruned.ok());
  EXPECT_EQ(*pruned, 1);
  EXPECT_EQ(table.Find(a), nullptr);
  EXPECT_NE(table.Find(b), nullptr);
  EXPECT_NE(table.Find(live), nullptr);
  EXPECT_EQ(table.index.size(), 2u);
  EXPECT_EQ(store.LoadJobs()->size(), 2u);
}

TEST_F(JobLifecycleTest, TheTableKeepsTheNewestEventsAndVersionsOnlyGrow) {
  JobRuntime& j = Job(Submit(TinyJob()));
  for (int64_t i = 0; i < kMaxEventsPerJob + 2; ++i)
    AddEvent(j, {j.rec.job_id, 0, i, JobState::kQueued, absl::StrCat("e", i)});
  EXPECT_EQ(static_cast<int64_t>(j.events.size()), kMaxEventsPerJob);
  EXPECT_EQ(j.events_dropped, 3);  // "submitted", e0, e1
  EXPECT_EQ(j.events.front().message, "e2");
  const uint64_t v = j.version;
  table.Bump(j);
  EXPECT_GT(j.version, v);
  JobRuntime& k = Job(Submit(TinyJob(1, 1, "/tmp/parts-k")));
  EXPECT_GT(k.version, j.version) << "versions are the table's, not the job's";
  EXPECT_EQ(table.Find("j-000009"), nullptr);
}

}  // namespace
}  // namespace spindle
