// The host's cores as CPU ranks see them (see host_cores.h).
#include "common/host_cores.h"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace spindle {

int64_t HostCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

bool PassiveWaitForRanks(int64_t ranks, int64_t threads, int64_t cores) {
  return ranks >= 1 && threads >= 1 && cores >= 1 && ranks * threads > cores;
}

}  // namespace spindle
