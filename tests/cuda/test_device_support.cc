// Which GPUs this build's kernels run on (kernels/cuda/device_support.h): the rule on chosen
// compute capabilities (no GPU needed), and every GPU of the machine, when there is one, passing
// it (the kernel tests in this binary run there); the dense bf16 peak that MFU is measured against.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda/device_support.h"
#include "tests/cuda/cuda_test_util.h"

namespace spindle::kernels::cuda {
namespace {

TEST(DeviceSupport, RefusesGpusBelowTheLowestBuiltArchitectureWithOneSentence) {
  EXPECT_EQ(DeviceSupportProblem(0, "H200", 9, 0, 90), "");
  EXPECT_EQ(DeviceSupportProblem(0, "B200", 10, 0, 90), "");  // compiles the compute_90 PTX
  EXPECT_EQ(DeviceSupportProblem(0, "A100", 8, 0, 80), "");
  const std::string a100 = DeviceSupportProblem(1, "NVIDIA A100-SXM4-80GB", 8, 0, 90);
  EXPECT_EQ(a100,
            "GPU 1 (NVIDIA A100-SXM4-80GB) has compute capability 8.0, and this build's CUDA "
            "kernels need 9.0 or newer (Hopper or later: they use sm_90 instructions)");
  EXPECT_NE(DeviceSupportProblem(0, "L40S", 8, 9, 90), "");
}

TEST(DeviceSupport, DenseBf16PeakIsTheDatasheetsOrTheSmRate) {
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H200", 132, 1980000), 989.4e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H100 80GB HBM3", 132, 1980000), 989.4e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA GH200 480GB", 132, 1980000), 989.4e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H100 PCIe", 114, 1755000), 756e12);
  EXPECT_EQ(DenseBf16PeakFlops("NVIDIA H100 NVL", 132, 1785000), 835e12);
  // A GPU not in the table: SMs x clock x 4096.
  EXPECT_DOUBLE_EQ(DenseBf16PeakFlops("NVIDIA Hopper X", 100, 1500000), 100 * 1.5e9 * 4096);
}

TEST(DeviceSupport, TheBuildsLowestArchitectureIsHopperOrLater) {
  // CMake passes the lowest entry of CMAKE_CUDA_ARCHITECTURES; Spindle's kernels need sm_90.
  EXPECT_GE(kMinComputeCapability, 90);
}

TEST(DeviceSupport, EveryGpuOfThisMachineRunsTheKernels) {
  SPINDLE_REQUIRE_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, i), cudaSuccess);
    EXPECT_EQ(DeviceSupportProblem(i, prop.name, prop.major, prop.minor), "") << prop.name;
  }
}

}  // namespace
}  // namespace spindle::kernels::cuda
