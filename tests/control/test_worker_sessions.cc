// WorkerSessions on its own (tests/control/job_parts.h): registration, hellos (ranks re-adopted,
// resent, stopped or ignored), signs of life and lost workers, workers back after a silence,
// leaving workers, and each report kind's effect on the current attempt.
#include <string>
#include <vector>

#include "common/exit_codes.h"
#include "coordinator/worker_sessions.h"
#include "gtest/gtest.h"
#include "tests/control/job_parts.h"

namespace spindle {
namespace {

using testing::TinyJob;

class WorkerSessionsTest : public testing::JobPartsTest {
 protected:
  void Report(const std::string& worker, const WorkerReport& report) {
    sessions.HandleWorkerMessage(table, worker, report, &out);
  }
  // `worker` opens a new session listing `running`.
  void Hello(const std::string& worker, std::vector<RunningRankReport> running) {
    WorkerHello hello;
    hello.worker_id = worker;
    hello.running = std::move(running);
    ASSERT_TRUE(sessions.SessionOpened(table, hello, ++session, &out).ok());
  }
  static RankKey Key(const JobRuntime& j, int64_t rank, int64_t attempt = 0) {
    return {j.rec.job_id, attempt > 0 ? attempt : j.rec.attempt, rank};
  }
};

TEST_F(WorkerSessionsTest, RegistrationRepliesWithTheHeartbeatSettings) {
  WorkerRegistration reg;
  reg.worker_id = "w1";
  reg.hostname = "h1";
  reg.instance_id = "daemon-a";
  reg.observed_host = "198.18.0.11";
  reg.devices.push_back({"cpu", "cpu", 2, int64_t{8} << 30, 0});
  absl::StatusOr<RegistrationReply> reply = sessions.RegisterWorker(table, reg);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->heartbeat_interval_ms, 1000);
  EXPECT_EQ(reply->heartbeat_timeout_ms, 3000);
  EXPECT_EQ(reply->stop_grace_ms, 1000);
  EXPECT_EQ(reply->observed_host, "198.18.0.11");
  reg.worker_id = "";
  EXPECT_EQ(sessions.RegisterWorker(table, reg).status().message(),
            "register: worker_id must not be empty");

  EXPECT_EQ(sessions.CheckHello(table, {"w9", "x", {}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(sessions.CheckHello(table, {"w1", "daemon-b", {}}).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(sessions.CheckHello(table, {"w1", "daemon-a", {}}).ok());
  EXPECT_FALSE(table.registry.Find("w1")->connected) << "checking opens nothing";
}

TEST_F(WorkerSessionsTest, SignsOfLifeKeepAWorkerAndSilenceLosesIt) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  clock.AdvanceMs(2000);
  sessions.HeardFrom("w1");
  sessions.HeardFrom("w9");  // not registered: nothing to update
  sessions.SyncHeardLocked(table);
  Worker& w = *table.registry.Find("w1");
  EXPECT_EQ(w.last_seen_ms, clock.SteadyMs());
  EXPECT_EQ(w.last_seen_unix_ms, clock.NowMs());

  sessions.MarkLostWorkers(table, clock.SteadyMs() + options.heartbeat_timeout_ms, &out);
  EXPECT_FALSE(w.lost);
  sessions.MarkLostWorkers(table, clock.SteadyMs() + options.heartbeat_timeout_ms + 1, &out);
  EXPECT_TRUE(w.lost);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            "worker w1 lost (no heartbeat for 3.0 s) with rank 0; restart 1/3 from scratch");
  EXPECT_EQ(lost.Value(), 1);
  EXPECT_TRUE(Take<StopCommand>().empty()) << "a lost worker is not told";
}

TEST_F(WorkerSessionsTest, ALostWorkerSpeakingAgainStopsWhatItStillRuns) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  clock.AdvanceMs(options.heartbeat_timeout_ms + 1);
  sessions.MarkLostWorkers(table, clock.SteadyMs(), &out);
  ASSERT_EQ(j.rec.state, JobState::kRestarting);
  clock.AdvanceMs(100);
  Report("w1", HeartbeatReport{});
  const Worker& w = *table.registry.Find("w1");
  EXPECT_FALSE(w.lost);
  EXPECT_EQ(w.last_seen_ms, clock.SteadyMs());
  EXPECT_EQ(w.slots[0].drain_deadline_ms, clock.SteadyMs() + health.FenceMs());
  auto stops = Take<StopCommand>();
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].second.job_id, j.rec.job_id);
  EXPECT_EQ(stops[0].second.attempt, 1);
  EXPECT_EQ(stops[0].second.reason, "the gang restarted while this worker was silent");
}

TEST_F(WorkerSessionsTest, AHelloReadoptsItsRanksStopsTheUnexpectedAndIgnoresTheNeverGiven) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  std::vector<RunningRankReport> running = {{Key(j, 0), 4, 100, false, 0, 4.5}};
  running.push_back({{"j-000077", 1, 0}});        // a job this coordinator does not know
  running.push_back({Key(j, 0, /*attempt=*/5)});  // an attempt that never existed
  Hello("w1", running);
  EXPECT_EQ(j.ranks[0].state, "running");
  EXPECT_TRUE(j.ranks[0].adopted);
  EXPECT_EQ(j.ranks[0].step, 4);
  EXPECT_DOUBLE_EQ(j.ranks[0].loss, 4.5);
  auto stops = Take<StopCommand>();
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].second.job_id, "j-000077");
  EXPECT_EQ(stops[0].second.reason, "not expected by the coordinator");
  EXPECT_EQ(ignored.Value(), 1);

  // Stops for unknown jobs are bounded per hello; the rest are ignored and counted.
  running = {{Key(j, 0), 4}};  // still running it
  for (int i = 0; i < WorkerSessions::kMaxUnknownJobStopsPerReport + 2; ++i)
    running.push_back({{absl::StrCat("j-9", i), 1, 0}});
  Hello("w1", running);
  EXPECT_EQ(Take<StopCommand>().size(),
            static_cast<size_t>(WorkerSessions::kMaxUnknownJobStopsPerReport));
  EXPECT_EQ(j.rec.state, JobState::kPlaced);
  EXPECT_EQ(ignored.Value(), 3);
}

TEST_F(WorkerSessionsTest, AReconnectedWorkerWithoutItsRanksRestartsOrResends) {
  AddWorker("w1", 2);
  JobRuntime& started = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-a"));
  JobRuntime& unstarted = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-b"));
  Take<AssignmentCommand>();
  Report("w1", RankStartedReport{Key(started, 0), 100});
  Hello("w1", {});
  // Started, and gone: the gang restarts, and with its rank known gone and its device free, the
  // same pass places its next attempt. Never acknowledged (the stream broke first): sent again.
  EXPECT_EQ(lost.Value(), 1);
  const std::vector<std::string> events = Events(started);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2],
            "rank 0 was not running on worker w1 when it reconnected; restart 1/3 from scratch");
  EXPECT_EQ(events.back(), "attempt 2 placed on w1 (1 rank)");
  auto as = Take<AssignmentCommand>();
  ASSERT_EQ(as.size(), 2u);
  EXPECT_EQ(as[0].second.ref.job_id, unstarted.rec.job_id);
  EXPECT_EQ(as[0].second.ref.attempt, 1);
  EXPECT_EQ(unstarted.rec.state, JobState::kPlaced);
  EXPECT_EQ(as[1].second.ref.job_id, started.rec.job_id);
  EXPECT_EQ(as[1].second.ref.attempt, 2);
}

TEST_F(WorkerSessionsTest, ReportsCarryAnAttemptToRunningCheckpointsAndSuccess) {
  AddWorker("w1", 2);
  JobRuntime& j = SubmitAndPlace(TinyJob(2));
  Take<AssignmentCommand>();
  Report("w1", RankStartedReport{Key(j, 0), 100});
  EXPECT_EQ(j.ranks[0].state, "running");
  EXPECT_EQ(j.rec.state, JobState::kPlaced);
  RankProgressReport p;
  p.ref = Key(j, 1);
  p.step = 1;
  p.loss = 5.5;
  Report("w1", p);
  EXPECT_EQ(j.rec.state, JobState::kRunning);
  EXPECT_EQ(j.rec.message, "attempt 1: all 2 ranks started");
  EXPECT_EQ(j.ranks[1].step, 1);

  Report("w1", CheckpointDoneReport{Key(j, 1), 5, "/tmp/ck/r1"});
  Report("w1", CheckpointDoneReport{Key(j, 1), 5, "/tmp/ck/r1"});
  EXPECT_EQ(j.rec.last_checkpoint_step, 0) << "one rank twice is not every rank";
  Report("w1", CheckpointDoneReport{Key(j, 0), 5, "/tmp/ck/r0"});
  EXPECT_EQ(j.rec.last_checkpoint_step, 5);
  EXPECT_EQ(j.rec.last_checkpoint_path, "/tmp/ck/r0");  // rank 0's
  EXPECT_EQ(store.LoadJobs()->at(0).last_checkpoint_step, 5);
  Report("w1", RankNoteReport{Key(j, 1), "warming up"});
  EXPECT_EQ(Events(j).back(), "rank 1: warming up");
  EXPECT_EQ(Events(j)[Events(j).size() - 2], "checkpoint at step 5 complete: /tmp/ck/r0");

  Report("w1", RankExitReport{Key(j, 0), 0, 0, {}, false, 4.25});
  EXPECT_EQ(j.rec.state, JobState::kRunning);
  EXPECT_EQ(j.ranks[0].step, 10) << "exit 0 comes after the last step";
  Report("w1", RankExitReport{Key(j, 1), 0});
  EXPECT_EQ(j.rec.state, JobState::kSucceeded);
  EXPECT_EQ(j.rec.message, "all 2 ranks finished");
  EXPECT_EQ(j.rec.final_step, 10);
  EXPECT_EQ(rendezvous.NumOpen(), 0u);
  EXPECT_EQ(table.registry.DeviceCounts()["free"], 2);
}

// The job's goodput (coordinator/goodput.h) comes from rank 0's reports: its start, its step
// times and the checkpoints it committed; a restart's lost steps and downtime lower it.
TEST_F(WorkerSessionsTest, GoodputFollowsRankZerosReports) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob(1));
  Take<AssignmentCommand>();
  auto goodput = [&] {
    JobView v;
    lifecycle.FillJob(j, false, &v);
    return v.goodput;
  };
  Report("w1", RankStartedReport{Key(j, 0), 100});
  EXPECT_EQ(goodput(), -1);  // no step yet
  RankProgressReport p;
  p.ref = Key(j, 0);
  p.total_steps = 10;
  for (int64_t step = 1; step <= 6; ++step) {
    clock.AdvanceMs(1000);  // 1 s a step, 0.5 s of it inside the step
    p.step = step;
    p.elapsed_s = 0.5 * static_cast<double>(step);
    Report("w1", p);
    if (step == 5) Report("w1", CheckpointDoneReport{Key(j, 0), 5, "/tmp/ck/step_00000005"});
  }
  EXPECT_DOUBLE_EQ(goodput(), 3.0 / 6.0);
  // A report of an attempt never given changes nothing.
  RankProgressReport stray = p;
  stray.ref.attempt = 9;
  stray.step = 9;
  Report("w1", stray);
  EXPECT_DOUBLE_EQ(goodput(), 3.0 / 6.0);
  // Rank 0 dies; attempt 2 starts 4 s later and resumes from step 5: step 6 of attempt 1 is lost.
  Report("w1", RankExitReport{Key(j, 0), 1, 9, {"killed"}});
  placement.Schedule(table, &out);  // the gang is placed again at once: its worker is free
  ASSERT_EQ(j.rec.attempt, 2) << j.rec.message;
  clock.AdvanceMs(4000);
  Report("w1", RankStartedReport{Key(j, 0), 101});
  clock.AdvanceMs(1000);
  p.ref = Key(j, 0);
  p.step = 6;
  p.elapsed_s = 0.5;
  Report("w1", p);
  // Useful: steps 1..5 of attempt 1 and step 6 of attempt 2, 0.5 s each, over 11 s.
  EXPECT_DOUBLE_EQ(goodput(), 3.0 / 11.0);
}

// One rank reporting checkpoint steps that never complete keeps at most kMaxPendingCheckpoints
// of them, the newest; a step its peer then completes still counts, and an old one is ignored.
TEST_F(WorkerSessionsTest, CheckpointStepsThatNeverCompleteAreBounded) {
  AddWorker("w1", 2);
  JobRuntime& j = SubmitAndPlace(TinyJob(2));
  Take<AssignmentCommand>();
  const int64_t bound = WorkerSessions::kMaxPendingCheckpoints;
  for (int64_t step = 1; step <= 3 * bound; ++step)
    Report("w1", CheckpointDoneReport{Key(j, 1), step, "/tmp/ck/r1"});
  EXPECT_EQ(static_cast<int64_t>(j.checkpoints.size()), bound);
  EXPECT_EQ(j.checkpoints.begin()->first, 2 * bound + 1);
  Report("w1", CheckpointDoneReport{Key(j, 0), 1, "/tmp/ck/r0"});  // given up: older than all
  EXPECT_EQ(j.rec.last_checkpoint_step, 0);
  EXPECT_EQ(static_cast<int64_t>(j.checkpoints.size()), bound);
  Report("w1", CheckpointDoneReport{Key(j, 0), 3 * bound, "/tmp/ck/r0"});
  EXPECT_EQ(j.rec.last_checkpoint_step, 3 * bound);
  EXPECT_TRUE(j.checkpoints.empty());
  Report("w1", CheckpointDoneReport{Key(j, 1), 3 * bound, "/tmp/ck/r1"});  // complete already
  EXPECT_TRUE(j.checkpoints.empty());
}

TEST_F(WorkerSessionsTest, ARankExitRestartsTheGangOrFailsItWhenTheInputIsBad) {
  AddWorker("w1", 1, "198.18.0.11");
  AddWorker("w2", 1, "198.18.0.12");
  JobRuntime& j = SubmitAndPlace(TinyJob(2, 1, "/tmp/parts-a"));
  Take<AssignmentCommand>();
  const RankPlacement other = j.ranks[1].placement;
  sessions.SessionClosed(table, other.worker_id, /*session_id=*/999);  // a stale session
  EXPECT_TRUE(table.registry.Find(other.worker_id)->connected);
  sessions.SessionClosed(table, other.worker_id, table.registry.Find(other.worker_id)->session_id);
  const std::string first = j.ranks[0].placement.worker_id;
  Report(first, RankExitReport{Key(j, 0), 1, 0, {"Traceback", "boom"}});
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            absl::StrCat("worker ", other.worker_id,
                         " disconnected with rank 1; then rank 0 on "
                         "worker ",
                         first, " exited with code 1: boom; restart 1/3 from scratch"));
  EXPECT_EQ(rank_failed.Value(), 1);

  AddWorker("w3", 1, "198.18.0.13");
  JobRuntime& bad = SubmitAndPlace(TinyJob(1, 1, "/tmp/parts-b"));
  const std::string on = bad.ranks[0].placement.worker_id;
  Report(on, RankExitReport{Key(bad, 0), kExitInvalidInput, 0, {"data.source: no such file"}});
  EXPECT_EQ(bad.rec.state, JobState::kFailed);
  EXPECT_EQ(bad.rec.message, absl::StrCat("rank 0 on worker ", on,
                                          " exited with code 2: data.source: no such file "
                                          "(invalid input; not restarted)"));
  EXPECT_EQ(rank_failed.Value(), 1);
}

TEST_F(WorkerSessionsTest, ReportsAboutRanksNeverGivenAreIgnoredAndStaleOnesStopped) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  const std::string on = j.ranks[0].placement.worker_id;
  const std::string elsewhere = on == "w1" ? "w2" : "w1";
  EXPECT_TRUE(WorkerSessions::MayHaveGiven(table, on, Key(j, 0)));
  EXPECT_FALSE(WorkerSessions::MayHaveGiven(table, elsewhere, Key(j, 0)));
  EXPECT_FALSE(WorkerSessions::MayHaveGiven(table, on, Key(j, 0, /*attempt=*/2)));
  EXPECT_FALSE(WorkerSessions::MayHaveGiven(table, on, Key(j, 1)));          // world 1
  EXPECT_TRUE(WorkerSessions::MayHaveGiven(table, on, {"j-000077", 3, 5}));  // not known here

  RankProgressReport p;
  p.ref = Key(j, 0);
  p.step = 3;
  Report(elsewhere, p);
  EXPECT_EQ(ignored.Value(), 1);
  EXPECT_EQ(j.ranks[0].step, 0);
  EXPECT_TRUE(out.messages.empty()) << "never answered";
  p.ref = {"j-000077", 3, 5};
  Report(on, p);
  auto stops = Take<StopCommand>();
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].first, on);
  EXPECT_EQ(stops[0].second.job_id, "j-000077");
  EXPECT_EQ(stops[0].second.attempt, 3);
}

TEST_F(WorkerSessionsTest, ASilentPulsingRankRestartsItsGang) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  HeartbeatReport h;
  h.running = {{Key(j, 0), 0, 100, /*pulsing=*/true, options.silence_timeout_ms - 1}};
  Report("w1", h);
  EXPECT_EQ(j.rec.state, JobState::kPlaced);
  h.running[0].silent_ms = 6000;
  Report("w1", h);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            "rank 0 on worker w1 stopped responding (no output for 6.0 s, at step 0); restart "
            "1/3 from scratch");
  EXPECT_EQ(hang.Value(), 1);
}

TEST_F(WorkerSessionsTest, ALeavingWorkersGangsRestartAndItsSlotsFreeWhenItsSessionCloses) {
  AddWorker("w1", 1);
  JobRuntime& j = SubmitAndPlace(TinyJob());
  Take<AssignmentCommand>();
  Report("w1", LeavingReport{"SIGTERM"});
  Worker& w = *table.registry.Find("w1");
  EXPECT_TRUE(w.leaving);
  EXPECT_EQ(j.rec.state, JobState::kRestarting);
  EXPECT_EQ(j.rec.message,
            "worker w1 is shutting down (SIGTERM) with rank 0; restart 1/3 from scratch");
  EXPECT_EQ(left.Value(), 1);
  EXPECT_EQ(w.slots[0].job_id, j.rec.job_id) << "held until the rank is gone";
  sessions.SessionClosed(table, "w1", w.session_id);
  EXPECT_TRUE(w.left);
  EXPECT_TRUE(w.lost);
  EXPECT_EQ(w.slots[0].job_id, "");
}

}  // namespace
}  // namespace spindle
