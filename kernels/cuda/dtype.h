// Storage types of the CUDA kernels' tensors and the one dispatch helper that turns a runtime
// DType into a template parameter, naming the unsupported value when there is no kernel for it.
#pragma once

#include <cstdint>

namespace spindle::kernels::cuda {

// Activations and bf16 weight copies are kBFloat16 in training; kFloat32 is accepted by the
// element-wise, norm and loss kernels (tests, fp32 master paths). Parameter gradients, optimizer
// state, norm statistics and Lightning states are always fp32. The two FP8 formats (OCP E4M3 "fn"
// and E5M2, one byte each) are the codes of FP8 GEMM inputs only (fp8.h, GemmArgs): no other
// kernel reads or writes them.
enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFp8E4M3 = 3,
  kFp8E5M2 = 4,
};

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kFp8E5M2:
      return "fp8_e5m2";
  }
  return "unknown";
}

inline bool IsFp8(DType t) { return t == DType::kFp8E4M3 || t == DType::kFp8E5M2; }

inline int64_t DTypeSize(DType t) {
  if (t == DType::kFloat32) return 4;
  return IsFp8(t) ? 1 : 2;
}

}  // namespace spindle::kernels::cuda
