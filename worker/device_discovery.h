// Device discovery: what the worker offers the coordinator. GPUs (count, model name, memory) come
// from the CUDA runtime in builds with CUDA (device_discovery_cuda.cc); otherwise, or when the
// machine has no GPU, or when the operator asks for CPU slots, the worker offers CPU slots.
//
// Thread-safety: free functions; safe from any thread.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle {

// The GPUs visible to this process. NotFound when there are none or the build has no CUDA;
// FailedPrecondition when this build's kernels do not run on one of them (the message says which
// and why); Internal for a CUDA runtime error (its text included).
absl::StatusOr<v1::DeviceGroup> DiscoverCudaDevices();

// `cpu_slots` > 0: that many CPU slots. `cpu_slots` == 0: the GPUs when there are any this build
// runs on, else one CPU slot; `gpu_note` (nullable) then says why GPUs that are present were not
// offered (empty otherwise). Each CPU slot is offered an equal share of host memory (MemTotal,
// capped by the process's cgroup limit, / slots); the group's host_memory_bytes is all of it.
// InvalidArgument for a negative count.
absl::StatusOr<v1::DeviceGroup> DiscoverDevices(int cpu_slots, std::string* gpu_note = nullptr);

}  // namespace spindle
