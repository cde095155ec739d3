// HealthMonitor's decisions at given times: lost workers, hung gangs (a rank behind, a whole gang
// stuck, long steps that are not hangs, the start timeout), silent pulsing ranks, and the fencing
// deadline of a stopped rank on a connected or a silent worker.
#include "coordinator/health_monitor.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

HealthOptions Options() {
  HealthOptions o;
  o.heartbeat_interval_ms = 1000;
  o.heartbeat_timeout_ms = 3000;
  o.hang_timeout_ms = 5000;
  o.start_timeout_ms = 8000;
  o.silence_timeout_ms = 5000;
  o.stop_grace_ms = 2000;
  return o;
}

TEST(HealthMonitorTest, AWorkerSilentPastTheHeartbeatTimeoutIsLost) {
  const HealthMonitor h(Options());
  Worker w;
  w.last_seen_ms = 10'000;
  EXPECT_EQ(h.Lost(w, 13'000), "");
  EXPECT_EQ(h.Lost(w, 13'500), "no heartbeat for 3.5 s");
  w.lost = true;
  EXPECT_EQ(h.Lost(w, 20'000), "") << "already lost";
}

TEST(HealthMonitorTest, HangsNameTheRankBehindOrTheWholeGang) {
  const HealthMonitor h(Options());
  std::vector<RankHealth> ranks = {{0, "w1", false, 7, 1000, 100}, {1, "w2", false, 5, 1000, 100}};
  EXPECT_EQ(h.Hung(ranks, 6000), "");
  EXPECT_EQ(h.Hung(ranks, 6001),
            "rank 1 on worker w2 made no progress for 5.0 s (step 5, furthest rank at step 7)");
  ranks[1].step = 7;
  EXPECT_EQ(h.Hung(ranks, 6001), "the gang made no progress for 5.0 s (every rank at step 7)");
  // Steps longer than the hang timeout: 3 of the rank's own step time.
  ranks[0].step_ms = ranks[1].step_ms = 4000;
  EXPECT_EQ(h.Hung(ranks, 12'000), "");
  EXPECT_NE(h.Hung(ranks, 13'001), "");
  // Before the first step, the start timeout.
  std::vector<RankHealth> starting = {{0, "w1", false, 0, 1000, 0}};
  EXPECT_EQ(h.Hung(starting, 9000), "");
  EXPECT_NE(h.Hung(starting, 9001), "");
  starting[0].exited = true;
  EXPECT_EQ(h.Hung(starting, 99'000), "");
}

TEST(HealthMonitorTest, ASilentPulsingRankHasStopped) {
  const HealthMonitor h(Options());
  EXPECT_EQ(h.Silent(1, "w2", 4999, 3), "");
  EXPECT_EQ(h.Silent(1, "w2", 5000, 3),
            "rank 1 on worker w2 stopped responding (no output for 5.0 s, at step 3)");
}

TEST(HealthMonitorTest, AStoppedRankIsDeadByTheFenceDeadline) {
  const HealthMonitor h(Options());
  EXPECT_EQ(h.FenceMs(), 3000 + 2000 + 1000);
  Worker w;
  w.connected = true;
  w.last_seen_ms = 10'000;
  // Connected: its stream may break right after the stop, so from now.
  EXPECT_EQ(h.DeadBy(w, 10'400), 10'400 + 6000);
  // Silent (lost, or its session closed): it has been counting since it was last heard.
  w.connected = false;
  EXPECT_EQ(h.DeadBy(w, 13'500), 10'000 + 6000);
  w.connected = true;
  w.lost = true;
  EXPECT_EQ(h.DeadBy(w, 13'500), 10'000 + 6000);
}

}  // namespace
}  // namespace spindle
