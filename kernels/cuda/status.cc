// Status builders for the check macros: the failing expression, its file and line, and the
// library's own name for the error.
#include "kernels/cuda/status.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

namespace spindle::kernels::cuda {
namespace {

std::string Where(const char* expr, const char* file, int line) {
  return std::string(expr) + " at " + file + ":" + std::to_string(line);
}

}  // namespace

Status CudaStatus(int cuda_error, const char* expr, const char* file, int line) {
  const auto e = static_cast<cudaError_t>(cuda_error);
  return {StatusCode::kCudaError, std::string(cudaGetErrorName(e)) + " (" +
                                      cudaGetErrorString(e) + ") from " +
                                      Where(expr, file, line)};
}

Status CublasStatus(int cublas_status, const char* expr, const char* file, int line) {
  const auto s = static_cast<cublasStatus_t>(cublas_status);
  return {StatusCode::kCublasError, std::string(cublasLtGetStatusName(s)) + " (" +
                                        cublasLtGetStatusString(s) + ") from " +
                                        Where(expr, file, line)};
}

Status InvalidArgument(const std::string& what, const char* file, int line) {
  return {StatusCode::kInvalidArgument, what + " at " + file + ":" + std::to_string(line)};
}

}  // namespace spindle::kernels::cuda
