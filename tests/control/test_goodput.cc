// GoodputLedger: useful time is the step time of the steps that survive; a restart throws away the
// steps after the checkpoint it resumed from and its downtime counts as wall time only; coalesced
// reports spread a span's time evenly; stale attempts are ignored; the wall clock stops at the
// final step.
#include "coordinator/goodput.h"

#include <limits>

#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(GoodputTest, NothingBeforeTheFirstStep) {
  GoodputLedger g;
  EXPECT_FALSE(g.Goodput(1000).has_value());
  g.OnStart(1, 1000);
  EXPECT_FALSE(g.Goodput(5000).has_value());
}

TEST(GoodputTest, AnUninterruptedRunIsItsStepTimeOverItsWallTime) {
  GoodputLedger g;
  g.OnStart(1, 0);  // 2 s of start-up, then 10 steps of 0.8 s
  for (int s = 1; s <= 10; ++s) g.OnProgress(1, s, 0.8 * s, 100, 2000 + 800 * s);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 8.0);
  EXPECT_DOUBLE_EQ(g.WallSeconds(10000), 10.0);
  EXPECT_DOUBLE_EQ(*g.Goodput(10000), 0.8);
}

TEST(GoodputTest, ARestartLosesTheStepsAfterItsCheckpointAndItsDowntime) {
  GoodputLedger g;
  g.OnStart(1, 0);
  // Attempt 1: steps 1..30 at 1 s each (reported every 10 steps), checkpoint at 20.
  g.OnProgress(1, 10, 10.0, 100, 10000);
  g.OnProgress(1, 20, 20.0, 100, 20000);
  g.OnCheckpoint(20);
  g.OnProgress(1, 30, 30.0, 100, 30000);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 30.0);
  // Killed at 30 s; 10 s of downtime; attempt 2 resumes from 20 and runs 20 steps at 1 s.
  g.OnStart(2, 40000);
  g.OnProgress(2, 25, 5.0, 100, 45000);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 25.0);  // steps 21..30 of attempt 1 no longer count
  g.OnProgress(2, 40, 20.0, 100, 60000);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 40.0);
  EXPECT_DOUBLE_EQ(*g.Goodput(60000), 40.0 / 60.0);
}

// An attempt that says it resumed from an in-memory replica (step 28, no committed checkpoint)
// loses only the steps after it; a step the job never reached counts as the newest it did.
TEST(GoodputTest, AResumeFromAReplicaLosesOnlyTheStepsAfterIt) {
  GoodputLedger g;
  g.OnStart(1, 0);
  g.OnProgress(1, 10, 10.0, 100, 10000);
  g.OnProgress(1, 20, 20.0, 100, 20000);
  g.OnCheckpoint(20);
  g.OnProgress(1, 30, 30.0, 100, 30000);
  g.OnProgress(2, 29, 1.0, 100, 40000, /*resumed_from=*/28);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 29.0);  // 28 steps of attempt 1, one of attempt 2
  GoodputLedger h;
  h.OnProgress(1, 10, 10.0, 100, 10000);
  h.OnProgress(2, 11, 1.0, 100, 20000, /*resumed_from=*/1000);
  EXPECT_DOUBLE_EQ(h.UsefulSeconds(), 11.0);
}

TEST(GoodputTest, AResumeBetweenCoalescedReportsIsInterpolated) {
  GoodputLedger g;
  g.OnStart(1, 0);
  g.OnProgress(1, 10, 10.0, 100, 10000);
  g.OnCheckpoint(15);
  g.OnProgress(1, 20, 30.0, 100, 30000);  // steps 11..20 took 20 s: 2 s each
  g.OnProgress(2, 16, 1.0, 100, 40000);   // resumed from 15
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 10.0 + 5 * 2.0 + 1.0);
}

TEST(GoodputTest, TheNewestCheckpointBelowTheFirstStepIsTheResumePoint) {
  GoodputLedger g;
  g.OnProgress(1, 10, 10.0, 100, 10000);
  for (int64_t c : {2, 4, 6, 8}) g.OnCheckpoint(c);
  g.OnProgress(1, 12, 12.0, 100, 12000);
  // A checkpoint the job never reached (a report from elsewhere) is not a resume point; neither
  // is one at or after the new attempt's first step.
  g.OnCheckpoint(50);
  g.OnProgress(2, 7, 1.0, 100, 20000);  // resumed from 6
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 7.0);
  // Without any checkpoint the restart starts over.
  GoodputLedger h;
  h.OnProgress(1, 10, 10.0, 100, 10000);
  h.OnProgress(2, 3, 3.0, 100, 20000);
  EXPECT_DOUBLE_EQ(h.UsefulSeconds(), 3.0);
}

TEST(GoodputTest, AResumeAtTheFinalCheckpointKeepsEverything) {
  GoodputLedger g;
  g.OnStart(1, 0);
  g.OnProgress(1, 100, 50.0, 100, 60000);
  g.OnCheckpoint(100);
  // The wall clock stopped at the final step; a later restart that resumes there (its step
  // event reports the resumed step before any step ran) changes nothing.
  g.OnProgress(2, 100, 0.0, 100, 90000);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 50.0);
  EXPECT_DOUBLE_EQ(g.WallSeconds(1000000), 60.0);
}

TEST(GoodputTest, StaleAndBadReportsAreIgnored) {
  GoodputLedger g;
  g.OnStart(2, 0);
  g.OnProgress(2, 10, 10.0, 100, 10000);
  g.OnProgress(1, 50, 50.0, 100, 11000);  // an older attempt
  g.OnProgress(2, 5, 5.0, 100, 12000);    // a step already counted
  g.OnProgress(2, 11, -1.0, 100, 13000);  // a negative time
  g.OnProgress(2, 12, std::numeric_limits<double>::infinity(), 100, 13000);
  g.OnProgress(2, 12, std::numeric_limits<double>::quiet_NaN(), 100, 13000);
  g.OnProgress(2, 12, 1e300, 100, 13000);
  EXPECT_DOUBLE_EQ(g.UsefulSeconds(), 10.0);
  EXPECT_LE(*g.Goodput(13000), 1.0);
  // Nor can such a report be the first a ledger hears (its wall time would start at -inf).
  GoodputLedger fresh;
  fresh.OnProgress(1, 3, std::numeric_limits<double>::infinity(), 100, 5000);
  EXPECT_FALSE(fresh.Goodput(6000).has_value());
}

TEST(GoodputTest, ALedgerStartedMidJobCountsFromThatProcesssSteps) {
  GoodputLedger g;  // a coordinator that restarted: no start report, the gang at step 400
  g.OnProgress(3, 400, 20.0, 1000, 100000);
  EXPECT_DOUBLE_EQ(g.WallSeconds(100000), 20.0);
  EXPECT_DOUBLE_EQ(*g.Goodput(100000), 1.0);
  g.OnProgress(3, 410, 30.0, 1000, 110000);
  EXPECT_DOUBLE_EQ(*g.Goodput(110000), 1.0);
}

}  // namespace
}  // namespace spindle
