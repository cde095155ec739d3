// The CPU backend's CP copies (see cp_copies.h).
#include "worker/engine/cp/cp_copies.h"

#include <cstring>

namespace spindle {

absl::Status HostCopies::CopyRows(void* dst, int64_t dst_token, int64_t dst_head, const void* src,
                                  int64_t src_token, int64_t src_head, int64_t T, int64_t heads,
                                  int64_t width) {
  float* d = static_cast<float*>(dst);
  const float* s = static_cast<const float*>(src);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(d + t * dst_token + h * dst_head, s + t * src_token + h * src_head,
                  width * sizeof(float));
  return absl::OkStatus();
}

absl::Status HostCopies::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace spindle
