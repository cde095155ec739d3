// Which GPUs this build's CUDA kernels run on. The kernels are compiled for the architectures in
// CMAKE_CUDA_ARCHITECTURES (90 by default: sm_90 machine code plus compute_90 PTX, which newer
// GPUs compile when loading it), and they use Hopper instructions (stmatrix, and wgmma in the
// opt-in sweeps), so a GPU runs them when its compute capability is at least the lowest
// architecture built. The build passes that architecture as SPINDLE_CUDA_MIN_ARCH (e.g. 90).
//
// Header-only and free of CUDA headers: the worker daemon's device discovery (which links only
// the CUDA runtime) and CudaModel use the same rule and the same message. Also the GPU's dense
// bf16 peak, for model FLOP utilisation.
#pragma once

#include <string>

namespace spindle::kernels::cuda {

#ifdef SPINDLE_CUDA_MIN_ARCH
inline constexpr int kMinComputeCapability = SPINDLE_CUDA_MIN_ARCH;  // major * 10 + minor
#else
inline constexpr int kMinComputeCapability = 90;
#endif

// Empty when GPU `index` (named `name`, compute capability major.minor) runs this build's
// kernels; otherwise one sentence saying why not and what would.
inline std::string DeviceSupportProblem(int index, const std::string& name, int major, int minor,
                                        int min_capability = kMinComputeCapability) {
  if (major * 10 + minor >= min_capability) return "";
  return "GPU " + std::to_string(index) + " (" + name + ") has compute capability " +
         std::to_string(major) + "." + std::to_string(minor) +
         ", and this build's CUDA kernels need " + std::to_string(min_capability / 10) + "." +
         std::to_string(min_capability % 10) +
         " or newer (Hopper or later: they use sm_90 instructions)";
}

// The dense bf16 tensor-core peak of a GPU in FLOP/s, the denominator of model FLOP utilisation:
// the datasheet figure for the GPUs named here (H100 SXM, H200 and GH200 989.4 TFLOP/s, H100 NVL
// 835, H100 PCIe 756), otherwise `sms` x the maximum SM clock x 4096 FLOP a clock (a Hopper SM's
// dense bf16 rate).
inline double DenseBf16PeakFlops(const std::string& name, int sms, int max_clock_khz) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100 PCIe")) return 756e12;
  if (has("H100 NVL")) return 835e12;
  if (has("H100") || has("H200")) return 989.4e12;
  return static_cast<double>(sms) * max_clock_khz * 1e3 * 4096.0;
}

}  // namespace spindle::kernels::cuda
