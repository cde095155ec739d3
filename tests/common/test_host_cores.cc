// The host's cores as CPU ranks see them (common/host_cores.h): the affinity mask, not the
// machine, bounds HostCores (as taskset and a container's cpuset do); ranks whose threads are more
// than the cores wait passively, and only then.
#include <pthread.h>
#include <sched.h>

#include <thread>

#include "common/host_cores.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(HostCores, FollowsTheAffinityMask) {
  const int64_t all = HostCores();
  EXPECT_GE(all, 1);
  EXPECT_LE(all, static_cast<int64_t>(std::thread::hardware_concurrency()));
  // On a thread of its own pinned to one of its cores (sched_getaffinity(0) is the thread's).
  int64_t pinned = 0;
  std::thread t([&] {
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
    int first = 0;
    while (!CPU_ISSET(first, &set)) ++first;
    CPU_ZERO(&set);
    CPU_SET(first, &set);
    ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(set), &set), 0);
    pinned = HostCores();
  });
  t.join();
  EXPECT_EQ(pinned, 1);
  EXPECT_EQ(HostCores(), all);  // this thread's mask is unchanged
}

TEST(HostCores, PassiveWaitOnlyWhereTheComputeThreadsExceedTheCores) {
  EXPECT_TRUE(PassiveWaitForRanks(2, 2, 2));    // 4 threads on 2 cores
  EXPECT_TRUE(PassiveWaitForRanks(8, 4, 16));   // 32 on 16
  EXPECT_TRUE(PassiveWaitForRanks(1, 4, 2));    // one rank can over-subscribe too
  EXPECT_FALSE(PassiveWaitForRanks(8, 2, 16));  // exactly full: the default
  EXPECT_FALSE(PassiveWaitForRanks(1, 2, 2));
  EXPECT_FALSE(PassiveWaitForRanks(4, 2, 16));
  EXPECT_FALSE(PassiveWaitForRanks(0, 2, 2));  // unknown counts: the default
  EXPECT_FALSE(PassiveWaitForRanks(2, 0, 2));
  EXPECT_FALSE(PassiveWaitForRanks(2, 2, 0));
}

}  // namespace
}  // namespace spindle
