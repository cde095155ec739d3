// Host memory parsing (common/host_memory.h) on fixed /proc/meminfo and cgroup texts, and this
// machine's own figures.
#include "common/host_memory.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(HostMemoryTest, ReadsAMeminfoFieldInKilobytes) {
  const char* meminfo =
      "MemTotal:       131891204 kB\n"
      "MemFree:         1234 kB\n"
      "MemAvailable:   120000000 kB\n"
      "HugePages_Total:       0\n";
  EXPECT_EQ(MeminfoBytes(meminfo, "MemTotal"), int64_t{131891204} * 1024);
  EXPECT_EQ(MeminfoBytes(meminfo, "MemAvailable"), int64_t{120000000} * 1024);
  EXPECT_EQ(MeminfoBytes(meminfo, "HugePages_Total"), 0);
  EXPECT_EQ(MeminfoBytes(meminfo, "Mem"), 0);  // a prefix of a field is not the field
  EXPECT_EQ(MeminfoBytes(meminfo, "SwapTotal"), 0);
  EXPECT_EQ(MeminfoBytes("MemTotal: lots kB\n", "MemTotal"), 0);
  EXPECT_EQ(MeminfoBytes("MemTotal: -5 kB\n", "MemTotal"), 0);
}

// cgroup v2's "max" and v1's LONG_MAX-like "no limit" are no limit (0); a pod's limit is a number.
TEST(HostMemoryTest, ReadsACgroupLimit) {
  EXPECT_EQ(CgroupBytes("549755813888\n"), int64_t{512} << 30);
  EXPECT_EQ(CgroupBytes("max\n"), 0);
  EXPECT_EQ(CgroupBytes("9223372036854771712\n"), 0);
  EXPECT_EQ(CgroupBytes(""), 0);
  EXPECT_EQ(CgroupBytes("0\n"), 0);
}

// The inactive file cache, which the working set leaves out (v2 "inactive_file", v1
// "total_inactive_file").
TEST(HostMemoryTest, ReadsAMemoryStatValue) {
  const char* stat =
      "anon 1000\n"
      "file 5000\n"
      "active_file 2000\n"
      "inactive_file 3000\n";
  EXPECT_EQ(MemoryStatValue(stat, "inactive_file"), 3000);
  EXPECT_EQ(MemoryStatValue(stat, "file"), 5000);  // the whole key, not a suffix of another
  EXPECT_EQ(MemoryStatValue(stat, "total_inactive_file"), 0);
  EXPECT_EQ(MemoryStatValue("total_inactive_file 42\n", "total_inactive_file"), 42);
}

TEST(HostMemoryTest, ThisMachineHasSomeAvailable) {
  const int64_t total = HostMemoryLimitBytes();
  const int64_t available = HostMemoryAvailableBytes();
  EXPECT_GT(total, 0);
  EXPECT_GT(available, 0);
  EXPECT_LE(available, total);
}

}  // namespace
}  // namespace spindle
