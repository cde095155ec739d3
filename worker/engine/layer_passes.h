// The order of a step's passes over the layers, written once for both engines: the embedding,
// every layer's forward (into its cache: its own, or the one the recomputing layers share), the
// LM head and the loss, then from the last layer down each layer's backward (after re-running its
// forward where it recomputes) and the embedding's backward. A backend implements the passes
// (LayerPasses: the CPU model in model.cc, the CUDA model in cuda/cuda_model_run.cc), holding what
// each needs (its buffers, its offload, its communication); Recompute says which layers recompute
// and which cache each uses.
// Not thread-safe: the passes belong to one step.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "worker/engine/model.h"
#include "worker/engine/recompute.h"

namespace spindle {

class LayerPasses {
 public:
  virtual ~LayerPasses() = default;
  virtual absl::Status Embed() = 0;
  // Layer i's forward into cache `cache`; `keep`: its activations stay for its backward (a
  // training step's layer that does not recompute).
  virtual absl::Status Forward(int64_t i, int64_t cache, bool keep) = 0;
  // The LM head and the loss, and in a training step their backward.
  virtual absl::StatusOr<LossStats> Head() = 0;
  // Layer i's backward from cache `cache`, its forward re-run into it first when `recomputes`.
  virtual absl::Status Backward(int64_t i, int64_t cache, bool recomputes) = 0;
  virtual absl::Status EmbedBackward() = 0;
};

// A training step (backward) or a forward-only pass (every layer into cache 0: pass
// Recompute::All()) of n layers.
absl::StatusOr<LossStats> RunLayerPasses(LayerPasses& passes, int64_t n, Recompute recompute,
                                         bool backward);

}  // namespace spindle
