// GPU discovery through the CUDA runtime API; built only when SPINDLE_HAVE_CUDA. Queries device
// properties only (no context is created, so the daemon holds no GPU memory), and offers the
// GPUs only when this build's kernels run on every one of them (kernels/cuda/device_support.h),
// with the link class between two of them.
#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/device_support.h"
#include "worker/device_discovery.h"

namespace spindle {

absl::StatusOr<v1::DeviceGroup> DiscoverCudaDevices() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || count == 0) {
    return absl::NotFoundError("no CUDA device");
  }
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorString(err)));
  }
  cudaDeviceProp prop;
  for (int i = count - 1; i >= 0; --i) {  // ends with device 0's properties
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaGetDeviceProperties: ", cudaGetErrorString(err)));
    }
    const std::string problem =
        kernels::cuda::DeviceSupportProblem(i, prop.name, prop.major, prop.minor);
    if (!problem.empty()) return absl::FailedPreconditionError(problem);
  }
  v1::DeviceGroup group;
  group.set_kind("cuda");
  group.set_name(prop.name);
  group.set_count(count);
  group.set_memory_bytes(static_cast<int64_t>(prop.totalGlobalMem));
  // How two of the GPUs exchange data, for the planner's cost model: peer access with native
  // atomics is NVLink (PCIe peers do not offer them), peer access alone PCIe; one GPU: ranks share
  // it ("same-device"). No peer access between two GPUs leaves it unknown.
  if (count == 1) {
    group.set_link("same-device");
  } else {
    int access = 0, atomics = 0;
    if (cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, 0, 1) == cudaSuccess &&
        access != 0) {
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, 0, 1);
      group.set_link(atomics != 0 ? "nvlink" : "pcie");
    }
  }
  return group;
}

}  // namespace spindle
