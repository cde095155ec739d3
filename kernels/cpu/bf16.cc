// bf16 rounding of a buffer in place (see bf16.h).
#include "kernels/cpu/bf16.h"

namespace spindle::kernels::cpu {

void RoundToBf16(float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= 32768)
  for (int64_t i = 0; i < n; ++i) x[i] = RoundToBf16(x[i]);
}

}  // namespace spindle::kernels::cpu
