// Private: the RoPE angle of kernels/cuda, shared by the plain RoPE kernel and the fused q/k
// norm + RoPE. The angle pos * theta^(-2j/d) and its reduction to [-pi/4, pi/4] are fp64
// (positions reach 1e5 and more, where a fp32 angle would be off by ~1e-2); sin/cos are fp32.
#pragma once

#include <cuda_runtime.h>

namespace spindle::kernels::cuda::internal {

__device__ __forceinline__ void RopeCosSin(int pos, int j, int d, float theta, float* c,
                                           float* s) {
  const double inv_freq = exp2(-2.0 * static_cast<double>(j) / static_cast<double>(d) *
                               log2(static_cast<double>(theta)));
  const double a = static_cast<double>(pos) * inv_freq;
  const double k = rint(a * 0.63661977236758134308);  // a / (pi/2), nearest integer
  const float r = static_cast<float>((a - k * 1.57079632673412561417) - k * 6.07710050650619224932e-11);
  float sr, cr;
  sincosf(r, &sr, &cr);
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

}  // namespace spindle::kernels::cuda::internal
