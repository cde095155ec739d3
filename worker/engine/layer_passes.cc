// The order of a step's layer passes (see layer_passes.h).
#include "worker/engine/layer_passes.h"

#include "common/status.h"

namespace spindle {

absl::StatusOr<LossStats> RunLayerPasses(LayerPasses& passes, int64_t n, Recompute recompute,
                                         bool backward) {
  RETURN_IF_ERROR(passes.Embed());
  for (int64_t i = 0; i < n; ++i)
    RETURN_IF_ERROR(passes.Forward(i, recompute.CacheOf(i, n), backward && !recompute.Layer(i)));
  ASSIGN_OR_RETURN(LossStats s, passes.Head());
  if (!backward) return s;
  for (int64_t i = n - 1; i >= 0; --i)
    RETURN_IF_ERROR(passes.Backward(i, recompute.CacheOf(i, n), recompute.Layer(i)));
  RETURN_IF_ERROR(passes.EmbedBackward());
  return s;
}

}  // namespace spindle
