// The copies the CP exchanges make, as a small interface each backend implements: the CPU's on
// host floats (HostCopies below), the CUDA engine's as launches on its stream
// (worker/engine/cuda/cuda_model_cp.cc). The Ulysses transposition (cp_ulysses.h) is written once
// over it. Sizes and strides are in elements of the backend's activation type (elem_bytes()).
// Not thread-safe: a backend's copies belong to its step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace spindle {

class CpCopies {
 public:
  virtual ~CpCopies() = default;
  virtual int64_t elem_bytes() const = 0;
  // dst[t * dst_token + h * dst_head + e] = src[t * src_token + h * src_head + e] for t < T,
  // h < heads, e < width.
  virtual absl::Status CopyRows(void* dst, int64_t dst_token, int64_t dst_head, const void* src,
                                int64_t src_token, int64_t src_head, int64_t T, int64_t heads,
                                int64_t width) = 0;
  // `bytes` contiguous bytes.
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes) = 0;
  // Returns once the copies queued so far are done, so that a communicator may read or overwrite
  // their buffers (a device backend synchronises its stream; the host's are done already).
  virtual absl::Status Fence() = 0;
};

// The CPU backend's: fp32 host memory, copies done when they return.
class HostCopies final : public CpCopies {
 public:
  int64_t elem_bytes() const override { return sizeof(float); }
  absl::Status CopyRows(void* dst, int64_t dst_token, int64_t dst_head, const void* src,
                        int64_t src_token, int64_t src_head, int64_t T, int64_t heads,
                        int64_t width) override;
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override;
  absl::Status Fence() override { return absl::OkStatus(); }
};

}  // namespace spindle
