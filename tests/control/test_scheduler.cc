// Gang scheduling policy: all-or-nothing, priority then FIFO, no backfill, best fit, admission.
#include "coordinator/scheduler.h"

#include "gtest/gtest.h"

namespace spindle {
namespace {

SchedulableWorker W(const std::string& id, int n, const std::string& kind = "cpu",
                    int64_t mem = 0) {
  SchedulableWorker w;
  w.worker_id = id;
  w.kind = kind;
  w.device_memory_bytes = mem;
  w.total_devices = n;
  for (int i = 0; i < n; ++i) w.free_devices.push_back(i);
  return w;
}

SchedulableJob J(const std::string& id, int64_t world, int64_t prio, int64_t seq,
                 const std::string& kind = "cpu", int64_t mem = 0) {
  return {id, prio, seq, world, kind, mem};
}

TEST(SchedulerTest, PriorityThenSubmissionOrder) {
  auto out = ScheduleGangs({J("a", 1, 0, 1), J("b", 1, 5, 2), J("c", 1, 5, 3), J("d", 1, 0, 4)},
                           {W("w1", 3)});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].job_id, "b");
  EXPECT_EQ(out[1].job_id, "c");
  EXPECT_EQ(out[2].job_id, "a");
}

TEST(SchedulerTest, GangIsAllOrNothingAndBlocksLaterJobsOfItsKind) {
  // 4 free devices: the 6-rank gang cannot go, and the 1-rank job behind it must wait too.
  auto out = ScheduleGangs({J("big", 6, 1, 1), J("small", 1, 0, 2), J("gpu", 1, 0, 3, "cuda")},
                           {W("w1", 2), W("w2", 2), W("g1", 1, "cuda")});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].job_id, "gpu");
}

TEST(SchedulerTest, SpansWorkersWithConsecutiveRanksAndPrefersBestFit) {
  auto out = ScheduleGangs({J("a", 3, 0, 1)}, {W("w1", 2), W("w2", 4), W("w3", 3)});
  ASSERT_EQ(out.size(), 1u);
  ASSERT_EQ(out[0].ranks.size(), 3u);
  for (const auto& r : out[0].ranks) EXPECT_EQ(r.worker_id, "w3");  // smallest that fits
  out = ScheduleGangs({J("b", 5, 0, 1)}, {W("w1", 2), W("w2", 4)});
  ASSERT_EQ(out.size(), 1u);
  const auto& r = out[0].ranks;
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].worker_id, "w2");
  EXPECT_EQ(r[3].worker_id, "w2");
  EXPECT_EQ(r[3].device_index, 3);
  EXPECT_EQ(r[4].worker_id, "w1");
  EXPECT_EQ(r[4].device_index, 0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r[i].rank, i);
}

TEST(SchedulerTest, MemoryFilter) {
  auto out = ScheduleGangs({J("a", 1, 0, 1, "cuda", 100)},
                           {W("small", 4, "cuda", 50), W("large", 1, "cuda", 200)});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].ranks[0].worker_id, "large");
}

TEST(SchedulerTest, AdmissionMessages) {
  EXPECT_TRUE(CheckCanEverFit(J("a", 64, 0, 1), {}).ok());
  absl::Status st = CheckCanEverFit(J("a", 16, 0, 1), {W("w1", 4), W("w2", 4)});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "job needs 16 cpu devices (world = dp*cp) but the 2 registered cpu workers have 8 in "
            "total");
  st = CheckCanEverFit(J("a", 1, 0, 1, "cuda"), {W("w1", 4)});
  EXPECT_EQ(st.message(),
            "job needs cuda devices but no cuda worker is registered (1 worker of another kind)");
  st = CheckCanEverFit(J("a", 2, 0, 1, "cuda", 3 << 20),
                       {W("g1", 8, "cuda", 1 << 20), W("g2", 1, "cuda", 4 << 20)});
  EXPECT_EQ(st.message(),
            "job needs 2 cuda devices (world = dp*cp) with at least 3.0 MiB each, but the "
            "registered cuda workers have only 1 such devices (largest device: 4.0 MiB)");
  EXPECT_TRUE(CheckCanEverFit(J("a", 8, 0, 1), {W("w1", 4), W("w2", 4)}).ok());
}

}  // namespace
}  // namespace spindle
