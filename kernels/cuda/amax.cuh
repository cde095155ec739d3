// Private: max |value| of a tensor reduced into one device float by the kernels that produce or
// read it (the FP8 recipe's amax, fp8.h). A block keeps its max in registers and shared memory and
// ends with one atomicMax on the float's bits: non-negative floats order as unsigned integers and
// NaN's bits exceed infinity's, so a NaN propagates, and a max is exact in any order (the amax is
// bitwise reproducible). The float must be zeroed before the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::kernels::cuda::internal {

// |v| as bits: ordered as unsigned integers for non-negative floats, NaN above infinity.
__device__ __forceinline__ uint32_t AbsBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t WarpMaxBits(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// *amax = max(*amax, max of v over the block). Every thread of the block calls it (blockDim.x a
// multiple of 32); a second call in the same kernel needs a __syncthreads() between (the shared
// slots are reused).
__device__ __forceinline__ void BlockMaxToGlobal(uint32_t v, float* amax) {
  __shared__ uint32_t part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMaxBits(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = static_cast<int>(blockDim.x >> 5);
    uint32_t m = lane < warps ? part[lane] : 0u;
    m = WarpMaxBits(m);
    if (lane == 0 && m != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
  }
}

}  // namespace spindle::kernels::cuda::internal
