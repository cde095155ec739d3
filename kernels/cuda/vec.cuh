// Private: 16-byte vector loads and stores of bf16 / fp32 activations for the memory-bound kernels
// (norms, SwiGLU, q/k norm + RoPE). A vector holds kVec<T> values: 8 bf16 or 4 fp32. Callers check
// alignment (Aligned16) and sizes on the host and keep a scalar path for everything else.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::kernels::cuda::internal {

template <typename T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ uint4 Load16(const void* p) { return *static_cast<const uint4*>(p); }
__device__ __forceinline__ void Store16(void* p, const uint4& v) { *static_cast<uint4*>(p) = v; }

// The kVec<T> values of a 16-byte vector as floats (bf16 -> fp32 is exact).
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& u, float (&f)[kVec<T>]);
template <>
__device__ __forceinline__ void Unpack<float>(const uint4& u, float (&f)[4]) {
  f[0] = __uint_as_float(u.x);
  f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z);
  f[3] = __uint_as_float(u.w);
}
template <>
__device__ __forceinline__ void Unpack<__nv_bfloat16>(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);  // element 2i sits in the low half (little endian)
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Rounds (to nearest even, as FromFloat) and packs kVec<T> floats into a 16-byte vector.
template <typename T>
__device__ __forceinline__ uint4 Pack(const float (&f)[kVec<T>]);
template <>
__device__ __forceinline__ uint4 Pack<float>(const float (&f)[4]) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                    __float_as_uint(f[3]));
}
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(lo))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(hi))) << 16);
}
template <>
__device__ __forceinline__ uint4 Pack<__nv_bfloat16>(const float (&f)[8]) {
  return make_uint4(PackBf16x2(f[0], f[1]), PackBf16x2(f[2], f[3]), PackBf16x2(f[4], f[5]),
                    PackBf16x2(f[6], f[7]));
}

// Eight consecutive values of T from p (16-byte aligned) as floats: one bf16 vector or two fp32
// ones.
template <typename T>
__device__ __forceinline__ void Load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    Unpack<T>(Load16(p), v);
  } else {
    float a[4], b[4];
    Unpack<T>(Load16(p), a);
    Unpack<T>(Load16(p + 4), b);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = a[k], v[k + 4] = b[k];
  }
}

// Makes the compiler treat v as changed: values unpacked from it before this point are not reused
// after it (recomputed from the packed registers instead of being kept live: fewer registers).
__device__ __forceinline__ void Opaque(uint4& v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
}

// Sum over aligned groups of `width` lanes (a power of two <= 32). Every lane of the warp must
// call it (idle lanes with 0).
__device__ __forceinline__ float GroupSum(float v, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline bool IsPow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }
inline int NextPow2(int64_t x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}
inline int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

}  // namespace spindle::kernels::cuda::internal
