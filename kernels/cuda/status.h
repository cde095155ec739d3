// Status values and the check macros of the CUDA kernels. Every CUDA, cuBLASLt and CUB call is
// wrapped in one macro that records the failing expression with file and line and returns a
// Status to the caller; nothing here exits or throws. Self-contained (no Abseil), so kernels/cuda
// builds wherever nvcc does.
#pragma once

#include <string>
#include <utility>

namespace spindle::kernels::cuda {

// What went wrong, chosen by what the caller should do about it.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a size, pointer or dtype the kernel does not accept: fix the call
  kUnsupported,  // a valid value that no kernel is built for (say a head size): dispatch elsewhere
  kCudaError,    // the CUDA runtime reported an error
  kOutOfMemory,  // not enough free device memory (CachingAllocator): fit the job instead
  kCublasError,  // cuBLASLt reported an error or found no algorithm
  kCudnnError,   // cuDNN reported an error or no engine accepted the graph (sdpa.h)
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const { return ok() ? "OK" : message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Builders used by the macros; defined in status.cc.
Status CudaStatus(int cuda_error, const char* expr, const char* file, int line);
Status CublasStatus(int cublas_status, const char* expr, const char* file, int line);
Status InvalidArgument(const std::string& what, const char* file, int line);

}  // namespace spindle::kernels::cuda

// Evaluates a cudaError_t expression; returns a Status naming it when it is not cudaSuccess.
#define SPINDLE_CUDA_CHECK(expr)                                                               \
  do {                                                                                         \
    const auto spindle_err_ = (expr);                                                          \
    if (spindle_err_ != 0) {                                                                   \
      return ::spindle::kernels::cuda::CudaStatus(static_cast<int>(spindle_err_), #expr,       \
                                                  __FILE__, __LINE__);                         \
    }                                                                                          \
  } while (0)

// Checks the launch just made (cudaGetLastError); use after every <<<...>>>.
#define SPINDLE_CUDA_CHECK_LAUNCH() SPINDLE_CUDA_CHECK(cudaGetLastError())

#define SPINDLE_CUBLAS_CHECK(expr)                                                             \
  do {                                                                                         \
    const auto spindle_st_ = (expr);                                                           \
    if (spindle_st_ != 0) {                                                                    \
      return ::spindle::kernels::cuda::CublasStatus(static_cast<int>(spindle_st_), #expr,      \
                                                    __FILE__, __LINE__);                       \
    }                                                                                          \
  } while (0)

#define SPINDLE_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                         \
    ::spindle::kernels::cuda::Status spindle_s_ = (expr);                                      \
    if (!spindle_s_.ok()) return spindle_s_;                                                   \
  } while (0)

// Returns kInvalidArgument with the condition's text when cond is false.
#define SPINDLE_CHECK_ARG(cond, what)                                                          \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      return ::spindle::kernels::cuda::InvalidArgument(                                        \
          std::string(what) + " (failed: " #cond ")", __FILE__, __LINE__);                     \
    }                                                                                          \
  } while (0)
