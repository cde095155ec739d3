// Storage types of the CUDA kernels' tensors and the one dispatch helper that turns a runtime
// DType into a template parameter, naming the unsupported value when there is no kernel for it.
#pragma once

#include <cstdint>

namespace spindle::kernels::cuda {

// Activations and bf16 weight copies are kBFloat16 in training; kFloat32 is accepted by the
// element-wise, norm and loss kernels (tests, fp32 master paths). Parameter gradients, optimizer
// state, norm statistics and Lightning states are always fp32.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

inline int64_t DTypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace spindle::kernels::cuda
