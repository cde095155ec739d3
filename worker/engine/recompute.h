// Recompute: which layers of a training step recompute their activations. A recomputed layer
// keeps only its input through the forward (the CUDA engine also each MLA layer's attention
// output) and re-runs the rest of its forward just before its backward; the other layers keep
// every activation. The first `layers` layers recompute, as train.recompute_layers says
// (common/job_spec.h). A struct rather than a bool or a count, so that no call passes `true`
// meaning "one layer". Plain data.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace spindle {

struct Recompute {
  int64_t layers = 0;

  static constexpr Recompute None() { return {0}; }
  static constexpr Recompute All() { return {std::numeric_limits<int64_t>::max()}; }
  static constexpr Recompute First(int64_t n) { return {n}; }

  bool Layer(int64_t i) const { return i < layers; }
  // A model of n layers keeps one cache per layer that does not recompute and one, refilled
  // layer by layer, for those that do; CacheOf(i, n) is layer i's.
  int64_t NumCaches(int64_t n) const { return Shared(n) + n - Count(n); }
  int64_t CacheOf(int64_t i, int64_t n) const {
    return i < Count(n) ? 0 : Shared(n) + i - Count(n);
  }

 private:
  int64_t Count(int64_t n) const { return std::clamp<int64_t>(layers, 0, n); }  // of n recompute
  int64_t Shared(int64_t n) const { return Count(n) > 0 ? 1 : 0; }              // the shared cache
};

}  // namespace spindle
