// The host's cores as CPU ranks see and share them: how many this process may run on (its CPU
// affinity: taskset, a container's cpuset; not every core the machine has online), and how the
// ranks' OpenMP threads should wait once they are more than those cores.
//
// Thread-safety: free functions; safe from any thread.
#pragma once

#include <cstdint>

namespace spindle {

// The cores in this process's CPU affinity mask; the cores online where the mask is unknown;
// at least 1.
int64_t HostCores();

// Whether `ranks` CPU ranks of `threads` OpenMP threads each, on `cores` cores, should run with
// OMP_WAIT_POLICY=passive: when their compute threads alone are more than the cores. A thread
// that spins for the next parallel region (libgomp's default, for a while after each) then holds
// a core that another rank's compute or communicator thread needs, and every exposed exchange
// waits for it (bench/CP_NOTES.md, "The two 2-core misses": cp = 2 All2All steps 2-4x
// longer on 2 cores). False where any count is unknown (< 1).
bool PassiveWaitForRanks(int64_t ranks, int64_t threads, int64_t cores);

}  // namespace spindle
