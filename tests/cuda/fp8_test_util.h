// What the CUDA FP8 tests share beside cuda_test_util.h: the CPU emulation's name for a device FP8
// format, and the raw bytes of device codes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "kernels/cuda/dtype.h"

namespace spindle::kernels::cuda::testing {

inline cpu::Fp8Format CpuFormat(DType f) {
  return f == DType::kFp8E5M2 ? cpu::Fp8Format::kE5M2 : cpu::Fp8Format::kE4M3;
}

// n bytes from the device, after everything enqueued so far.
inline std::vector<uint8_t> DownloadBytes(const void* p, int64_t n) {
  std::vector<uint8_t> out(n);
  cudaDeviceSynchronize();
  if (n > 0) cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost);
  return out;
}

}  // namespace spindle::kernels::cuda::testing
