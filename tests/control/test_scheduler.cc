// Gang scheduling policy: all-or-nothing, priority then FIFO, no backfill, best fit, the host
// memory offloading ranks pin, admission.
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

constexpr int64_t kGiB = int64_t{1} << 30;

// A GPU worker with `host_gib` of host memory, `pinned_gib` of it pinned by running ranks.
SchedulableWorker HostW(const std::string& id, int n, int64_t host_gib, int64_t pinned_gib = 0) {
  SchedulableWorker w = W(id, n, "cuda");
  w.host_memory_bytes = host_gib * kGiB;
  w.host_pinned_bytes = pinned_gib * kGiB;
  return w;
}
SchedulableJob Offloading(const std::string& id, int64_t world, int64_t seq, int64_t host_gib) {
  SchedulableJob j = J(id, world, 0, seq, "cuda");
  j.host_bytes_per_rank = host_gib * kGiB;
  return j;
}

// Offloading ranks (train.offload) go where kHostPinFill of the host memory holds them beside
// what running ranks pin; a gang that no worker set holds waits, and later gangs see what the
// earlier ones of the round pinned.
TEST(SchedulerTest, OffloadingRanksFitTheWorkersHostMemory) {
  // 100 GiB holds two 40 GiB ranks (80%), 400 GiB eight: four ranks go to the large worker.
  auto out =
      ScheduleGangs({Offloading("a", 4, 1, 40)}, {HostW("small", 4, 100), HostW("large", 4, 400)});
  ASSERT_EQ(out.size(), 1u);
  for (const auto& r : out[0].ranks) EXPECT_EQ(r.worker_id, "large");
  // Six ranks: four on the large worker, two on the small one, whose other two GPUs stay free.
  out = ScheduleGangs({Offloading("b", 6, 1, 40), J("c", 2, 0, 2, "cuda")},
                      {HostW("small", 4, 100), HostW("large", 4, 400)});
  ASSERT_EQ(out.size(), 2u);
  ASSERT_EQ(out[0].ranks.size(), 6u);
  int on_small = 0;
  for (const auto& r : out[0].ranks) on_small += r.worker_id == "small";
  EXPECT_EQ(on_small, 2);
  ASSERT_EQ(out[1].ranks.size(), 2u);
  for (const auto& r : out[1].ranks) EXPECT_EQ(r.worker_id, "small");  // pins nothing
  // Ranks already running pin 60 of the small worker's 80 GiB: no room for another 40 there.
  out = ScheduleGangs({Offloading("d", 1, 1, 40)}, {HostW("small", 4, 100, 60)});
  EXPECT_TRUE(out.empty());
  // Two gangs of one round: the second sees the first's pinned memory.
  out = ScheduleGangs(
      {Offloading("e", 1, 1, 40), Offloading("f", 1, 2, 40), Offloading("g", 1, 3, 40)},
      {HostW("small", 4, 100)});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].job_id, "f");
  // Unknown host memory is not checked.
  out = ScheduleGangs({Offloading("h", 4, 1, 1000)}, {HostW("unknown", 4, 0)});
  EXPECT_EQ(out.size(), 1u);
}

TEST(SchedulerTest, AdmissionCountsTheHostMemoryOfOffloadingRanks) {
  EXPECT_TRUE(
      CheckCanEverFit(Offloading("a", 6, 1, 40), {HostW("small", 4, 100), HostW("large", 4, 400)})
          .ok());
  const absl::Status st =
      CheckCanEverFit(Offloading("a", 8, 1, 40), {HostW("small", 4, 100), HostW("large", 4, 400)});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "job needs 8 ranks (world = dp*cp) that pin 40.00 GiB of host memory each "
            "(train.offload), but the registered cuda workers' host memory holds only 6 such "
            "ranks (at most 80% of a worker's, the largest 400.00 GiB); set train.offload to "
            "false or add host memory");
  // What runs there now does not count: admission asks whether the job could ever run.
  EXPECT_TRUE(CheckCanEverFit(Offloading("a", 2, 1, 40), {HostW("small", 4, 100, 80)}).ok());
}

}  // namespace
}  // namespace spindle
