// Private: the RoPE angle of kernels/cuda, shared by the plain RoPE kernel and the fused q/k
// norm + RoPE. As in cpu::RopeApply: inv_freq = theta^(-2j/d) (fp64 pow), the angle
// pos * inv_freq and its reduction to [-pi/4, pi/4] are fp64 (positions reach 1e5 and more, where
// a fp32 angle would be off by ~1e-2); sin/cos of the reduced angle are fp32 polynomials (the CPU's). The kernels compute
// inv_freq once per block and cos/sin once per (token, frequency), shared by all heads.
#pragma once

#include <cuda_runtime.h>

namespace spindle::kernels::cuda::internal {

__device__ __forceinline__ double RopeInvFreq(int j, int d, float theta) {
  return pow(static_cast<double>(theta), -2.0 * static_cast<double>(j) / static_cast<double>(d));
}

// (cos, sin) of the fp64 angle a, to about 1 fp32 ulp for |a| up to ~1e9.
__device__ __forceinline__ void RopeCosSinOfAngle(double a, float* c, float* s) {
  const double k = rint(a * 0.63661977236758134308);  // a / (pi/2), nearest integer (ties even)
  // pi/2 = 1.57079632673412561417 (33 bits: k * hi is exact) + 6.07710050650619224932e-11.
  const float r =
      static_cast<float>((a - k * 1.57079632673412561417) - k * 6.07710050650619224932e-11);
  // sin/cos of |r| <= pi/4: the Cephes sinf/cosf polynomials, as cpu::RopeApply (no range
  // reduction left to do, so no slow path).
  const float z = r * r;
  const float sr =
      ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
  const float cr =
      ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
      0.5f * z + 1.0f;
  const int q = static_cast<int>(static_cast<long long>(k) & 3);
  // (sin, cos) of r + q*pi/2: (s, c), (c, -s), (-s, -c), (-c, s).
  switch (q) {
    case 0:
      *s = sr, *c = cr;
      break;
    case 1:
      *s = cr, *c = -sr;
      break;
    case 2:
      *s = -sr, *c = -cr;
      break;
    default:
      *s = -cr, *c = sr;
      break;
  }
}

__device__ __forceinline__ void RopeCosSin(int pos, int j, int d, float theta, float* c,
                                           float* s) {
  RopeCosSinOfAngle(static_cast<double>(pos) * RopeInvFreq(j, d, theta), c, s);
}

}  // namespace spindle::kernels::cuda::internal
