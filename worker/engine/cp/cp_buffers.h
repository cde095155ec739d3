// Scratch buffers of the CP cores: grown to the size a call needs, never shrunk, so that a step
// reuses the previous step's memory. No thread-safety concerns (a buffer belongs to one model).
#pragma once

#include <cstdint>
#include <vector>

namespace spindle {

// `v` grown to at least `n` floats; its data.
inline float* Grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace spindle
