// Device discovery (see device_discovery.h): CPU slots from /proc, GPUs from
// device_discovery_cuda.cc when built with CUDA.
#include "worker/device_discovery.h"

#include <fstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/host_memory.h"

namespace spindle {
namespace {

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "cpu";
}

}  // namespace

#ifndef SPINDLE_HAVE_CUDA
absl::StatusOr<v1::DeviceGroup> DiscoverCudaDevices() {
  return absl::NotFoundError("this build has no CUDA support");
}
#endif

absl::StatusOr<v1::DeviceGroup> DiscoverDevices(int cpu_slots, std::string* gpu_note) {
  if (gpu_note != nullptr) gpu_note->clear();
  if (cpu_slots < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--slots must be >= 0, got ", cpu_slots));
  }
  if (cpu_slots == 0) {
    absl::StatusOr<v1::DeviceGroup> gpus = DiscoverCudaDevices();
    if (gpus.ok()) {
      gpus->set_host_memory_bytes(HostMemoryLimitBytes());
      return gpus;
    }
    if (gpu_note != nullptr && !absl::IsNotFound(gpus.status()))
      *gpu_note = std::string(gpus.status().message());
    cpu_slots = 1;
  }
  v1::DeviceGroup group;
  group.set_kind("cpu");
  group.set_name(CpuModelName());
  group.set_count(cpu_slots);
  const int64_t host = HostMemoryLimitBytes();
  group.set_memory_bytes(host / cpu_slots);
  group.set_host_memory_bytes(host);
  return group;
}

}  // namespace spindle
