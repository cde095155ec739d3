// The small mixture-of-experts model the CPU engine's MoE tests share: tiny-moe at d_model 32, three
// layers (Lightning, Lightning, MLA; the first dense), 8 experts of width 16, top 2, a shared
// expert of 12, with bias balancing and a router z-loss.
#pragma once

#include "common/model_config.h"

namespace spindle::testing {

// norm_eps is 1e-2: Lightning's per-head q/k norms over 8 values amplify whatever a near-zero row
// holds. The experts' GEMMs run over other row counts in each layout (a rank's rows of an expert)
// and OpenBLAS's blocking follows the rows, so their outputs differ in the last bits (one seed in
// ~40 reached 1.4e-4 of the embedding's largest gradient at the default eps); and the blockwise
// FP8 recipe, which keeps such rows' small values that one tensorwise scale flushes to zero, moved
// the first layer's gradients 3-4x their size from fp32's (the dense model alike). An eps of 1e-2
// bounds the gain, as in test_cp_model.cc.
inline ModelConfig MoeTestConfig() {
  ModelConfig c = *ModelPreset("tiny-moe");
  c.d_model = 32;
  c.n_heads = 4;
  c.n_layers = 3;
  c.ffn_dim = 40;
  c.layer_pattern = "LLM";
  c.mla = {0, 12, 8, 6, 10};
  c.moe = {8, 2, 16, 12, /*bias_rate=*/0.01, /*z_loss=*/0.05, /*first_dense=*/1};
  c.norm_eps = 1e-2;
  return c;
}

}  // namespace spindle::testing
