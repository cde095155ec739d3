// bf16 in software: fp32 -> bf16 -> fp32 rounding, as the GPU stores a tensor in bf16 (CUDA's
// __float2bfloat16: round to nearest, ties to even; a finite value that rounds past the largest
// bf16 becomes inf; NaN stays NaN). The CPU engine uses it to emulate the CUDA engine's storage
// (worker/engine/numerics.h). Stateless; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

namespace spindle::kernels::cpu {

// The bf16 value nearest x, as fp32.
inline float RoundToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFF) > 0x7F800000) {
    u |= 0x00400000;  // NaN: quiet, and keep it NaN once the low half is dropped
  } else {
    u += 0x7FFF + ((u >> 16) & 1);
  }
  u &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// x[i] = RoundToBf16(x[i]) for n values, in place.
void RoundToBf16(float* x, int64_t n);

}  // namespace spindle::kernels::cpu
