// Private: max |value| of a tensor reduced into one device float by the kernels that produce or
// read it (the FP8 recipe's amax, fp8.h). A block keeps its max in registers and shared memory and
// ends with one atomicMax on the float's bits: non-negative floats order as unsigned integers and
// NaN's bits exceed infinity's, so a NaN propagates, and a max is exact in any order (the amax is
// bitwise reproducible). The float must be zeroed before the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda::internal {

// |v| as bits: ordered as unsigned integers for non-negative floats, NaN above infinity.
__device__ __forceinline__ uint32_t AbsBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// |v| as stored in T (rounded to it), as bits.
template <typename T>
__device__ __forceinline__ uint32_t StoredAbsBits(float v) {
  return AbsBits(ToFloat(FromFloat<T>(v)));
}

// The largest |value| of a packed vector of T values (vec.cuh), as the bits of that float: on the
// packed words, without unpacking (a bf16's bits are the top half of its float's).
template <typename T>
__device__ __forceinline__ uint32_t PackedAbsBits(const uint4& p);
template <>
__device__ __forceinline__ uint32_t PackedAbsBits<float>(const uint4& p) {
  return max(max(p.x & 0x7fffffffu, p.y & 0x7fffffffu), max(p.z & 0x7fffffffu, p.w & 0x7fffffffu));
}
template <>
__device__ __forceinline__ uint32_t PackedAbsBits<__nv_bfloat16>(const uint4& p) {
  auto two = [](uint32_t u) { return max((u & 0x7fffu) << 16, u & 0x7fff0000u); };
  return max(max(two(p.x), two(p.y)), max(two(p.z), two(p.w)));
}

__device__ __forceinline__ uint32_t WarpMaxBits(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// *amax = max(*amax, max of v over the warp): no shared memory (for kernels whose dynamic shared
// memory may take the whole allowance). Every lane of the warp calls it.
__device__ __forceinline__ void WarpMaxToGlobal(uint32_t v, float* amax) {
  v = WarpMaxBits(v);
  if ((threadIdx.x & 31) == 0 && v != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), v);
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
